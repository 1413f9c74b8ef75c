"""The learner and its actors on real network interfaces: hosts made of Linux network namespaces
(as root, ``asyncrl/testing/netns.py``), each joined by a veth pair to a bridge and with its own address in
the benchmarking range 198.18.0.0/15 (never routed to the machine's interfaces).

Checked there: the learner refuses a non-loopback address without CURVE keys; with keys the actors
connect and train; an actor whose link is cut for 30 s loses nothing acknowledged while the learner
trains the other one, and comes back; an actor with a key the learner does not know is refused
and counted; the learner restarted on the same addresses is found again by the actors. Every
namespace (and with it every veth and the bridge) is deleted afterwards, also when the test fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.analysis.jsonl import quiet_records
from asyncrl.testing import netns
from tests.conftest import ROOT, subprocess_env

DEADLINE_S = 240


def _start(hosts, host: int, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return hosts.run(host, argv, log, env=env or subprocess_env(), cwd=ROOT)


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
                raise AssertionError(
                    f"{name} exited with {p.returncode} waiting for {what}:\n"
                    + "\n".join(f"{q.name}: {q.read_text()[-1500:]}" for q in sorted(logs.glob("*.log")))
                )
        time.sleep(0.5)
    raise AssertionError(
        f"timed out waiting for {what}:\n"
        + "\n".join(f"{q.name}: {q.read_text()[-1500:]}" for q in sorted(logs.glob("*.log")))
    )


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
    why = netns.available()
    if why:
        pytest.fail(why)
    with netns.Hosts(3) as h:  # the learner on host 0, actor-0 on host 1, actor-1 on host 2
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
    common = [
        "-c",
        "configs/quickstart.yaml",
        f"run_root={tmp_path / 'runs'}",
        "name=net",
        "eval.size=20",
        "eval.every=100000",
        "checkpoint.every=100000",
        "log.episode_events=all",
        "train.total_steps=100000",
        "wire.lease_s=10",
        "actor.heartbeat_s=1",
    ]
    ports = ["wire.control_port=47001", "wire.episodes_port=47002", "wire.weights_port=47003", "wire.events_port=47004"]

    # 1. a non-loopback address without keys: refused in one line, nothing bound
    refused = subprocess.run(
        hosts.argv(0, _cli("learn", *common, f"wire.host={hosts.ips[0]}")),
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "CURVE" in refused.stderr, refused.stdout + refused.stderr
    assert not (run / "addresses.json").exists()

    procs: dict[str, subprocess.Popen] = {}
    try:
        learner_args = _cli(
            "learn", *common, *ports, f"wire.host={hosts.ips[0]}", f"wire.curve_dir={keys / 'server'}", "--overwrite"
        )
        procs["learner"] = _start(hosts, 0, learner_args, logs / "learner.log")
        _until(lambda: (run / "addresses.json").exists(), "the learner's addresses", procs, logs)
        control = json.loads((run / "addresses.json").read_text())["control"]
        assert control.startswith(f"tcp://{hosts.ips[0]}:"), control
        # actor-0 with its bundle directory; actor-1 with its bundle in the environment (how the
        # SLURM scheduler hands it to another node)
        procs["actor-0"] = _start(
            hosts,
            1,
            _cli("serve", *common, "--connect", control, "--actor-id", "actor-0", f"wire.curve_dir={made['actor-0']}"),
            logs / "actor-0.log",
        )
        procs["actor-1"] = _start(
            hosts,
            2,
            _cli("serve", *common, "--connect", control, "--actor-id", "actor-1", "--index", "1"),
            logs / "actor-1.log",
            env={**subprocess_env(), BUNDLE_ENV: bundle_env(Path(made["actor-1"]))},
        )

        def trained_by(actor: str) -> list[dict]:
            return [
                e for e in _lines(run / "events.jsonl") if e.get("kind") == "episode" and e.get("actor_id") == actor
            ]

        _until(
            lambda: trained_by("actor-0") and trained_by("actor-1"),
            "episodes from both actors over the veths",
            procs,
            logs,
        )

        # 2. a stranger's key is refused, and counted
        procs["stranger"] = _start(
            hosts,
            2,
            _cli("serve", *common, "--connect", control, "--actor-id", "actor-9", f"wire.curve_dir={stranger}"),
            logs / "stranger.log",
        )
        _until(
            lambda: any(
                e.get("kind") == "connection_refused" and e.get("reason") == "curve_key"
                for e in _lines(run / "events.jsonl")
            ),
            "the stranger refused",
            procs,
            logs,
        )
        _until(
            lambda: "refused this actor's CURVE key" in (logs / "stranger.log").read_text(),
            "the stranger saying it was refused",
            procs,
            logs,
        )
        _stop(procs.pop("stranger"))

        # 3. actor-0's link cut for 30 s: the learner trains actor-1's episodes meanwhile
        hosts.cut(1)
        cut_at = time.time()
        steps_at_cut = len(_lines(run / "metrics.jsonl"))
        time.sleep(30)
        assert len(_lines(run / "metrics.jsonl")) > steps_at_cut + 3, "the learner stopped while one link was down"
        last_before = max(e["step"] for e in trained_by("actor-0"))
        hosts.restore(1)
        _until(
            lambda: max(e["step"] for e in trained_by("actor-0")) > last_before, "actor-0 training again", procs, logs
        )
        assert time.time() - cut_at >= 30
        m = _lines(run / "metrics.jsonl")[-1]
        trained = [e for e in _lines(run / "events.jsonl") if e.get("kind") == "episode" and e["step"] <= m["step"]]
        # nothing acked lost (the task ledger's duplicates: acknowledged, recorded, not trained; issue 66)
        dupes = m.get("ledger/duplicates_total", 0)
        assert m["episodes_acked"] == len(trained) + m["buffer_size"] + m["dropped_stale"] + dupes, m
        ids = [e["episode_id"] for e in trained]
        assert len(ids) == len(set(ids))

        # 4. the learner restarted on the same addresses: both actors find it again
        _stop(procs.pop("learner"))
        steps_before = len(_lines(run / "metrics.jsonl"))
        procs["learner"] = _start(
            hosts, 0, [a for a in learner_args if a != "--overwrite"] + ["--resume"], logs / "learner2.log"
        )
        _until(
            lambda: (
                len(_lines(run / "metrics.jsonl")) > steps_before + 3
                and max(e["step"] for e in trained_by("actor-0")) > steps_before
                and max(e["step"] for e in trained_by("actor-1")) > steps_before
            ),
            "training by both actors after the restart",
            procs,
            logs,
        )
        ids = [e["episode_id"] for e in _lines(run / "events.jsonl") if e.get("kind") == "episode"]
        assert len(ids) == len(set(ids)), "an episode was trained twice across the restart"
    finally:
        for p in procs.values():
            _stop(p, timeout=30)


def test_a_killed_runs_namespaces_are_swept_and_a_live_runs_kept():
    """64.10: a test run killed at its time limit left its namespaces behind; the next Hosts sweeps those
    whose test process is gone (and only those), with any process still in them."""
    why = netns.available()
    if why:
        pytest.fail(f"{why}: make test runs as root with iproute2")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"arl{os.urandom(3).hex()}p{dead.pid}H0", f"arl{os.urandom(3).hex()}p{os.getpid()}H0"
    try:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "add", name], check=True)
        sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"], start_new_session=True)
        gone = netns.sweep_stale()
        assert stale in gone and live not in gone, gone
        assert sleeper.wait(timeout=60) != 0  # its process was killed first
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in names and live in names
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
