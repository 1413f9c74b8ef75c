"""The learner's peer checks in process: episode validation, rate-limited reports, leases and
capacity caps, one pending weights version per subscriber (real ZeroMQ sockets on 127.0.0.1)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import zmq

from asyncrl.config import load_config
from asyncrl.learner.ingest.peers import EpisodeValidator, RateLimitedLog
from asyncrl.learner.ingest.server import Arrival, LearnerServer, Limits
from asyncrl.types import Episode, Trajectory
from asyncrl.wire.codec import (
    WireError,
    decode,
    decode_episode,
    decode_weights,
    encode_episode,
    encode_msg,
    encode_weights,
)
from tests.support.factories import trajectory

DEADLINE_S = 20


def _traj(n=6, token=5, version=0, reward=1.0, **kw) -> Trajectory:
    return trajectory(n, token=token, version=version, reward=reward, **kw)


def _arrival(ep: Episode) -> Arrival:
    frames = encode_episode(ep)
    msg = decode(frames)
    return Arrival(decode_episode(msg), frames, msg.arrays)


@pytest.fixture
def validator():
    return EpisodeValidator(
        vocab_size=100, limits=Limits(header_bytes=1 << 20, control_bytes=1 << 16, max_trajectories=4, max_tokens=32)
    )


@pytest.mark.parametrize(
    "trajs, decision, reason",
    [
        ([_traj()], {}, None),
        ([_traj(version=3)], {}, None),  # = the learner's version: fine
        ([_traj(version=4)], {}, "future_version"),
        ([_traj(token=100)], {}, "token_range"),
        ([_traj(token=-1)], {}, "token_range"),
        ([_traj(reward=math.nan)], {}, "nonfinite"),
        ([_traj(scores={"acc": math.inf})], {}, "nonfinite"),
        ([_traj(advantage=-math.inf)], {}, "nonfinite"),
        ([_traj(recorded_logprobs=np.full(6, math.nan))], {}, "nonfinite"),
        ([_traj(exp_mask=np.full(6, 2))], {}, "mask_values"),
        ([_traj(n=33)], {}, "too_long"),
        ([_traj(n=0)], {}, "empty_trajectory"),
        ([_traj() for _ in range(5)], {}, "too_many_trajectories"),
        ([], {"policy_version": 3}, None),
        ([], {"policy_version": 9}, "version"),
        ([], {"policy_version": "3"}, "version"),
    ],
)
def test_episode_validation(validator, trajs, decision, reason):
    problem = validator.check(_arrival(Episode(trajectories=trajs, actor_id="a", decision=decision)), version=3)
    assert (problem[0] if problem else None) == reason, problem


def test_validation_catches_a_positive_logprob(validator):
    t = _traj()
    t.behavior_logprobs[-1] = 0.5
    assert validator.check(_arrival(Episode(trajectories=[t])), version=0)[0] == "logprob_positive"


def test_rate_limited_log_reports_the_first_then_summarises(capsys):
    events = []
    log = RateLimitedLog(lambda kind, **f: events.append((kind, f)), first=2, every_s=3600)
    for i in range(50):
        log.report("bad_message", "control:field", f"error {i}", channel="control")
    log.report("bad_message", "episodes:malformed", "other")
    log.flush()  # not yet: every_s has not passed
    assert [f["error"] for k, f in events] == ["error 0", "error 1", "other"]
    log.flush(force=True)
    kind, summary = events[-1]
    assert kind == "messages_suppressed" and summary["counts"] == {"bad_message:control:field": 48}
    assert summary["examples"]["bad_message:control:field"] == "error 49"
    log.flush(force=True)
    assert len(events) == 4  # nothing new to summarise
    assert len(capsys.readouterr().out.splitlines()) == 4  # 3 lines, then one summary line


@pytest.fixture
def net():
    cfg = load_config(
        None, ["wire.lease_s=0.5", "wire.max_capacity=5", "wire.max_actors=3", "actor.heartbeat_s=0.1"]
    ).wire
    errors: list = []
    n = LearnerServer(cfg, lambda ch, e: errors.append((ch, e)))
    n.errors = errors
    yield n
    n.close()


def _dealer(address: str, ctx: zmq.Context | None = None) -> zmq.Socket:
    s = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


def _pump_until(net, condition) -> list:
    deadline, control = time.time() + DEADLINE_S, []
    while time.time() < deadline and not condition():
        _, got = net.poll(50)
        for identity, msg in got:
            try:
                net.handle_control(identity, msg)
            except WireError as e:
                net.errors.append(("control", e))
        control += got
    assert condition(), "condition not reached within the deadline"
    return control


def test_leases_expire_capacity_is_capped_and_a_dropped_actor_comes_back(net):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"a:1")  # as an actor names its control socket
    sock.connect(net.addresses["control"])
    try:
        sock.send_multipart(encode_msg("hello", actor_id="a", capacity=10**6))
        _pump_until(net, lambda: len(net.actors) == 1)
        state = next(iter(net.actors.values()))
        assert state.capacity == 5  # wire.max_capacity
        assert net.actors.grant_credits(100, min_version=0) == 5 and net.actors.in_flight == 5
        _pump_until(net, lambda: net.expire() or not net.actors)  # silent past the lease
        assert net.actors.in_flight == 0  # its credits are back in the pool
        sock.send_multipart(encode_msg("status", actor_id="a", identity="a:1", capacity=2, version=0))
        _pump_until(net, lambda: len(net.actors) == 1)  # any message admits it again
        kinds = []
        while sock.poll(200):
            kinds.append(decode(sock.recv_multipart()).kind)
        assert kinds.count("welcome") == 2 and "credit" in kinds and "alive" in kinds
    finally:
        sock.close(0)


def test_the_actor_table_is_bounded(net):
    socks = [_dealer(net.addresses["control"]) for _ in range(4)]
    try:
        for i, s in enumerate(socks):
            s.send_multipart(encode_msg("hello", actor_id=f"a{i}", capacity=1))
        _pump_until(net, lambda: len(net.actors) == 3 and net.errors)
        assert net.errors[0][1].reason == "actors_full" and "wire.max_actors" in str(net.errors[0][1])
    finally:
        for s in socks:
            s.close(0)


def test_a_subscriber_gets_one_version_at_a_time_the_newest(net):
    sub = _dealer(net.addresses["weights"])
    try:
        net.subscribers.publish(encode_weights({"w": np.zeros(3, np.float32)}, 0), 0)
        sub.send_multipart(encode_msg("subscribe", actor_id="s", have=-1))
        _pump_until(net, lambda: net.subscribers)
        for v in range(1, 6):  # nothing more is sent until the subscriber says it has version 0
            net.subscribers.publish(encode_weights({"w": np.full(3, v, np.float32)}, v), v)
        assert sub.poll(DEADLINE_S * 1000)
        got = [decode_weights(decode(sub.recv_multipart()))[0]]
        assert not sub.poll(300) and got == [0]
        sub.send_multipart(encode_msg("subscribe", actor_id="s", have=0))
        _pump_until(net, lambda: sub.poll(0))
        version, tensors = decode_weights(decode(sub.recv_multipart()))
        assert version == 5 and tensors["w"].tolist() == [5.0] * 3  # conflated to the newest
    finally:
        sub.close(0)


def test_credits_are_renewed_by_progress_and_a_known_actor_finds_room():
    """Issue 25.2: an actor that heartbeats but never delivers loses its credits after
    wire.credit_timeout_s and gets one at a time until it delivers; a full table makes room for an actor id
    that delivered before, by evicting a stranger that never did."""
    cfg = load_config(
        None,
        [
            "wire.lease_s=30",
            "wire.credit_timeout_s=0.5",
            "wire.max_capacity=5",
            "wire.max_actors=2",
            "actor.heartbeat_s=0.1",
        ],
    ).wire
    net = LearnerServer(cfg, lambda ch, e: None)
    socks = [_dealer(net.addresses["control"]) for _ in range(4)]
    try:
        socks[0].send_multipart(encode_msg("hello", actor_id="real", capacity=5))
        socks[1].send_multipart(encode_msg("hello", actor_id="hog", capacity=5))
        _pump_until(net, lambda: len(net.actors) == 2)
        real, hog = sorted(net.actors.values(), key=lambda a: a.actor_id != "real")
        assert net.actors.grant_credits(10, min_version=0) == 10 and hog.outstanding == 5
        net.actors.received_from("real", 5)  # the real actor delivers, the hog only heartbeats
        net.actors.delivered("real", 5)
        deadline = time.time() + DEADLINE_S
        while time.time() < deadline and not net.actors.reclaimed:
            hog.last_seen = time.monotonic()  # (its heartbeats keep its lease)
            net.expire()
            time.sleep(0.05)
        ((taken, n),) = net.actors.take_reclaimed()[0]
        assert taken is hog and n == 5 and hog.outstanding == 0 and hog.hog
        assert net.actors.grant_credits(10, min_version=0) == 6 and real.outstanding == 5 and hog.outstanding == 1
        # the table is full (2): a stranger is refused, the returning real actor is not
        socks[2].send_multipart(encode_msg("hello", actor_id="stranger", capacity=5))
        with pytest.raises(WireError, match="actors_full|table full"):
            deadline = time.time() + DEADLINE_S
            while time.time() < deadline:
                for identity, msg in net.poll(50)[1]:
                    net.handle_control(identity, msg)
        socks[3].send_multipart(encode_msg("hello", actor_id="real", capacity=5))  # restarted: a new socket
        _pump_until(net, lambda: sum(a.actor_id == "real" for a in net.actors.values()) == 2)
        assert "hog" not in {a.actor_id for a in net.actors.values()}
        assert [a.actor_id for a in net.actors.take_reclaimed()[1]] == ["hog"]
        assert socks[1].poll(DEADLINE_S * 1000)
        kinds = [decode(socks[1].recv_multipart()).kind]
        while socks[1].poll(200):
            kinds.append(decode(socks[1].recv_multipart()).kind)
        assert "stop" in kinds  # the evicted stranger is told
    finally:
        for s in socks:
            s.close(0)
        net.close()


def test_an_actor_generating_keeps_its_credits_and_a_stuck_one_loses_them_once_per_timeout():
    """Issue 61: an actor in the middle of a long batch delivers nothing but its heartbeat's token count
    advances; it keeps its credits. One whose count stands still loses them after wire.credit_timeout_s,
    and then, holding one credit, again only after another timeout: no storm of reclaims."""
    timeout = 0.6
    cfg = load_config(
        None, ["wire.lease_s=30", f"wire.credit_timeout_s={timeout}", "wire.max_capacity=4", "actor.heartbeat_s=0.1"]
    ).wire
    net = LearnerServer(cfg, lambda ch, e: None)
    socks = {name: _dealer(net.addresses["control"]) for name in ("busy", "stuck")}
    tokens = {"busy": 0, "stuck": 7}

    def beat():  # the actors' heartbeats, as their Heartbeat threads send them
        for name, s in socks.items():
            if name == "busy":
                tokens[name] += 3
            s.send_multipart(
                encode_msg("status", actor_id=name, identity=f"{name}:1", capacity=4, version=0, tokens=tokens[name])
            )

    try:
        for name, s in socks.items():
            s.setsockopt(zmq.IDENTITY, f"{name}:1".encode())
            s.disconnect(net.addresses["control"])  # (the identity applies to the next connection)
            s.connect(net.addresses["control"])
            s.send_multipart(encode_msg("hello", actor_id=name, capacity=4))
        _pump_until(net, lambda: len(net.actors) == 2)
        busy, stuck = sorted(net.actors.values(), key=lambda a: a.actor_id)
        assert net.actors.grant_credits(8, min_version=0) == 8
        reclaims: list[tuple[float, str, int]] = []
        start = time.monotonic()
        while time.monotonic() - start < 8 * timeout:  # eight timeouts of generating, nothing delivered
            beat()
            for identity, msg in net.poll(100)[1]:
                net.handle_control(identity, msg)
            net.expire()
            reclaims += [(time.monotonic() - start, a.actor_id, n) for a, n in net.actors.take_reclaimed()[0]]
            net.actors.grant_credits(8 - net.actors.in_flight, min_version=0)
        assert busy.outstanding == 4 and not [r for r in reclaims if r[1] == "busy"]
        stuck_reclaims = [r for r in reclaims if r[1] == "stuck"]
        assert stuck_reclaims and stuck_reclaims[0][2] == 4  # all it held, once
        assert all(n == 1 for _, _, n in stuck_reclaims[1:])  # then one credit at a time
        assert len(stuck_reclaims) <= 8, stuck_reclaims  # at most one per timeout (the old code: one per pump)
        gaps = [b[0] - a[0] for a, b in zip(stuck_reclaims, stuck_reclaims[1:])]
        assert all(g >= timeout * 0.9 for g in gaps), gaps
    finally:
        for s in socks.values():
            s.close(0)
        net.close()
