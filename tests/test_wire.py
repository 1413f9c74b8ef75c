"""Wire format and socket helpers over real ZeroMQ sockets on 127.0.0.1 (no mocks)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
import zmq
import zmq.auth

from asyncrl.types import Episode, Task, Trajectory
from asyncrl.wire.codec import (SCHEMA_VERSION, SchemaVersionError, WireError, decode,
                                decode_episode, decode_weights, encode, encode_episode,
                                encode_msg, encode_weights)
from asyncrl.wire.sockets import (WireSecurityError, apply_curve_client, apply_curve_server, bind,
                                  check_bind_host, is_loopback, make_curve_keys, recv_message,
                                  recv_routed, send_frames, send_routed, start_curve_auth)

TIMEOUT_MS = 2000


class Zmq:
    """A context whose sockets (linger 0) are all closed at teardown."""

    def __init__(self):
        self.ctx, self.made = zmq.Context(), []

    def socket(self, kind):
        s = self.ctx.socket(kind)
        s.linger = 0
        self.made.append(s)
        return s

    def close(self):
        for s in self.made:
            s.close(0)
        self.ctx.term()


@pytest.fixture
def ctx():
    z = Zmq()
    yield z
    z.close()


def _pair(ctx, kind_a=zmq.PULL, kind_b=zmq.PUSH):
    a, b = ctx.socket(kind_a), ctx.socket(kind_b)
    addr = bind(a, "127.0.0.1", 0)
    b.connect(addr)
    return a, b


def _recv(sock, fn=recv_message, timeout_ms=TIMEOUT_MS):
    assert sock.poll(timeout_ms, zmq.POLLIN), "no message within the timeout"
    return fn(sock)


def _episode() -> Episode:
    rng = np.random.default_rng(0)

    def traj(n, **kw):
        return Trajectory(token_ids=rng.integers(0, 1000, n), loss_mask=rng.integers(0, 2, n),
                          behavior_logprobs=-rng.random(n), policy_version=7, **kw)

    trajs = [
        traj(5, reward=1.0, scores={"acc": 1.0, "fmt": 0.5}, sample_type="answer", group_id="g1",
             task_id="t1", text="<answer>3</answer>", metadata={"turns": [1, 2], "k": None}),
        traj(9, reward=-0.5, sample_type="solver", group_id="g1", task_id="t1", is_replay=True,
             recorded_logprobs=-rng.random(9), exp_mask=np.ones(9), advantage=0.25,
             metadata={"bucket": 3}),
        traj(1, reward=0.0, sample_type="confidence", advantage=-1.5, text="ünïcode"),
    ]
    task = Task(id="t1", prompt=[{"role": "user", "content": "1+2?"}], answer={"gold": 3},
                metadata={"src": "arith"})
    return Episode(trajectories=trajs, actor_id="actor-0", task=task,
                   decision={"learnable": [True, False], "tree": {"a0": ["c0", "c1"]}},
                   metrics={"unified_filter/kept": 2.0}, created_at=1234.5)


def _assert_episode_equal(a: Episode, b: Episode) -> None:
    for k in ("id", "actor_id", "task", "decision", "metrics", "created_at"):
        assert getattr(a, k) == getattr(b, k), k
    assert len(a.trajectories) == len(b.trajectories)
    for ta, tb in zip(a.trajectories, b.trajectories):
        for k in ("id", "policy_version", "reward", "scores", "sample_type", "group_id",
                  "task_id", "is_replay", "advantage", "text", "metadata"):
            assert getattr(ta, k) == getattr(tb, k), k
        for k in ("token_ids", "loss_mask", "behavior_logprobs", "recorded_logprobs", "exp_mask"):
            xa, xb = getattr(ta, k), getattr(tb, k)
            assert (xa is None) == (xb is None), k
            if xa is not None:
                assert xa.dtype == xb.dtype and np.array_equal(xa, xb), k


# --- codec ------------------------------------------------------------------------------------

def test_episode_round_trip_over_push_pull(ctx):
    pull, push = _pair(ctx)
    ep = _episode()
    frames = encode_episode(ep)
    assert len(frames) == 1 + 5  # header + token_ids, loss_mask, behavior, recorded, exp_mask
    send_frames(push, frames)
    got = decode_episode(_recv(pull))
    _assert_episode_equal(ep, got)
    assert got.trajectories[0].token_ids.dtype == np.int32
    assert got.trajectories[0].recorded_logprobs is None and got.trajectories[2].exp_mask is None


def test_episode_without_optional_arrays_has_three_frames():
    ep = _episode()
    for t in ep.trajectories:
        t.recorded_logprobs = t.exp_mask = None
    frames = encode_episode(ep)
    assert len(frames) == 4
    _assert_episode_equal(ep, decode_episode(decode(frames), copy=True))


def test_empty_episode_round_trips():
    ep = Episode(trajectories=[], actor_id="a")
    _assert_episode_equal(ep, decode_episode(decode(encode_episode(ep))))


def test_generic_arrays_and_control_messages():
    arrays = {"a": np.arange(6, dtype=np.int64).reshape(2, 3), "b": np.array([True, False]),
              "c": np.arange(4, dtype=">f4"), "s": np.float32(2.5)}
    msg = decode(encode("x", {"n": 1}, arrays))
    assert msg.kind == "x" and msg.body == {"n": 1}
    for k, v in arrays.items():
        assert np.array_equal(msg.arrays[k], v) and msg.arrays[k].shape == np.shape(v)
    ack = decode(encode_msg("credit", n=4, min_version=3))
    assert (ack.kind, ack.body, ack.arrays) == ("credit", {"n": 4, "min_version": 3}, {})


def test_weights_round_trip_load_state_dict(ctx):
    pull, push = _pair(ctx)
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        src, dst = torch.nn.Linear(8, 4).to(dtype), torch.nn.Linear(8, 4).to(dtype)
        send_frames(push, encode_weights(src.state_dict(), version=12))
        version, tensors = decode_weights(_recv(pull))
        assert version == 12 and list(tensors) == ["weight", "bias"]
        assert all(t.dtype == dtype for t in tensors.values())
        dst.load_state_dict(tensors)
        for k, v in src.state_dict().items():
            assert torch.equal(dst.state_dict()[k], v)


def test_weights_from_bytes_are_writable_copies():
    frames = [bytes(f) for f in encode_weights({"w": torch.ones(3, dtype=torch.bfloat16)}, 1)]
    _, tensors = decode_weights(decode(frames))
    tensors["w"].add_(1)  # would fail or corrupt if it aliased immutable bytes
    assert tensors["w"].tolist() == [2.0, 2.0, 2.0]


def _header(**overrides) -> bytes:
    h = {"schema": SCHEMA_VERSION, "kind": "k", "body": {}, "arrays": []}
    h.update(overrides)
    return msgpack.packb({k: v for k, v in h.items() if v is not ...})


@pytest.mark.parametrize("frames, err, words", [
    ([b"\xc1\xff garbage"], WireError, "not a msgpack header"),
    ([msgpack.packb([1, 2])], WireError, "header is a list"),
    ([_header(schema=2)], SchemaVersionError, "schema version 2, this process speaks 1"),
    ([_header(body=...)], WireError, "missing keys ['body']"),
    ([_header(arrays=[{"name": "x", "dtype": "complex64", "shape": [1]}]), b"12345678"],
     WireError, "unknown dtype 'complex64'"),
    ([_header(arrays=[{"name": "x", "dtype": "int32", "shape": [2]}])], WireError,
     "0 array frames but its header lists 1"),
    ([_header(arrays=[{"name": "x", "dtype": "int32", "shape": [2]}]), b"123"], WireError,
     "'x' frame has 3 bytes, expected 8"),
    ([], WireError, "empty message"),
])
def test_decode_errors(frames, err, words):
    with pytest.raises(err) as e:
        decode(frames)
    assert words in str(e.value)


def test_schema_error_names_both_versions():
    with pytest.raises(SchemaVersionError) as e:
        decode([_header(schema=2)])
    assert (e.value.remote, e.value.local) == (2, 1)
    assert "upgrade the older side" in str(e.value)


def test_episode_field_errors():
    def broken(mutate):
        msg = decode(encode_episode(_episode()))
        mutate(msg)
        with pytest.raises(WireError) as e:
            decode_episode(msg)
        return str(e.value)

    assert "'trajectories.policy_version' is missing" in broken(
        lambda m: m.body["trajectories"].pop("policy_version"))
    assert "'trajectories[1].is_replay' is a str" in broken(
        lambda m: m.body["trajectories"]["is_replay"].__setitem__(1, "yes"))
    assert "'trajectories.length' has 2 entries, expected 3" in broken(
        lambda m: m.body["trajectories"]["length"].pop())
    assert "'token_ids' has 15 elements but the trajectory lengths sum to 16" in broken(
        lambda m: m.body["trajectories"]["length"].__setitem__(0, 6))
    assert "array 'exp_mask' is missing" in broken(lambda m: m.arrays.pop("exp_mask"))
    assert "'episode.task' is invalid" in broken(
        lambda m: m.body["episode"].__setitem__("task", {}))
    assert "expected an 'episode' message" in broken(lambda m: setattr(m, "kind", "ack"))


def test_encode_rejects_bad_values():
    with pytest.raises(WireError, match="dtype complex64"):
        encode("x", {}, {"z": np.zeros(2, np.complex64)})
    with pytest.raises(WireError, match="not msgpack-serialisable"):
        encode_msg("x", obj=object())


# --- sockets ----------------------------------------------------------------------------------

def test_bad_message_then_good_one_on_pull(ctx):
    pull, push = _pair(ctx)
    push.send_multipart([b"not msgpack \xc1"])
    send_frames(push, encode_msg("ack", episode_ids=["e1"]))
    errors, got = [], None
    for _ in range(2):
        try:
            got = _recv(pull)
        except WireError as e:
            errors.append(str(e))
    assert len(errors) == 1 and "not a msgpack header" in errors[0]
    assert got.kind == "ack" and got.body == {"episode_ids": ["e1"]}


def test_router_dealer_routing(ctx):
    router, dealer = _pair(ctx, zmq.ROUTER, zmq.DEALER)
    ep = _episode()
    send_frames(dealer, encode_episode(ep))
    ident, msg = _recv(router, recv_routed)
    _assert_episode_equal(ep, decode_episode(msg))
    send_routed(router, ident, encode_msg("ack", episode_ids=[decode_episode(msg).id]))
    assert _recv(dealer).body == {"episode_ids": [ep.id]}
    dealer.send_multipart([b"\x91\x01"])  # a msgpack list: bad header, identity still reported
    with pytest.raises(WireError, match="header is a list") as e:
        _recv(router, recv_routed)
    assert e.value.identity == ident


def test_check_bind_host_refuses_public_without_keys(ctx):
    with pytest.raises(WireSecurityError) as e:
        check_bind_host("0.0.0.0", None)
    assert "asyncrl keys --out DIR" in str(e.value) and "wire.curve_dir=DIR" in str(e.value)
    check_bind_host("127.0.0.1", None)
    sock = ctx.socket(zmq.PULL)
    with pytest.raises(WireSecurityError):
        bind(sock, "0.0.0.0", 0)


@pytest.mark.parametrize("host, expected", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True), ("::1", True),
    ("[::1]", True), ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("*", False),
    ("10.0.0.1", False), ("::", False), ("example.com", False), ("", False),
])
def test_is_loopback(host, expected):
    assert is_loopback(host) is expected


def test_curve_exchange_and_auth(ctx, tmp_path):
    paths = make_curve_keys(str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["server.key", "server.key_secret",
                                                    "client.key", "client.key_secret"]
    check_bind_host("0.0.0.0", str(tmp_path))  # keys present: allowed
    auth = start_curve_auth(ctx.ctx, str(tmp_path))
    try:
        server, client, stranger = (ctx.socket(t) for t in (zmq.PULL, zmq.PUSH, zmq.PUSH))
        apply_curve_server(server, str(tmp_path))
        addr = bind(server, "127.0.0.1", 0)
        apply_curve_client(client, str(tmp_path))
        client.connect(addr)
        send_frames(client, encode_msg("hello", actor_id="a0"))
        assert _recv(server).body == {"actor_id": "a0"}
        # a client with a key not in the directory is rejected by the authenticator
        other = tmp_path / "other"
        make_curve_keys(str(other))
        apply_curve_client(stranger, str(other))
        stranger.curve_serverkey = zmq.auth.load_certificate(paths[0])[0]
        stranger.connect(addr)
        send_frames(stranger, encode_msg("hello", actor_id="intruder"))
        assert not server.poll(300, zmq.POLLIN)
    finally:
        auth.stop()


def test_missing_curve_keys_explain_how_to_make_them(ctx, tmp_path):
    with pytest.raises(WireSecurityError, match="asyncrl keys --out DIR"):
        apply_curve_server(ctx.socket(zmq.PULL), str(tmp_path))
