"""The learner and its actors on real network interfaces: hosts made of Linux network namespaces
(as root), the learner's joined to each actor's by a veth pair on a bridge, every one with its own
address in the benchmarking range 198.18.0.0/15 (never routed to the machine's interfaces).

Checked there: the learner refuses a non-loopback address without CURVE keys; with keys the actors
connect and train; an actor whose link is cut for 30 s loses nothing acknowledged while the learner
trains the other one, and comes back; an actor with a key the learner does not know is refused
and counted; the learner restarted on the same addresses is found again by the actors. Every
namespace (and with it every veth and the bridge) is deleted afterwards, also when the test fails."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.analysis.jsonl import quiet_records

from tests.conftest import ROOT, subprocess_env

LEARNER_IP = "198.18.0.1"
DEADLINE_S = 240


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Hosts:
    """A learner namespace with a bridge, and ``n`` actor namespaces, each on a veth pair."""

    def __init__(self, n: int):
        tag = secrets.token_hex(3)
        self.learner = f"arl{tag}L"
        self.actors = [f"arl{tag}A{i}" for i in range(n)]
        self.ports = [f"v{tag}L{i}" for i in range(n)]  # the learner's end of each pair (on the bridge)
        self.ips = [f"198.18.0.{10 + i}" for i in range(n)]
        self.made: list[str] = []

    def __enter__(self) -> "Hosts":
        try:
            for ns in (self.learner, *self.actors):
                _ip("netns", "add", ns)
                self.made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.learner, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.learner, "addr", "add", f"{LEARNER_IP}/24", "dev", "br0")
            _ip("-n", self.learner, "link", "set", "br0", "up")
            for ns, port, addr in zip(self.actors, self.ports, self.ips):
                _ip("-n", self.learner, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.learner, "link", "set", port, "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.made:  # its processes first, then the namespace (its veths and bridge go with it)
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        self.made = []

    def run(self, ns: str, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        with open(log, "ab") as f:
            return subprocess.Popen(["ip", "netns", "exec", ns, *argv], cwd=ROOT, env=env or subprocess_env(),
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl", *args]


def _lines(path: Path) -> list[dict]:
    return quiet_records(path)


def _until(cond, what: str, procs: dict[str, subprocess.Popen], logs: Path, timeout: float = DEADLINE_S) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        for name, p in procs.items():
            if p.poll() is not None and p.returncode != 0:
                raise AssertionError(f"{name} exited with {p.returncode} waiting for {what}:\n" +
                                     "\n".join(f"{q.name}: {q.read_text()[-1500:]}" for q in sorted(logs.glob("*.log"))))
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}:\n" +
                         "\n".join(f"{q.name}: {q.read_text()[-1500:]}" for q in sorted(logs.glob("*.log"))))


def _stop(p: subprocess.Popen, timeout: float = 60) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail("network namespaces need root and iproute2 (make test installs iproute2)")
    with Hosts(2) as h:
        yield h


@pytest.mark.slow
def test_learner_and_actors_on_real_interfaces(hosts, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    keys = tmp_path / "keys"
    from asyncrl.schedulers.slurm import BUNDLE_ENV, bundle_env
    from asyncrl.wire.sockets import make_curve_keys

    made = make_curve_keys(str(keys), ["0", "1", "9"])
    stranger = made["actor-9"]  # the learner's public key, but a pair the learner does not admit:
    (keys / "server" / "authorized" / "actor-9.key").unlink()
    run = tmp_path / "runs" / "net"
    common = ["-c", "configs/quickstart.yaml", f"run_root={tmp_path / 'runs'}", "name=net", "eval.size=20",
              "eval.every=100000", "checkpoint.every=100000", "log.episode_events=all", "train.total_steps=100000",
              "wire.lease_s=10", "actor.heartbeat_s=1"]
    ports = ["wire.control_port=47001", "wire.episodes_port=47002", "wire.weights_port=47003", "wire.events_port=47004"]

    # 1. a non-loopback address without keys: refused in one line, nothing bound
    refused = subprocess.run(["ip", "netns", "exec", hosts.learner, *_cli("learn", *common, f"wire.host={LEARNER_IP}")],
                             cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "CURVE" in refused.stderr, refused.stdout + refused.stderr
    assert not (run / "addresses.json").exists()

    procs: dict[str, subprocess.Popen] = {}
    try:
        learner_args = _cli("learn", *common, *ports, f"wire.host={LEARNER_IP}", f"wire.curve_dir={keys / 'server'}",
                            "--overwrite")
        procs["learner"] = hosts.run(hosts.learner, learner_args, logs / "learner.log")
        _until(lambda: (run / "addresses.json").exists(), "the learner's addresses", procs, logs)
        control = json.loads((run / "addresses.json").read_text())["control"]
        assert control.startswith(f"tcp://{LEARNER_IP}:"), control
        # actor-0 with its bundle directory; actor-1 with its bundle in the environment (how the
        # SLURM scheduler hands it to another node)
        procs["actor-0"] = hosts.run(hosts.actors[0], _cli("serve", *common, "--connect", control, "--actor-id",
                                                           "actor-0", f"wire.curve_dir={made['actor-0']}"),
                                     logs / "actor-0.log")
        procs["actor-1"] = hosts.run(hosts.actors[1], _cli("serve", *common, "--connect", control, "--actor-id",
                                                           "actor-1", "--index", "1"), logs / "actor-1.log",
                                     env={**subprocess_env(), BUNDLE_ENV: bundle_env(Path(made["actor-1"]))})

        def trained_by(actor: str) -> list[dict]:
            return [e for e in _lines(run / "events.jsonl") if e.get("kind") == "episode" and e.get("actor_id") == actor]

        _until(lambda: trained_by("actor-0") and trained_by("actor-1"), "episodes from both actors over the veths",
               procs, logs)

        # 2. a stranger's key is refused, and counted
        procs["stranger"] = hosts.run(hosts.actors[1], _cli("serve", *common, "--connect", control, "--actor-id",
                                                            "actor-9", f"wire.curve_dir={stranger}"),
                                      logs / "stranger.log")
        _until(lambda: any(e.get("kind") == "connection_refused" and e.get("reason") == "curve_key"
                           for e in _lines(run / "events.jsonl")), "the stranger refused", procs, logs)
        _until(lambda: "refused this actor's CURVE key" in (logs / "stranger.log").read_text(),
               "the stranger saying it was refused", procs, logs)
        _stop(procs.pop("stranger"))

        # 3. actor-0's link cut for 30 s: the learner trains actor-1's episodes meanwhile
        _ip("-n", hosts.learner, "link", "set", hosts.ports[0], "down")
        cut_at = time.time()
        steps_at_cut = len(_lines(run / "metrics.jsonl"))
        time.sleep(30)
        assert len(_lines(run / "metrics.jsonl")) > steps_at_cut + 3, "the learner stopped while one link was down"
        last_before = max(e["step"] for e in trained_by("actor-0"))
        _ip("-n", hosts.learner, "link", "set", hosts.ports[0], "up")
        _until(lambda: max(e["step"] for e in trained_by("actor-0")) > last_before, "actor-0 training again", procs, logs)
        assert time.time() - cut_at >= 30
        m = _lines(run / "metrics.jsonl")[-1]
        trained = [e for e in _lines(run / "events.jsonl") if e.get("kind") == "episode" and e["step"] <= m["step"]]
        assert m["episodes_acked"] == len(trained) + m["buffer_size"] + m["dropped_stale"], m  # nothing acked lost
        ids = [e["episode_id"] for e in trained]
        assert len(ids) == len(set(ids))

        # 4. the learner restarted on the same addresses: both actors find it again
        _stop(procs.pop("learner"))
        steps_before = len(_lines(run / "metrics.jsonl"))
        procs["learner"] = hosts.run(hosts.learner, [a for a in learner_args if a != "--overwrite"] + ["--resume"],
                                     logs / "learner2.log")
        _until(lambda: len(_lines(run / "metrics.jsonl")) > steps_before + 3 and
               max(e["step"] for e in trained_by("actor-0")) > steps_before and
               max(e["step"] for e in trained_by("actor-1")) > steps_before,
               "training by both actors after the restart", procs, logs)
        ids = [e["episode_id"] for e in _lines(run / "events.jsonl") if e.get("kind") == "episode"]
        assert len(ids) == len(set(ids)), "an episode was trained twice across the restart"
    finally:
        for p in procs.values():
            _stop(p, timeout=30)
