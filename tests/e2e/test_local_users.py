"""No trust in loopback (issue 41): another local user (a process that drops to uid 65534 after it
starts, ``tests/support/other_user.py``) reaches no channel of a run, and an authorised peer cannot speak
for another. Real processes and real sockets throughout; every process is stopped in a ``finally``.

- 41.1: the weights channel, which carried the policy and the rendezvous store's secret to anyone,
  the control, episode and event channels, and the run directory's files;
- 41.2: an actor's identity (``actor-0:<pid>``) taken over by a connection that names it;
  under CURVE (loopback too), a key speaking for another actor;
- 41.3: a dead relay's address, bound by someone else to serve weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import zmq

from asyncrl.config import load_config
from asyncrl.learner.ingest.server import LearnerServer
from asyncrl.testing.peer_attacks import LiveRun
from asyncrl.wire.codec import WireError, decode, encode
from asyncrl.wire.messages import Hello, Status, Subscribe
from asyncrl.wire.sockets import WireSecurityError, make_curve_keys
from tests.conftest import ROOT, subprocess_env
from tests.conftest import SMALL_RUN as COMMON

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing another local user needs root (setuid)")
DEADLINE_S = 240


def other_user(attack: str, seconds: float, *args: str) -> dict:
    """Run one attack as uid 65534 (``tests.support.other_user``) and return what it reported."""
    res = subprocess.run(
        [sys.executable, "-m", "tests.support.other_user", attack, str(seconds), *args],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=seconds + 120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["uid"] == 65534
    return out


@needs_root
@pytest.mark.slow
def test_another_user_reaches_no_channel_and_no_file_of_a_run(tmp_path, tiny_overrides):
    """41.1: with ``sync.type=nccl`` the learner's ``weights`` message carries the rendezvous store's
    secret; before, any local user could subscribe to it (and to the weights themselves). Now every
    channel is an ipc socket in the run's private directory and the run directory is mode 0700."""
    run = LiveRun(
        tmp_path,
        "private",
        [
            *tiny_overrides,
            *COMMON,
            "train.total_steps=100000",
            "checkpoint.every=5",
            "sync.type=nccl",
            "sync.backend=gloo",
        ],
    )
    try:
        run.actor("actor-0", 0)
        assert run.wait_version(2, DEADLINE_S) is not None, run.log_tail(lines=20)
        assert all(a.startswith("ipc://") for a in run.addresses.values()), run.addresses
        sock_dir = os.path.dirname(run.addresses["control"][len("ipc://") :])
        assert os.stat(sock_dir).st_mode & 0o777 == 0o700 and os.stat(run.dir).st_mode & 0o777 == 0o700
        got = {
            attack: other_user(attack, 5, run.addresses[channel])
            for attack, channel in (
                ("subscribe", "weights"),
                ("hello", "control"),
                ("push", "episodes"),
                ("events", "events"),
            )
        }
        for attack, out in got.items():
            assert not out["connected"] and not out["received"], (attack, out)
        assert run.wait(lambda: list((run.dir / "checkpoints").glob("step_*")), DEADLINE_S)
        files = [
            str(run.dir / "addresses.json"),
            str(run.dir / "config.yaml"),
            str(run.dir / "events.jsonl"),
            *map(str, (run.dir / "checkpoints").rglob("*.safetensors")),
        ]
        assert other_user("read", 1, *files)["readable"] == []
        # 63.1: every file of the run is this user's alone (umask 077), not only the weights
        shared = [
            str(p.relative_to(run.dir))
            for p in run.dir.rglob("*")
            if not p.is_symlink() and p.suffix != ".log" and os.stat(p).st_mode & 0o077
        ]
        assert shared == [], shared
        assert other_user("bind", 1, sock_dir)["bound"] is False  # nor can it put a socket of its own there
        v = run.version()
        assert run.wait_version(v + 2, DEADLINE_S) is not None, run.log_tail(lines=20)  # training went on
        assert not any(e.get("actor_id") == "intruder" for e in run.events())
    finally:
        run.stop()


@pytest.mark.slow
def test_an_actor_identity_cannot_be_taken_over(tmp_path, tiny_overrides):
    """41.2: a DEALER connection naming ``actor-0:<pid>`` (the pid is in ``ps`` and in
    ``actor_status`` events) took the actor's acks and credits, and training stopped for minutes. An
    actor's identity now ends in a random part that no one but the learner hears."""
    run = LiveRun(tmp_path, "takeover", [*tiny_overrides, *COMMON, "train.total_steps=100000"])
    socks = []
    try:
        actor = run.actor("actor-0", 0)
        assert run.wait_version(3, DEADLINE_S) is not None, run.log_tail(lines=20)
        ctx = zmq.Context.instance()
        for channel in ("control", "weights"):
            for identity in (f"actor-0:{actor.pid}", f"actor-0:{actor.pid}:hb"):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.IDENTITY, identity.encode())
                s.connect(run.addresses[channel])
                socks.append(s)
        v = run.version()  # while the connections naming its identity stay open, the real actor trains on
        assert run.wait_version(v + 3, 60) is not None, run.log_tail(lines=20)
        for s in socks:  # and the connections that named its identity heard nothing meant for it
            assert not s.poll(0), decode(s.recv_multipart()).kind
    finally:
        for s in socks:
            s.close(0)
        run.stop()


@pytest.fixture
def curve_net(tmp_path):
    """A learner's sockets on TCP loopback under CURVE, with keys for actor-0 and actor-1."""
    keys = tmp_path / "keys"
    make_curve_keys(str(keys), ["0", "1"])
    cfg = load_config(None, [f"wire.curve_dir={keys}", "wire.lease_s=30"]).wire
    errors: list = []
    net = LearnerServer(cfg, lambda ch, e: errors.append((ch, e)))
    net.errors, net.keys = errors, keys
    yield net
    net.close()


def _client(net, bundle: str, identity: str, channel: str = "control") -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, identity.encode())
    from asyncrl.wire.sockets import apply_curve_client

    apply_curve_client(s, str(net.keys / bundle))
    s.connect(net.addresses[channel])
    return s


def _pump(net, until, seconds: float = 20) -> list:
    got, deadline = [], time.time() + seconds
    while time.time() < deadline and not until(got):
        _, control = net.poll(50)
        for identity, msg in control:
            try:
                net.handle_control(identity, msg)
            except WireError as e:
                net.errors.append(("control", e))
            got.append((identity, msg))
    return got


def test_curve_on_loopback_binds_each_key_to_its_actor(curve_net):
    """41.2 under CURVE (TCP, loopback too): actor-1's key cannot say hello, heartbeat, subscribe or
    push episodes as actor-0, nor under actor-0's identity; actor-0's own key can."""
    net = curve_net
    assert all(a.startswith("tcp://127.0.0.1:") for a in net.addresses.values())
    a0 = _client(net, "actor-0", "actor-0:1:aa")
    imp = [_client(net, "actor-1", "actor-1:2:bb"), _client(net, "actor-1", "actor-0:3:cc")]
    sub = _client(net, "actor-1", "actor-1:2:bb", "weights")
    try:
        imp[0].send_multipart(encode("hello", Hello(actor_id="actor-0", capacity=4)))
        imp[1].send_multipart(encode("hello", Hello(actor_id="actor-1", capacity=4)))
        imp[0].send_multipart(
            encode("status", Status(actor_id="actor-1", identity="actor-0:1:aa", capacity=4, version=0))
        )
        sub.send_multipart(encode("subscribe", Subscribe(actor_id="actor-0", have=-1)))
        _pump(net, lambda got: len(net.errors) >= 4)
        reasons = [getattr(e, "reason", None) for _, e in net.errors]
        assert reasons == ["wrong_key"] * 4, net.errors
        assert not net.actors and not net.subscribers
        a0.send_multipart(encode("hello", Hello(actor_id="actor-0", capacity=4)))
        _pump(net, lambda got: net.actors)
        assert [a.actor_id for a in net.actors.values()] == ["actor-0"]
        assert a0.poll(10_000) and decode(a0.recv_multipart()).kind == "welcome"
        for s in imp:
            assert not s.poll(300)
    finally:
        for s in (a0, sub, *imp):
            s.close(0)


@needs_root
def test_curve_on_loopback_refuses_another_users_key(curve_net):
    """A local user with a CURVE key of its own (and the learner's public key, which is public)
    completes no handshake: no welcome, nothing received."""
    out = other_user("curve", 5, curve_net.addresses["control"], str(curve_net.keys / "server" / "server.key"))
    assert not out["received"] and not out["connected"], out
    assert not curve_net.actors


def test_tcp_without_keys_is_refused_even_on_loopback():
    cfg = load_config(None, ["wire.control_port=5599"]).wire
    with pytest.raises(WireSecurityError, match="TCP only with CURVE keys") as e:
        LearnerServer(cfg, lambda ch, e: None)
    assert "\n" not in str(e.value)


def _relay_address(run: LiveRun, timeout: float = DEADLINE_S) -> str:
    log = run.logs / f"{run.dir.name}-relay.log"
    line = []
    assert run.wait(
        lambda: line.extend(x for x in log.read_text().splitlines() if x.startswith("relay listening on ")) or line,
        timeout,
    ), log.read_text()[-2000:]
    return line[0].split("relay listening on ", 1)[1].strip()


@pytest.mark.slow
def test_a_dead_relay_hands_its_actors_to_the_learner(tmp_path, tiny_overrides):
    """41.3 and 41.4: a node's relay serves its actors on an ipc socket in a private directory
    (another user cannot bind there to serve weights of its own); when it dies, its actor says so in
    one line and takes weights from the learner within actor.relay_timeout_s, and training goes on
    (before, the node stalled for good)."""
    run = LiveRun(tmp_path, "relay", [*tiny_overrides, *COMMON, "train.total_steps=100000", "actor.relay_timeout_s=3"])
    try:
        relay = run.start("relay", ["--learner-weights", run.addresses["weights"], "--relay-id", "n0"], "relay")
        address = _relay_address(run)
        assert address.startswith("ipc://")
        relay_dir = os.path.dirname(address[len("ipc://") :])
        assert os.stat(relay_dir).st_mode & 0o777 == 0o700
        if os.geteuid() == 0:
            assert other_user("bind", 1, relay_dir)["bound"] is False
        run.start(
            "serve",
            [
                "--connect",
                run.addresses["control"],
                "--actor-id",
                "actor-0",
                "--weights-address",
                address,
                "sync.type=ipc",
            ],
            "actor-0",
        )
        assert run.wait_version(3, DEADLINE_S) is not None, run.log_tail("actor-0", lines=20)
        relay_log = run.logs / f"{run.dir.name}-relay.log"
        assert run.wait(lambda: "offered to 1 actor" in relay_log.read_text(), DEADLINE_S)  # (it used the relay)
        relay.kill()
        relay.wait(timeout=30)
        v = run.version()
        assert run.wait_version(v + 3, DEADLINE_S) is not None, run.log_tail("actor-0", lines=20)
        said = [
            x
            for x in (run.logs / f"{run.dir.name}-actor-0.log").read_text().splitlines()
            if "weights relay" in x and "taking weights from the learner" in x
        ]
        assert len(said) == 1, said
        # the episodes after the relay died were made with weights newer than any the relay had
        assert run.wait(lambda: max((e.get("policy_version") or 0) for e in run.events("episode")) > v, DEADLINE_S)
    finally:
        run.stop()


@needs_root
def test_a_run_directory_another_user_made_is_refused(tiny_overrides):
    """63.1: under a shared run_root (mode 1777, as /tmp), another user makes ``<run_root>/<name>`` first,
    open to all: the run is refused in one line, and nothing of it is written there. A run_root anyone
    may write in without the sticky bit is refused too."""
    import shutil
    import tempfile

    shared = tempfile.mkdtemp(prefix="asyncrl-shared-", dir="/tmp")
    try:
        os.chmod(shared, 0o1777)
        assert other_user("mkdir", 1, os.path.join(shared, "squat"))["made"]

        def start(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "asyncrl",
                    *args,
                    "-c",
                    "configs/quickstart.yaml",
                    *tiny_overrides,
                    f"run_root={shared}",
                    "name=squat",
                ],
                cwd=ROOT,
                env=subprocess_env(),
                capture_output=True,
                text=True,
                timeout=180,
            )

        for args in (("run", "--dry-run"), ("learn",), ("run",)):
            res = start(*args)
            lines = res.stderr.strip().splitlines()
            assert res.returncode == 2 and len(lines) == 1, (args, res.stderr[-2000:])
            assert "belongs to uid 65534, not to this user" in lines[0], lines
        assert os.listdir(os.path.join(shared, "squat")) == []
        os.chmod(shared, 0o777)  # anyone may write in it, not sticky: a run directory could be swapped
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "asyncrl",
                "run",
                "--dry-run",
                "-c",
                "configs/quickstart.yaml",
                *tiny_overrides,
                f"run_root={shared}",
                "name=mine",
            ],
            cwd=ROOT,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert res.returncode == 2 and "anyone may write in" in res.stderr and "not sticky" in res.stderr, res.stderr
    finally:
        shutil.rmtree(shared, ignore_errors=True)
