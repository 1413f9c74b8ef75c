"""Throughput helpers for wire benchmarks (used by ``bench/bench_wire.py``; bench code, not part of the library).

``measure_ingest`` times a PUSH/PULL transfer over ``tcp://127.0.0.1`` of the same message ``n``
times, with a sender thread and the caller's thread receiving, so codec cost and transport cost
can be compared in one process: pass ``build`` (frames per send, e.g. an encoder) and ``handle``
(what the receiver does with the received ``zmq.Frame`` list, e.g. decode) or leave them out for a
raw pyzmq baseline of pre-built frames.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import zmq

from asyncrl.wire.sockets import bind


def measure_ingest(frames: list, n: int, build: Callable[[], list] | None = None,
                   handle: Callable[[list], Any] | None = None, timeout_s: float = 60.0) -> float:
    """Messages per second for ``n`` sends of ``frames`` (or of ``build()`` each time) from a
    PUSH thread to a PULL socket on 127.0.0.1, each received with ``recv_multipart(copy=False)``
    and passed to ``handle``. Timing spans first send to last receive."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.linger = push.linger = 0
    push.connect(bind(pull, "127.0.0.1", 0))
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
    return n / elapsed


def timed_rate(fn: Callable[[], Any], seconds: float = 1.0) -> float:
    """Calls per second of ``fn`` over about ``seconds`` (at least 3 calls)."""
    fn()
    count, t0 = 0, time.perf_counter()
    while count < 3 or time.perf_counter() - t0 < seconds:
        fn()
        count += 1
    return count / (time.perf_counter() - t0)
