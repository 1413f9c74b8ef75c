"""Peers that misbehave (issue 19 items 2, 6-12): attacks on a live learner over loopback.

Every test starts real ``asyncrl`` processes (``asyncrl.testing.peer_attacks.LiveRun``), attacks them with
frames built by hand, and checks that the learner keeps training, that what it acknowledged is
trained (episode ids counted), and that its reports stay small. Waits are on conditions with
generous deadlines; every process is stopped in a ``finally``.
"""

from __future__ import annotations

import json
import math
import threading
import time

import numpy as np
import pytest
import zmq
import zmq.auth

from asyncrl.rundir.record_file import read_frame_records
from asyncrl.testing.peer_attacks import LiveRun, ScriptedActor, connect, crafted, episode_frames, frames, small_disk
from asyncrl.wire.codec import SCHEMA_VERSION, decode, decode_episode, encode_msg, encode_weights
from asyncrl.wire.sockets import make_curve_keys
from tests.conftest import SMALL_RUN as COMMON
from tests.conftest import initial_weights as _initial_weights
from tests.conftest import kill_tree, run_cli, start_cli

pytestmark = pytest.mark.slow

FOREVER = ["train.total_steps=100000", "checkpoint.every=0"]  # runs that the test stops


def _overrides(tiny_overrides, *extra) -> list[str]:
    return [*tiny_overrides, *COMMON, *FOREVER, *extra]


def _wal_ids(run: LiveRun) -> set[str]:
    ids = set()
    for wal in (run.dir / "buffer").glob("wal-*.bin"):
        for record in read_frame_records(wal, strict=False):
            ids.add(decode_episode(decode(record)).id)
    return ids


def _trained(run: LiveRun) -> set[str]:
    return {e["episode_id"] for e in run.events("episode")}


def test_crafted_and_poisoned_messages_are_refused_and_training_goes_on(tmp_path, tiny_overrides):
    """19.6 (nine messages that each killed the learner) and 19.2 (poisoned episodes were written
    and acknowledged): all refused, none in the WAL, their actor told; the valid episodes are
    acknowledged and trained."""
    run = LiveRun(tmp_path, "crafted", _overrides(tiny_overrides, "train.batch_tasks=2", "buffer.max_staleness=100000"))
    socks = []
    try:
        for _, channel, msg in crafted(SCHEMA_VERSION):
            socks.append(connect(zmq.PUSH if channel == "episodes" else zmq.DEALER, run.addresses[channel]))
            socks[-1].send_multipart(msg)
        actor = ScriptedActor(run.addresses, SCHEMA_VERSION)
        socks += [actor.control, actor.push]
        poisoned = {
            "poison-token": dict(token=10**6),
            "poison-negative": dict(token=-1),
            "poison-future": dict(version=10**6),
            "poison-nan": dict(reward=math.nan),
            "poison-mask": dict(mask_value=7),
            "poison-bytes": dict(decision={"blob": b"\x00"}),
            # a receipt that is not the learner's: generated with weights it never published as version 0
            "poison-digest": dict(weights_digests={"0": "0" * 64}),
        }
        good = [f"good-{i}" for i in range(6)]
        for eid, kw in poisoned.items():
            actor.send(episode_frames(SCHEMA_VERSION, actor.actor_id, eid, **kw))
        for eid in good:
            actor.send(episode_frames(SCHEMA_VERSION, actor.actor_id, eid))
        deadline = time.time() + 120
        while time.time() < deadline and not (set(good) <= actor.acked and set(poisoned) <= set(actor.rejected)):
            actor.read_acks()
        assert run.learner.poll() is None, run.log_tail(lines=20)
        assert set(good) <= actor.acked and set(poisoned) == set(actor.rejected), (actor.acked, actor.rejected)
        assert "token_range" in actor.rejected["poison-token"] and "future_version" in actor.rejected["poison-future"]
        assert "field 'episode.decision[...]'" in actor.rejected["poison-bytes"]  # refused by the decoder
        assert "weights_digest" in actor.rejected["poison-digest"], actor.rejected["poison-digest"]
        assert run.wait_version(3, 120) is not None, run.log_tail(lines=20)  # 6 good episodes, 2 per step
        wal = _wal_ids(run)
        assert set(good) <= wal and not (wal & set(poisoned)), wal
        assert set(good) <= _trained(run)  # nothing acknowledged is lost
        reasons = {e["reason"] for e in run.events("episode_rejected")}
        assert {"token_range", "future_version", "nonfinite", "mask_values", "weights_digest"} <= reasons, reasons
        assert run.metrics()[-1]["bad_messages"] >= 10  # nine crafted + the undecodable episode
        assert run.metrics()[-1]["rejected_episodes"] == len(poisoned)
    finally:
        for s in socks:
            s.close(0)
        run.stop()
    assert run.learner.returncode == 0


def test_vanished_hellos_and_a_killed_actor_recover_within_the_lease(tmp_path, tiny_overrides):
    """19.7: 200 hellos that vanish and an actor killed at max_staleness 0 held every credit for
    good; with leases the credits come back and a new actor trains."""
    lease = 4.0
    run = LiveRun(
        tmp_path,
        "lease",
        _overrides(
            tiny_overrides,
            "buffer.max_staleness=0",
            f"wire.lease_s={lease}",
            "actor.heartbeat_s=0.5",
            "wire.bad_log_every_s=2",
        ),
    )
    try:
        first = run.actor("actor-0", 0)
        assert run.wait_version(2, 240) is not None, run.log_tail(lines=20)
        fakes = [connect(zmq.DEALER, run.addresses["control"]) for _ in range(200)]
        for i, f in enumerate(fakes):
            f.send_multipart(frames(SCHEMA_VERSION, "hello", {"actor_id": f"fake-{i}", "capacity": 10**6}))
        assert _answered(fakes, timeout=120) == len(fakes)  # each was admitted (its welcome came back)
        for f in fakes:
            f.close(0)
        first.kill()
        first.wait(timeout=30)
        killed_at, v = time.time(), run.version()
        run.actor("actor-1", 1)
        assert run.wait_version(v + 2, 240) is not None, run.log_tail(lines=20)  # training resumed

        def dropped() -> int:  # the first three one by one, the rest in messages_suppressed summaries
            return len(run.events("actor_dropped")) + sum(
                e["counts"].get("actor_dropped:lease", 0) for e in run.events("messages_suppressed")
            )

        assert run.wait(lambda: dropped() >= 201, 60), dropped()  # 200 fakes and the killed actor
        assert len(run.events("actor_dropped")) <= 3
        for e in run.events("actor_dropped"):  # one reported by itself was dropped a lease after its silence
            assert e["actor_id"].startswith("fake") or e["t"] - killed_at < lease + 10, e
        assert run.metrics()[-1]["dropped_stale"] == 0
        waiting = _wal_ids(run) - _trained(run)  # acknowledged, not trained: at most a batch in the buffer
        assert len(waiting) <= 4, waiting
    finally:
        run.stop()


def _answered(socks: list, timeout: float) -> int:
    """How many of ``socks`` received a message within ``timeout`` seconds (polled together)."""
    poller, pending = zmq.Poller(), set(socks)
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    deadline = time.time() + timeout
    while pending and time.time() < deadline:
        for sock, _ in poller.poll(500):
            if sock in pending:
                pending.discard(sock)
                poller.unregister(sock)
    return len(socks) - len(pending)


def test_weight_subscribers_that_never_read_stay_bounded(tmp_path, tiny_overrides):
    """19.8: each subscriber has at most one version queued, and silent ones are dropped."""
    lease = 4.0
    run = LiveRun(
        tmp_path,
        "subs",
        _overrides(
            tiny_overrides,
            f"wire.lease_s={lease}",
            "actor.heartbeat_s=0.5",
            "log.episode_events=sampled",
            "log.episode_events_every=1000",
        ),
    )
    subs = []
    try:
        run.actor()
        assert run.wait_version(3, 240) is not None, run.log_tail(lines=20)
        weights_mb = run.events("weights_published")[-1]["bytes"] / 2**20
        for i in range(20):
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVBUF, 4096)
            s.connect(run.addresses["weights"])
            s.send_multipart(frames(SCHEMA_VERSION, "subscribe", {"actor_id": f"idle-{i}", "have": -1}))
            subs.append(s)
        assert run.wait(lambda: run.events("weights_published")[-1]["subscribers"] == 21, 60)
        rss0, v0 = run.rss_mb(), run.version()
        assert run.wait_version(v0 + 300, 300) is not None, run.log_tail(lines=20)
        growth = run.rss_mb() - rss0
        # before: every version queued for every idle subscriber (20 x 300 x the weights)
        assert growth < 40 + 20 * 3 * weights_mb, (growth, weights_mb)
        # silent for a lease with no actor of theirs: dropped (while still connected)
        assert run.wait(lambda: run.events("weights_published")[-1]["subscribers"] == 1, 120), run.events(
            "weights_published"
        )[-1]
    finally:
        for s in subs:
            s.close(0)
        run.stop()


def test_floods_and_oversized_messages_do_not_starve_training(tmp_path, tiny_overrides):
    """19.9 and 19.10: size limits, and garbage that neither stops training nor fills the log."""
    run = LiveRun(
        tmp_path,
        "flood",
        _overrides(
            tiny_overrides, "log.episode_events=sampled", "log.episode_events_every=1000", "wire.bad_log_every_s=2"
        ),
    )
    socks = []
    try:
        run.actor()
        assert run.wait_version(3, 240) is not None, run.log_tail(lines=20)
        v0 = run.version()
        time.sleep(5)  # the quiet rate, to compare with (a measurement, not a synchronisation)
        quiet = run.version() - v0
        socks = [
            connect(zmq.PUSH, run.addresses["episodes"]),
            connect(zmq.DEALER, run.addresses["control"]),
            connect(zmq.DEALER, run.addresses["weights"]),
            connect(zmq.PUSH, run.addresses["episodes"]),
        ]
        monitor = socks[3].get_monitor_socket(zmq.EVENT_DISCONNECTED)
        socks.append(monitor)
        big = frames(
            SCHEMA_VERSION, "episode", {}, [{"name": "x", "dtype": "uint8", "shape": [64 << 20]}], [b"\0" * (64 << 20)]
        )
        socks[3].send_multipart(big)  # past ZMQ_MAXMSGSIZE: the learner disconnects its sender
        bomb = episode_frames(SCHEMA_VERSION, "bomb", "bomb-1", decision={"x": [[{}] * 60000 for _ in range(25)]})
        socks[0].send_multipart(bomb)  # a 1.5 MB msgpack bomb: past wire.max_header_kb (1 MiB), under MAXMSGSIZE
        socks[0].send_multipart([b"x"] * 1000)  # too many frames
        events_before = (run.dir / "events.jsonl").stat().st_size
        rss0, v0, t0, rng, sent = run.rss_mb(), run.version(), time.time(), np.random.default_rng(0), 0
        while time.time() - t0 < 10:
            for s in socks[:3]:
                try:
                    s.send(rng.bytes(int(rng.integers(1, 200))), zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
        steps = run.version() - v0
        assert run.learner.poll() is None
        assert steps >= max(3, quiet * 2 * 0.1), f"{steps} steps in 10 s of flood ({sent} frames); {quiet} in 5 quiet s"
        assert monitor.poll(30_000), "the 64 MiB frame's sender was not disconnected"
        assert run.rss_mb() - rss0 < 150  # neither the 64 MiB frame nor the bomb was materialised
        assert run.wait(lambda: run.events("messages_suppressed"), 30)
        bad = run.events("bad_message")
        assert len(bad) <= 3 * len({e["reason"] for e in bad})  # the first 3 per reason, then counts
        assert any("header is" in e["error"] and "at most 1048576" in e["error"] for e in bad)
        assert any("of 1000 frames" in e["error"] for e in bad)
        counted = sum(sum(e["counts"].values()) for e in run.events("messages_suppressed"))
        assert counted > 100 and _written_since(run.dir / "events.jsonl", events_before) < 200_000
        assert "bomb-1" not in _wal_ids(run)
    finally:
        for s in socks:
            s.close(0)
        run.stop()


# what a run writes every few steps or every second whether flooded or not (the tokens of 8 traced rows,
# heartbeats with their timeline spans): not what a flood of bad messages adds
_ROUTINE = {"episode", "sample", "token_trace", "timeline", "actor_status", "weights_published"}


def _written_since(events, offset: int) -> int:
    """Bytes of the event lines written after ``offset`` other than the routine ones."""
    with open(events, "rb") as f:
        f.seek(offset)
        lines = f.read().splitlines()
    return sum(len(line) for line in lines if line.strip() and json.loads(line).get("kind") not in _ROUTINE)


def test_full_disk_stops_the_learner_cleanly_and_the_actor_says_so(tmp_path, tiny_overrides):
    """19.11: the WAL on a 48 KiB tmpfs fills (a real ENOSPC): the learner writes learner_stop with
    the reason, prints one line, exits 1; the actor says once that the learner is gone."""
    run = LiveRun(
        tmp_path,
        "full",
        _overrides(tiny_overrides, "actor.learner_timeout_s=3"),
        learner_prefix=small_disk(tmp_path / "full" / "buffer"),
    )
    try:
        actor = run.actor()
        assert run.died(240), "the learner did not stop on a full disk"
        assert run.learner.returncode == 1
        log = (run.logs / "full-learner.log").read_text()
        assert "Traceback" not in log and "No space left on device (ENOSPC)" in run.log_tail(), log[-2000:]
        stop = run.events("learner_stop")[-1]
        assert stop["errno"] == "ENOSPC" and "No space left on device" in stop["reason"]
        alog = tmp_path / "full-actor-0.log"
        said = lambda: alog.read_text().count("no word from the learner")  # noqa: E731
        deadline = time.time() + 60
        while time.time() < deadline and not said():
            time.sleep(0.2)
        assert said() == 1, alog.read_text()[-2000:]
        assert "waiting for it to come back" in alog.read_text()
        t = time.time()
        while time.time() - t < 6:  # twice the timeout: still said once, not every loop
            time.sleep(0.5)
        assert said() == 1 and actor.poll() is None  # it waits (actor.exit_after_learner_gone_s is null)
    finally:
        run.stop()


def test_exit_when_the_peer_is_gone_only_if_asked(tmp_path, tiny_overrides):
    """Issue 10 item 1: ``train.exit_after_no_actors_s`` and ``actor.exit_after_learner_gone_s``."""
    run = LiveRun(tmp_path, "alone", _overrides(tiny_overrides, "train.exit_after_no_actors_s=2"))
    try:
        assert run.died(120) and run.learner.returncode == 1, run.log_tail(lines=10)
        assert "train.exit_after_no_actors_s" in run.events("learner_stop")[-1]["reason"]
        assert "stopped at step 0: no actor for 2 s" in run.log_tail()
        actor = run.actor(extra=["actor.learner_timeout_s=1", "actor.exit_after_learner_gone_s=2"])
        actor.wait(timeout=120)
        assert actor.returncode == 1
        assert "actor.exit_after_learner_gone_s=2" in (tmp_path / "alone-actor-0.log").read_text()
    finally:
        run.stop()


def test_public_host_without_keys_is_a_one_line_error(tmp_path):
    res = run_cli("learn", f"run_root={tmp_path}", "wire.host=0.0.0.0", timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to bind '0.0.0.0' (wire.host)" in lines[0] and "asyncrl keys" in lines[0]
    assert not (tmp_path / "quickstart").exists()  # refused before anything was written


def test_curve_keys_admit_only_authorised_actors_and_report_the_rest(tmp_path, tiny_overrides):
    """19.12 over loopback: learner and actor with their own bundles train; a client with keys the
    learner never authorised is refused and reported."""
    keys = tmp_path / "keys"
    make_curve_keys(str(keys), ["0"])
    other = tmp_path / "other"
    make_curve_keys(str(other), ["0"])
    run = LiveRun(tmp_path, "curve", _overrides(tiny_overrides, f"wire.curve_dir={keys}"))
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    try:
        run.actor("actor-0")  # wire.curve_dir=DIR: the actor takes DIR/actor-0
        assert run.wait_version(2, 240) is not None, run.log_tail(lines=20)
        stranger.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.auth.load_certificate(str(other / "actor-0" / "actor.key_secret"))
        stranger.curve_publickey, stranger.curve_secretkey = public, secret
        stranger.curve_serverkey = zmq.auth.load_certificate(str(keys / "server" / "server.key"))[0]
        stranger.connect(run.addresses["control"])
        try:  # without blocking: once the learner has refused the handshake, a DEALER has no peer to queue for
            stranger.send_multipart(
                frames(SCHEMA_VERSION, "hello", {"actor_id": "intruder", "capacity": 8}), flags=zmq.NOBLOCK
            )
        except zmq.Again:
            pass
        assert run.wait(lambda: run.events("connection_refused"), 60)
        assert run.events("connection_refused")[0]["client_key"] == public.decode()
        assert "intruder" not in {e.get("actor_id") for e in run.events("actor_status")}
    finally:
        stranger.close(0)
        run.stop()


def _recv_kind(sock: zmq.Socket, kind: str, timeout_s: float = 120) -> list:
    """The frames of the next message of ``kind`` on a ROUTER (identity first)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if sock.poll(200):
            got = sock.recv_multipart()
            if decode(got[1:]).kind == kind:
                return got
    raise AssertionError(f"no {kind!r} message within {timeout_s} s")


def test_no_message_stops_an_actor(tmp_path, tiny_overrides, model_cache):
    """19.6 on the actor's side: a scripted learner answers with crafted control and weights
    messages; the actor reports them, keeps its lease, generates, and stops cleanly when told."""
    socks = {
        kind: zmq.Context.instance().socket(t)
        for kind, t in (("control", zmq.ROUTER), ("weights", zmq.ROUTER), ("episodes", zmq.PULL))
    }
    addrs = {}
    for kind, s in socks.items():
        s.setsockopt(zmq.LINGER, 0)
        addrs[kind] = f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}"
    log = tmp_path / "actor.log"
    proc = start_cli("serve", *tiny_overrides, *COMMON, f"run_root={tmp_path}", "--connect", addrs["control"], log=log)
    try:
        ident = _recv_kind(socks["control"], "hello")[0]
        s = SCHEMA_VERSION
        for msg in (
            [b"\x00garbage"],
            frames(s, "welcome", {"session": "s", "lease_s": 20.0, "addresses": {}}),
            frames(
                s,
                "welcome",
                {"session": "s", "lease_s": 20.0, "addresses": {"episodes": "nonsense", "weights": "nonsense"}},
            ),
            frames(s, "credit", {"n": "x", "min_version": 0}),
            frames(s, "ack", {"ids": 5}),
            frames(s, "stop", {}, [{"name": "x", "dtype": "uint8", "shape": [1]}], [b"1"]),
            frames(s, "nope", {}),
            frames(s, "hello", {"actor_id": "x", "capacity": 1}),
        ):
            socks["control"].send_multipart([ident, *msg])
        for msg in (
            encode_msg("welcome", session="s1", lease_s=20.0, addresses=addrs),
            encode_msg("credit", n=1, min_version=0),
        ):
            socks["control"].send_multipart([ident, *msg])
        sub = _recv_kind(socks["weights"], "subscribe")[0]
        for msg in (
            [b"garbage"],
            encode_msg("weights", version=1, path=str(tmp_path / "missing.safetensors")),
            encode_weights({"no.such.parameter": np.zeros(2, np.float32)}, 2),
        ):
            socks["weights"].send_multipart([sub, *msg])
            _recv_kind(socks["weights"], "subscribe")  # it tried this one and asks again
        socks["weights"].send_multipart([sub, *encode_weights(_initial_weights(tiny_overrides), 3)])  # then real ones
        assert socks["episodes"].poll(120_000), log.read_text()[-3000:]  # it generated its credit
        decode_episode(decode(socks["episodes"].recv_multipart()))
        assert _recv_kind(socks["control"], "status")  # its heartbeat goes on
        assert proc.poll() is None
        text = log.read_text()
        assert text.count("dropped a bad control message") == 3 and text.count("dropped a bad weights message") == 3, (
            text
        )
        socks["control"].send_multipart([ident, *encode_msg("stop", reason="test over")])
        assert proc.wait(timeout=120) == 0
    finally:
        kill_tree(proc)
        for sock in socks.values():
            sock.close(0)


def test_a_heartbeat_only_actor_loses_its_credits_and_a_returning_actor_finds_room(tmp_path, tiny_overrides):
    """25.2: a peer that sends a valid status every second but never an episode held 64 credits
    for ever (training at 0.0-0.2 steps/s), and peers filling the table kept a restarted actor
    out. Its credits now return after wire.credit_timeout_s, and the real actor, restarted into a
    full table, takes the place of the peer that never delivered."""
    credit_timeout = 4.0
    run = LiveRun(
        tmp_path,
        "hog",
        _overrides(
            tiny_overrides,
            "wire.lease_s=30",
            f"wire.credit_timeout_s={credit_timeout}",
            "actor.heartbeat_s=0.5",
            "wire.max_actors=2",
        ),
    )
    hog = connect(zmq.DEALER, run.addresses["control"])
    hog.setsockopt(zmq.IDENTITY, b"hog:1")
    hog.disconnect(run.addresses["control"])  # (the identity applies to the next connection)
    hog.connect(run.addresses["control"])
    stop = threading.Event()

    def heartbeat():  # valid status messages, bounded in count and time
        for _ in range(600):
            if stop.wait(1.0):
                return
            hog.send_multipart(
                frames(SCHEMA_VERSION, "status", {"actor_id": "hog", "identity": "hog:1", "capacity": 64, "version": 0})
            )

    try:
        hog.send_multipart(frames(SCHEMA_VERSION, "hello", {"actor_id": "hog", "capacity": 64}))
        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        first = run.actor("actor-0", 0)
        assert run.wait_version(3, 240) is not None, run.log_tail(lines=20)  # trains beside the hog
        assert run.wait(lambda: any(e.get("actor_id") == "hog" for e in run.events("credits_reclaimed")), 120)
        first.kill()
        first.wait(timeout=30)
        v = run.version()
        run.actor("actor-0", 0)  # the table is full (the killed actor's lease has 30 s to run, the hog)
        assert run.wait_version(v + 3, 240) is not None, run.log_tail(lines=20)
        assert any(e.get("reason") == "evicted" and e.get("actor_id") == "hog" for e in run.events("actor_dropped"))
    finally:
        stop.set()
        if "beat" in locals():
            beat.join(10)  # (it may be sending: the socket is closed after it ends)
        hog.close(0)
        run.stop()


def test_a_revoked_key_is_dropped_while_the_learner_runs_and_told_why(tmp_path, tiny_overrides):
    """25.3: deleting authorized/actor-a2.key while the learner ran still admitted a2. Now its
    open connection's messages are refused and it is stopped with the reason, a restarted a2 is
    refused at the handshake and says so in one line, and a1 trains on."""
    keys = tmp_path / "keys"
    make_curve_keys(str(keys), ["a1", "a2"])
    run = LiveRun(tmp_path, "revoke", _overrides(tiny_overrides, f"wire.curve_dir={keys}", "actor.heartbeat_s=0.5"))
    try:
        a1 = run.actor("a1", 0)
        a2 = run.actor("a2", 1)
        assert run.wait(lambda: {"a1", "a2"} <= {e.get("actor_id") for e in run.events("actor_status")}, 240), (
            run.log_tail(lines=20)
        )
        assert run.wait_version(2, 240) is not None, run.log_tail(lines=20)
        (keys / "server" / "authorized" / "actor-a2.key").unlink()
        assert a2.wait(timeout=120) == 0  # told to stop, with the reason
        assert "key" in run.log_tail("a2", lines=5) and "revoked" in run.log_tail("a2", lines=5)
        assert any(e["reason"].endswith("revoked_key") for e in run.events("bad_message")), run.events("bad_message")
        v = run.version()
        a2 = run.actor("a2", 1)  # comes back with the revoked key: refused at the handshake, one line why
        assert run.wait(lambda: "refused this actor's CURVE key" in run.log_tail("a2", lines=50), 240), run.log_tail(
            "a2", lines=20
        )  # (a waiting actor adds a line every 30 s: look past the last few)
        assert run.wait(lambda: run.events("connection_refused"), 60)
        assert run.wait_version(v + 2, 240) is not None, run.log_tail(lines=20)  # a1 trains on
        assert a1.poll() is None
    finally:
        run.stop()


def test_rejected_episodes_are_no_progress_and_strangers_cannot_take_the_pool(tmp_path, tiny_overrides):
    """41.7: an episode counted as progress before it was validated, so a peer sending one rejected
    episode a second kept its credits for ever; and peers that never deliver, twenty of them with
    one credit each, took the whole credit pool (no step for minutes). Now only a valid episode in
    the buffer is progress, and actors that never delivered hold at most half the pool together."""
    run = LiveRun(
        tmp_path,
        "strangers",
        _overrides(
            tiny_overrides,
            "wire.lease_s=30",
            "wire.credit_timeout_s=5",
            "actor.heartbeat_s=0.5",
            "wire.bad_log_first=100000",
        ),
    )
    socks, stop = [], threading.Event()
    try:
        run.actor("actor-0", 0)
        assert run.wait_version(3, 240) is not None, run.log_tail(lines=20)
        for i in [20, *range(20)]:  # one that sends a rejected episode a second, then 20 that only heartbeat
            s = connect(zmq.DEALER, run.addresses["control"])
            s.setsockopt(zmq.IDENTITY, f"hog{i}:1".encode())
            s.disconnect(run.addresses["control"])  # (the identity applies to the next connection)
            s.connect(run.addresses["control"])
            s.send_multipart(frames(SCHEMA_VERSION, "hello", {"actor_id": f"hog{i}", "capacity": 1 if i < 20 else 4}))
            socks.append(s)
            while i == 20 and s.poll(60_000):  # (the first has its credits before the others come)
                if decode(s.recv_multipart()).kind == "credit":
                    break
        socks = socks[1:] + socks[:1]  # (hog0 .. hog20, in order)
        push = connect(zmq.PUSH, run.addresses["episodes"])

        def keep_up():  # bounded in count and time
            for n in range(300):
                if stop.wait(1.0):
                    return
                for i, s in enumerate(socks):
                    s.send_multipart(
                        frames(
                            SCHEMA_VERSION,
                            "status",
                            {"actor_id": f"hog{i}", "identity": f"hog{i}:1", "capacity": 1, "version": 0},
                        )
                    )
                push.send_multipart(episode_frames(SCHEMA_VERSION, "hog20", f"bad-{n}", token=10**6))  # rejected

        t = threading.Thread(target=keep_up, daemon=True)
        t.start()
        v = run.version()
        assert run.wait_version(v + 5, 120) is not None, run.log_tail(lines=20)  # the real actor trains on
        assert run.wait(lambda: any(e.get("actor_id") == "hog20" for e in run.events("credits_reclaimed")), 120)
        assert any(e.get("actor_id") == "hog20" for e in run.events("episode_rejected"))
    finally:
        stop.set()
        if "t" in locals():
            t.join(10)
        for s in socks:
            s.close(0)
        run.stop()
