"""Throughput helpers for wire benchmarks (used by ``bench/bench_wire.py``; bench code, not part of the library).

``measure_ingest`` times a PUSH/PULL transfer of the same message ``n`` times, with a sender
thread and the caller's thread receiving, so codec cost and transport cost can be compared in one
process: pass ``build`` (frames per send, e.g. an encoder) and ``handle`` (what the receiver does
with the received ``zmq.Frame`` list, e.g. decode) or leave them out for a raw pyzmq baseline of
pre-built frames. ``transport``: ``tcp`` (plain ``tcp://127.0.0.1``, what the learner bound before
issue 41), ``ipc`` (a socket file in a private directory: the learner's default on one host) or
``curve`` (``tcp://127.0.0.1`` with CURVE encryption: the learner with ``wire.curve_dir``).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from typing import Any, Callable

import zmq

from asyncrl.wire.sockets import bind, bind_ipc, private_dir


def _pair(ctx, transport: str, tmp: str) -> tuple:
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.linger = push.linger = 0
    if transport == "ipc":
        push.connect(bind_ipc(pull, private_dir(tmp), "bench"))
    elif transport == "curve":
        server_public, server_secret = zmq.curve_keypair()
        pull.curve_publickey, pull.curve_secretkey, pull.curve_server = server_public, server_secret, True
        push.curve_publickey, push.curve_secretkey = zmq.curve_keypair()
        push.curve_serverkey = server_public
        push.connect(bind(pull, "127.0.0.1", 0))
    elif transport == "tcp":
        push.connect(bind(pull, "127.0.0.1", 0))
    else:
        raise ValueError(f"transport {transport!r}: tcp, ipc or curve")
    return pull, push


def measure_ingest(
    frames: list,
    n: int,
    build: Callable[[], list] | None = None,
    handle: Callable[[list], Any] | None = None,
    timeout_s: float = 60.0,
    transport: str = "tcp",
) -> float:
    """Messages per second for ``n`` sends of ``frames`` (or of ``build()`` each time) from a
    PUSH thread to a PULL socket (over ``transport``), each received with
    ``recv_multipart(copy=False)`` and passed to ``handle``. Timing spans first send to last receive."""
    ctx = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="asyncrl-bench-")
    pull, push = _pair(ctx, transport, tmp)
    push.send(b"warmup")
    pull.poll(int(timeout_s * 1000)) and pull.recv()

    def sender() -> None:
        for _ in range(n):
            push.send_multipart(build() if build else frames, copy=False)

    t0 = time.perf_counter()
    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    try:
        for _ in range(n):
            if not pull.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"measure_ingest: no message within {timeout_s} s")
            received = pull.recv_multipart(copy=False)
            if handle is not None:
                handle(received)
        elapsed = time.perf_counter() - t0
        thread.join(timeout_s)
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(tmp, ignore_errors=True)
    return n / elapsed


def timed_rate(fn: Callable[[], Any], seconds: float = 1.0) -> float:
    """Calls per second of ``fn`` over about ``seconds`` (at least 3 calls)."""
    fn()
    count, t0 = 0, time.perf_counter()
    while count < 3 or time.perf_counter() - t0 < seconds:
        fn()
        count += 1
    return count / (time.perf_counter() - t0)
