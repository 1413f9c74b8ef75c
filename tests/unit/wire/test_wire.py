"""Wire format and socket helpers over real ZeroMQ sockets on 127.0.0.1 (no mocks)."""

from __future__ import annotations

import threading
import time

import msgpack
import msgspec
import numpy as np
import pytest
import torch
import zmq
import zmq.auth

from asyncrl.types import Episode, Task, Trajectory
from asyncrl.wire.codec import (
    SCHEMA_VERSION,
    SchemaVersionError,
    WireError,
    decode,
    decode_episode,
    decode_weights,
    encode,
    encode_episode,
    encode_msg,
    encode_weights,
)
from asyncrl.wire.messages import (
    Ack,
    Alive,
    Credit,
    Event,
    Hello,
    Rejected,
    ReplayTask,
    Status,
    Stop,
    Subscribe,
    Weights,
    Welcome,
    Withhold,
)
from asyncrl.wire.sockets import (
    WireSecurityError,
    apply_curve_client,
    apply_curve_server,
    bind,
    check_bind_host,
    drain,
    is_loopback,
    make_curve_keys,
    recv_frames,
    recv_message,
    recv_routed,
    send_frames,
    send_routed,
    start_curve_auth,
)

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
        return Trajectory(
            token_ids=rng.integers(0, 1000, n),
            loss_mask=rng.integers(0, 2, n),
            behavior_logprobs=-rng.random(n),
            policy_version=7,
            **kw,
        )

    trajs = [
        traj(
            5,
            reward=1.0,
            scores={"acc": 1.0, "fmt": 0.5},
            sample_type="answer",
            group_id="g1",
            task_id="t1",
            text="<answer>3</answer>",
            metadata={"turns": [1, 2], "k": None},
        ),
        traj(
            9,
            reward=-0.5,
            sample_type="solver",
            group_id="g1",
            task_id="t1",
            is_replay=True,
            recorded_logprobs=-rng.random(9),
            exp_mask=np.ones(9),
            advantage=0.25,
            metadata={"bucket": 3},
        ),
        traj(1, reward=0.0, sample_type="confidence", advantage=-1.5, text="ünïcode"),
    ]
    task = Task(id="t1", prompt=[{"role": "user", "content": "1+2?"}], answer={"gold": 3}, metadata={"src": "arith"})
    return Episode(
        trajectories=trajs,
        actor_id="actor-0",
        task=task,
        decision={"learnable": [True, False], "tree": {"a0": ["c0", "c1"]}},
        metrics={"unified_filter/kept": 2.0},
        created_at=1234.5,
    )


def _assert_episode_equal(a: Episode, b: Episode) -> None:
    for k in ("id", "actor_id", "task", "decision", "metrics", "created_at"):
        assert getattr(a, k) == getattr(b, k), k
    assert len(a.trajectories) == len(b.trajectories)
    for ta, tb in zip(a.trajectories, b.trajectories):
        for k in (
            "id",
            "policy_version",
            "reward",
            "scores",
            "sample_type",
            "group_id",
            "task_id",
            "is_replay",
            "advantage",
            "text",
            "metadata",
        ):
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
    arrays = {
        "a": np.arange(6, dtype=np.int64).reshape(2, 3),
        "b": np.array([True, False]),
        "c": np.arange(4, dtype=">f4"),
        "s": np.float32(2.5),
    }
    msg = decode(encode("weights", {"version": 1}, arrays))
    assert msg.kind == "weights" and msg.body == Weights(version=1)
    for k, v in arrays.items():
        assert np.array_equal(msg.arrays[k], v) and msg.arrays[k].shape == np.shape(v)
    credit = decode(encode_msg("credit", n=4, min_version=3))
    assert (credit.kind, credit.body, credit.arrays) == ("credit", Credit(n=4, min_version=3), {})


@pytest.mark.parametrize(
    "body",
    [
        Hello(actor_id="a", capacity=3, version=2, pid=7),
        Welcome(session="s", addresses={"episodes": "tcp://127.0.0.1:1"}, lease_s=20.0),
        Credit(
            n=2,
            min_version=1,
            replay=[
                ReplayTask(
                    task=Task(id="t", prompt=[{"role": "user", "content": "1+1"}], answer={"gold": [2]}), n=3, k=1
                )
            ],
            withhold=Withhold(reset=True, add=["t1"], remove=["t0"]),
        ),
        Ack(ids=["e1"], rejected=[Rejected(id="e2", reason="token_range: token id 99")]),
        Status(actor_id="a", identity="a:1", capacity=4, version=3, batches=2, generate_s=1.5, stopping=True),
        Alive(session="s", version=4),
        Stop(reason="done"),
        Subscribe(actor_id="a", have=-1),
        Weights(version=3, path="/tmp/w.safetensors"),
        Event(event={"kind": "x", "nested": {"a": [1, None, "s"]}}),
    ],
)
def test_every_message_kind_round_trips_typed(body):
    msg = decode(encode(body.KIND, body))
    assert type(msg.body) is type(body) and msg.body == body
    assert decode(encode_msg(body.KIND, **msgspec.structs.asdict(body))).body == body  # from fields too


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
    h = {"schema": SCHEMA_VERSION, "kind": "stop", "body": {}, "arrays": []}
    h.update(overrides)
    return msgpack.packb({k: v for k, v in h.items() if v is not ...}, use_bin_type=True)


def _deep(n: int):
    v: object = 0
    for _ in range(n):
        v = [v]
    return v


_W = {"kind": "weights", "body": {"version": 1}}


@pytest.mark.parametrize(
    "frames, err, words",
    [
        ([b"\xc1\xff garbage"], WireError, "not a msgpack header"),
        ([msgpack.packb([1, 2])], WireError, "message header: expected object, got array"),
        ([_header(schema=99)], SchemaVersionError, "schema version 99, this process speaks 2"),
        ([_header(body=...)], WireError, "missing required field 'body'"),
        ([_header(kind="nope")], WireError, "unknown message kind 'nope'"),
        (
            [_header(kind="hello", body={"actor_id": "x", "capacity": "lots"})],
            WireError,
            "message 'hello' field 'capacity': expected int, got str",
        ),
        (
            [_header(kind="hello", body={"actor_id": "x", "capacity": None})],
            WireError,
            "message 'hello' field 'capacity': expected int, got None",
        ),
        ([_header(kind="hello", body={"actor_id": "x", "capacity": 0})], WireError, "expected int >= 1"),
        (
            [_header(kind="hello", body={"actor_id": "x"})],
            WireError,
            "message 'hello': object missing required field 'capacity'",
        ),
        (
            [
                _header(
                    kind="status", body={"actor_id": "x", "identity": "x", "capacity": 1, "version": 0, "kind": "boom"}
                )
            ],
            WireError,
            "unknown field 'kind'",
        ),
        (
            [_header(kind="status", body={"actor_id": "x", "identity": "x", "capacity": 1, "version": float("inf")})],
            WireError,
            "field 'version': expected int, got float",
        ),
        (
            [_header(kind="subscribe", body={"actor_id": "x", "have": "x"})],
            WireError,
            "message 'subscribe' field 'have': expected int",
        ),
        (
            [_header(kind="event", body={"event": {"note": b"\x00\xff"}})],
            WireError,
            "message 'event' field 'event[...]': expected bool | int | float | str | object | array | null, got bytes",
        ),
        ([_header(kind="event", body={"event": {"deep": _deep(990)}})], WireError, "nest at most 12 levels"),
        (
            [_header(kind="stop", arrays=[{"name": "x", "dtype": "int32", "shape": [1]}]), b"1234"],
            WireError,
            "only ['episode', 'weights'] messages carry arrays",
        ),
        (
            [_header(**_W, arrays=[{"name": "x", "dtype": "complex64", "shape": [1]}]), b"12345678"],
            WireError,
            "unknown dtype 'complex64'",
        ),
        (
            [_header(**_W, arrays=[{"name": "x", "dtype": "int32", "shape": [2]}])],
            WireError,
            "0 array frames but its header lists 1",
        ),
        (
            [_header(**_W, arrays=[{"name": "x", "dtype": "int32", "shape": [2]}]), b"123"],
            WireError,
            "'x' frame has 3 bytes, expected 8",
        ),
        (
            [_header(**_W, arrays=[{"name": "x", "dtype": "int32", "shape": [2**32, 2**32]}]), b""],
            WireError,
            f"'x' frame has 0 bytes, expected {4 * 2**64}",
        ),  # the product must not wrap around to 0
        (
            [_header(**_W, arrays=[{"name": "x", "dtype": "int32", "shape": [-1]}]), b""],
            WireError,
            "message header field 'arrays[0].shape[0]': expected int >= 0",
        ),
        ([], WireError, "empty message"),
    ],
)
def test_decode_errors(frames, err, words):
    with pytest.raises(err) as e:
        decode(frames)
    assert words in str(e.value)


def test_decode_limits_header_size_and_kind():
    frames = encode_msg("event", event={"text": "x" * 5000})
    assert decode(frames, max_header_bytes=6000).body.event["text"] == "x" * 5000
    with pytest.raises(WireError, match="header is 50.. bytes; this channel takes at most 4096") as e:
        decode(frames, max_header_bytes=4096)
    assert e.value.reason == "too_large"
    with pytest.raises(WireError, match="a 'event' message on a channel that takes \\['hello'\\]"):
        decode(frames, kinds=("hello",))


def test_schema_error_names_both_versions():
    with pytest.raises(SchemaVersionError) as e:
        decode([_header(schema=99)])
    assert (e.value.remote, e.value.local) == (99, SCHEMA_VERSION)
    assert "upgrade the older side" in str(e.value)


def test_schema_1_episodes_still_decode_other_kinds_do_not():
    """Write-ahead logs and checkpoints written before schema 2 hold schema-1 episodes (same layout)."""
    ep = _episode()
    frames = encode_episode(ep)
    header = msgpack.unpackb(frames[0])
    frames[0] = msgpack.packb({**header, "schema": 1})
    _assert_episode_equal(ep, decode_episode(decode(frames)))
    with pytest.raises(SchemaVersionError):
        decode([_header(schema=1)])


def _broken_episode(mutate) -> str:
    """The error of an episode whose msgpack header (a dict) was changed by ``mutate``."""
    frames = encode_episode(_episode())
    header = msgpack.unpackb(frames[0])
    mutate(header, frames)
    frames[0] = msgpack.packb(header, use_bin_type=True)
    with pytest.raises(WireError) as e:
        decode_episode(decode(frames))
    return str(e.value)


def test_episode_field_errors():
    cols = lambda h: h["body"]["trajectories"]  # noqa: E731
    assert "field 'trajectories': object missing required field 'policy_version'" in _broken_episode(
        lambda h, f: cols(h).pop("policy_version")
    )
    assert "field 'trajectories.is_replay[1]': expected bool, got str" in _broken_episode(
        lambda h, f: cols(h)["is_replay"].__setitem__(1, "yes")
    )
    assert "field 'trajectories.length' has 2 entries, expected 3" in _broken_episode(
        lambda h, f: cols(h)["length"].pop()
    )
    assert "'token_ids' has 15 elements but the trajectory lengths sum to 16" in _broken_episode(
        lambda h, f: cols(h)["length"].__setitem__(0, 6)
    )
    assert "array 'exp_mask' is missing" in _broken_episode(lambda h, f: (h["arrays"].pop(), f.pop()))
    assert "field 'episode.task': object missing required field 'id'" in _broken_episode(
        lambda h, f: h["body"]["episode"].__setitem__("task", {})
    )
    assert (
        "field 'episode.decision[...]': expected bool | int | float | str | object | array | null, got bytes"
        in _broken_episode(lambda h, f: h["body"]["episode"]["decision"].__setitem__("blob", b"\x00"))
    )
    assert "unknown field 'extra'" in _broken_episode(lambda h, f: h["body"]["episode"].__setitem__("extra", 1))
    with pytest.raises(WireError, match="expected an 'episode' message"):
        decode_episode(decode(encode_msg("stop")))


def test_encode_rejects_bad_values():
    with pytest.raises(WireError, match="dtype complex64"):
        encode("weights", {"version": 1}, {"z": np.zeros(2, np.complex64)})
    with pytest.raises(WireError, match="cannot encode message 'hello' field 'actor_id': expected str"):
        encode_msg("hello", actor_id=object(), capacity=1)
    with pytest.raises(WireError, match="unknown message kind 'x'"):
        encode_msg("x")
    with pytest.raises(WireError, match="needs a Hello body, got Stop"):
        encode("hello", Stop())


# --- sockets ----------------------------------------------------------------------------------


def test_bad_message_then_good_one_on_pull(ctx):
    pull, push = _pair(ctx)
    push.send_multipart([b"not msgpack \xc1"])
    send_frames(push, encode_msg("ack", ids=["e1"]))
    errors, got = [], None
    for _ in range(2):
        try:
            got = _recv(pull)
        except WireError as e:
            errors.append(str(e))
    assert len(errors) == 1 and "message header: expected object, got int" in errors[0]
    assert got.kind == "ack" and got.body == Ack(ids=["e1"])


def test_router_dealer_routing(ctx):
    router, dealer = _pair(ctx, zmq.ROUTER, zmq.DEALER)
    ep = _episode()
    send_frames(dealer, encode_episode(ep))
    ident, msg = _recv(router, recv_routed)
    _assert_episode_equal(ep, decode_episode(msg))
    send_routed(router, ident, encode_msg("ack", ids=[decode_episode(msg).id]))
    assert _recv(dealer).body == Ack(ids=[ep.id])
    dealer.send_multipart([b"\x91\x01"])  # a msgpack list: bad header, identity still reported
    with pytest.raises(WireError, match="message header: expected object, got array") as e:
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


@pytest.mark.parametrize(
    "host, expected",
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("*", False),
        ("10.0.0.1", False),
        ("::", False),
        ("example.com", False),
        ("", False),
    ],
)
def test_is_loopback(host, expected):
    assert is_loopback(host) is expected


def test_recv_frames_drops_a_message_with_too_many_parts(ctx):
    pull, push = _pair(ctx)
    push.send_multipart([b"x"] * 1000)
    send_frames(push, encode_msg("stop"))
    assert pull.poll(TIMEOUT_MS)
    with pytest.raises(WireError, match="message of 1000 frames; this channel takes at most 6") as e:
        recv_frames(pull, max_parts=6)
    assert e.value.reason == "too_large"
    assert decode(_recv(pull, lambda s: recv_frames(s, max_parts=6))).kind == "stop"  # the next one is intact


def test_drain_isolates_failures_and_stops_at_its_limit(ctx):
    pull, push = _pair(ctx)
    for i in range(5):
        send_frames(push, encode_msg("stop", reason=str(i)))
    assert pull.poll(TIMEOUT_MS)
    deadline = time.time() + 10
    while pull.getsockopt(zmq.EVENTS) & zmq.POLLIN and time.time() < deadline:
        got, errors = [], []

        def handle(frames):
            reason = decode(frames).body.reason
            if reason == "1":
                raise KeyError("a handler bug")
            got.append(reason)  # noqa: B023 (drained before the next turn of the loop)

        taken = drain(pull, handle, limit=3, on_error=errors.append)
        assert taken <= 3
        if got or errors:
            break
    assert got[:1] == ["0"] and isinstance(errors[0], KeyError)  # message 1 lost alone
    rest = []
    drain(pull, lambda fr: rest.append(decode(fr).body.reason), limit=10)
    assert got + rest == ["0", "2", "3", "4"][: len(got + rest)] and len(got + rest) >= 2


def test_drain_lets_os_errors_through(ctx):
    pull, push = _pair(ctx)
    send_frames(push, encode_msg("stop"))
    assert pull.poll(TIMEOUT_MS)

    def full_disk(frames):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        drain(pull, full_disk, limit=1, on_error=lambda e: None)


def test_curve_bundles_keep_the_server_secret_on_the_server(tmp_path):
    bundles = make_curve_keys(str(tmp_path / "keys"), ["0", "gpu"])
    files = {name: sorted(p.name for p in (tmp_path / "keys" / name).iterdir()) for name in bundles}
    assert files == {
        "server": ["authorized", "server.key", "server.key_secret"],
        "actor-0": ["actor.key", "actor.key_secret", "server.key"],
        "actor-gpu": ["actor.key", "actor.key_secret", "server.key"],
    }
    assert sorted(p.name for p in (tmp_path / "keys" / "server" / "authorized").iterdir()) == [
        "actor-0.key",
        "actor-gpu.key",
    ]
    server_public = (tmp_path / "keys" / "server" / "server.key").read_bytes()
    assert (tmp_path / "keys" / "actor-gpu" / "server.key").read_bytes() == server_public
    make_curve_keys(str(tmp_path / "keys"), ["new"])  # adding an actor keeps the server pair
    assert (tmp_path / "keys" / "server" / "server.key").read_bytes() == server_public
    assert (tmp_path / "keys" / "server" / "authorized" / "actor-new.key").is_file()


def test_old_single_directory_keys_are_refused_with_how_to_regenerate(ctx, tmp_path):
    for name in ("server", "client"):
        zmq.auth.create_certificates(str(tmp_path), name)
    for fn in (
        lambda: check_bind_host("0.0.0.0", str(tmp_path)),
        lambda: apply_curve_client(ctx.socket(zmq.DEALER), str(tmp_path)),
    ):
        with pytest.raises(WireSecurityError, match="old single-directory CURVE layout.*asyncrl keys --out"):
            fn()


def test_curve_auth_restarts_on_one_context_and_a_second_live_one_is_refused_clearly(tmp_path):
    """A server closed and reopened in one process starts its authenticator again although libzmq
    unbinds the closed one's ZAP endpoint asynchronously (CI once failed on that race); a second live
    authenticator on the same context is refused with a line that says why."""
    keys = tmp_path / "keys"
    make_curve_keys(str(keys), ["0"])
    c = zmq.Context()
    try:
        for _ in range(30):
            start_curve_auth(c, str(keys)).stop()
        auth = start_curve_auth(c, str(keys))
        try:
            t0 = time.monotonic()
            with pytest.raises(WireSecurityError, match="already has one.*close the other server"):
                start_curve_auth(c, str(keys))
            assert time.monotonic() - t0 >= 9.0  # it waited for the endpoint to go before saying so
        finally:
            auth.stop()
    finally:
        c.term()


def test_curve_exchange_and_auth(ctx, tmp_path):
    keys = tmp_path / "keys"
    make_curve_keys(str(keys), ["0"])
    check_bind_host("0.0.0.0", str(keys))  # keys present: allowed (DIR or DIR/server)
    check_bind_host("0.0.0.0", str(keys / "server"))
    auth = start_curve_auth(ctx.ctx, str(keys))
    try:
        server, client, stranger = (ctx.socket(t) for t in (zmq.PULL, zmq.PUSH, zmq.PUSH))
        apply_curve_server(server, str(keys / "server"))
        addr = bind(server, "127.0.0.1", 0)
        apply_curve_client(client, str(keys), "actor-0")  # DIR plus the actor id finds DIR/actor-0
        client.connect(addr)
        send_frames(client, encode_msg("hello", actor_id="a0", capacity=1))
        assert _recv(server).body == Hello(actor_id="a0", capacity=1)
        # a client with a key pair the server never authorised is refused, and reported
        other = tmp_path / "other"
        make_curve_keys(str(other), ["0"])
        apply_curve_client(stranger, str(other / "actor-0"))
        stranger.curve_serverkey = zmq.auth.load_certificate(str(keys / "server" / "server.key"))[0]
        stranger.connect(addr)
        try:  # without blocking: once the server has refused the handshake, a PUSH has no peer to queue for
            send_frames(stranger, encode_msg("hello", actor_id="intruder", capacity=1), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        assert not server.poll(300, zmq.POLLIN)
        stranger_key = zmq.auth.load_certificate(str(other / "actor-0" / "actor.key"))[0].decode()
        deadline = time.time() + 10
        denied: list = []
        while time.time() < deadline and not denied:
            denied = auth.keys.take_denied()
            time.sleep(0.05)
        assert [k for k, _ in denied][:1] == [stranger_key]
    finally:
        auth.stop()


def test_a_refused_actor_says_so_even_when_the_refusal_comes_before_its_monitor_or_its_hello(
    ctx, tmp_path, monkeypatch, capsys
):
    """CI, under load: a restarted actor whose key had been revoked never said it was refused. Two
    causes. libzmq tells a socket monitor only what happens after it is attached, and says a CURVE
    refusal once (it does not try again), but the actor attached its monitor after ``connect``. And
    the actor's first hello was a blocking send: once the refusal had removed the connection (a slow
    start-up, such as the start-up heap's collection), it waited for ever, before it could read the
    monitor. Here attaching a monitor to a connected socket waits until the learner has refused the
    key, and the hello comes after the refused connection is gone."""
    import asyncrl.actor.link as actor_net
    from asyncrl.config import WireConfig

    keys = tmp_path / "keys"
    make_curve_keys(str(keys), ["a2"])
    (keys / "server" / "authorized" / "actor-a2.key").unlink()  # revoked
    auth = start_curve_auth(ctx.ctx, str(keys))
    net = hello = None
    try:
        server = ctx.socket(zmq.ROUTER)
        apply_curve_server(server, str(keys / "server"))
        addr = bind(server, "127.0.0.1", 0)
        connected, denied = set(), []
        real_connect, real_monitor = actor_net.connect, zmq.Socket.get_monitor_socket

        def connect(sock, address):
            connected.add(sock)
            return real_connect(sock, address)

        def monitor_after_the_refusal(sock, *args, **kwargs):
            deadline = time.monotonic() + 30
            while sock in connected and not denied and time.monotonic() < deadline:
                denied.extend(auth.keys.take_denied())
                time.sleep(0.02)
            return real_monitor(sock, *args, **kwargs)

        monkeypatch.setattr(actor_net, "connect", connect)
        monkeypatch.setattr(zmq.Socket, "get_monitor_socket", monitor_after_the_refusal)
        net = actor_net.ActorLink(WireConfig(curve_dir=str(keys)), addr, "a2", b"a2:1")
        deadline = time.monotonic() + 30
        while not denied and time.monotonic() < deadline:
            denied.extend(auth.keys.take_denied())
            time.sleep(0.02)
        while net.control.poll(0, zmq.POLLOUT) and time.monotonic() < deadline:  # the refused connection goes
            time.sleep(0.02)
        assert denied and not net.control.poll(0, zmq.POLLOUT)
        # a hello now (CI: it came after a slow start-up) has no connection to queue on: it must not wait
        hello = threading.Thread(target=net.hello, args=(4, 0, 1), daemon=True)
        hello.start()
        hello.join(30)
        assert not hello.is_alive(), "a hello to a learner that refused this actor blocked the actor"
        while "refused this actor's CURVE key" not in capsys.readouterr().out and time.monotonic() < deadline + 30:
            net.poll(100)
        assert net._refused_said, "the actor did not say the learner refused its key"
    finally:
        if net is not None and not (hello is not None and hello.is_alive()):  # (a blocked send owns the socket)
            net.close()
        auth.stop()


def test_missing_curve_keys_explain_how_to_make_them(ctx, tmp_path):
    with pytest.raises(WireSecurityError, match="asyncrl keys --out DIR"):
        apply_curve_server(ctx.socket(zmq.PULL), str(tmp_path))


def test_an_actor_bundle_holding_the_server_secret_is_warned_about(ctx, tmp_path):
    import shutil
    import warnings as w

    from asyncrl.wire.sockets import actor_bundle

    keys = tmp_path / "keys"
    make_curve_keys(str(keys), ["0"])
    with w.catch_warnings():
        w.simplefilter("error")
        actor_bundle(str(keys / "actor-0"))  # as made: no warning
    shutil.copyfile(keys / "server" / "server.key_secret", keys / "actor-0" / "server.key_secret")
    with pytest.warns(UserWarning, match="holds the learner's secret key"):
        actor_bundle(str(keys / "actor-0"))
