"""The endpoint's HTTP side: an ASGI application served by uvicorn on one event loop thread.

One server per process (per :class:`asyncrl.endpoint.core.Endpoint`), on loopback, HTTP/1.1 with
keep-alive; httptools parses requests where it is installed (h11 otherwise). Routes, under each
session's base URL ``/s/<secret>/v1``:

- ``POST /chat/completions``, ``POST /completions``: OpenAI's shapes, ``stream: true`` as server-sent
  events in OpenAI's chunk format (``stream_options.include_usage`` adds the usage chunk at the end);
- ``POST /responses``: the Responses API (:mod:`asyncrl.endpoint.responses`), streamed as its typed
  events with ``stream: true``;
- ``GET /models``.

A request's handler submits its call to the endpoint's queue and awaits it: the rollout's thread
(which owns the engine) generates calls in batches and resolves them (one wake-up of this loop per
batch). Nothing here blocks that thread: a slow client only slows its own connection.

Limits (:mod:`asyncrl.endpoint.core`'s constants, read when a server starts): a request body of at most ``MAX_BODY_BYTES``
with a valid Content-Length (411/400/413 otherwise, and the connection closed); a request head of at
most ``MAX_HEAD_BYTES`` and ``MAX_HEADERS`` header lines (431 and closed past either, before more of
it is buffered); at most ``MAX_CONNECTIONS`` connections at once on each of the two sockets (one past
it is answered 503 and closed at once); a connection that sends nothing for ``READ_TIMEOUT_S`` while
no request of it is being answered (an idle keep-alive, a slow body) is closed, and so is one whose
request head is not complete ``READ_TIMEOUT_S`` after it began, however often bytes of it come (a
slow-loris); a call that gets no completion within
``request_timeout_s`` is answered 408. A connection reset or closed by its client mid-request is said
in one line, the first three and then every 100th (never a traceback).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import resource
import secrets
import shutil
import socket
import threading
import time
from typing import Any

import msgspec

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_CLOSE = [(b"connection", b"close")]
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_ID_BASE = secrets.token_hex(6)
_ID_COUNTER = itertools.count()


def fresh_id(prefix: str) -> str:
    """An id unique in this process (answers, tool calls): not a secret, so no random bytes per call
    (``uuid4`` reads the OS's random source, which cost more than the rest of an answer's fields)."""
    return f"{prefix}{_ID_BASE}{next(_ID_COUNTER):08x}"


def _protocol_base():
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:  # httptools is not installed: uvicorn's pure-Python parser
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def _raise_fd_limit(want: int) -> None:
    """Let the process hold ``want`` more descriptors (a thousand agents each hold a connection in
    this process, and the server holds the other end): the soft limit up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass


class _Dropped:
    """Counts connections refused or ended early; says so in one line, the first three and every 100th."""

    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()

    def say(self, what: str) -> None:
        with self.lock:
            self.count += 1
            n = self.count
        if n <= 3 or n % 100 == 0:
            print(f"[endpoint] {what} ({n} so far)", flush=True)


class _Coalesced:
    """A transport whose writes within one turn of the event loop leave in one ``send``: uvicorn
    writes a response's head and its body apart, and on loopback each send costs more than the
    rest of a small call. Everything else is the real transport's."""

    __slots__ = ("_t", "_loop", "_buf")

    def __init__(self, transport, loop) -> None:
        self._t, self._loop, self._buf = transport, loop, []

    def write(self, data) -> None:
        if not self._buf:
            self._loop.call_soon(self._flush)
        self._buf.append(bytes(data))

    def _flush(self) -> None:
        if self._buf:
            data, self._buf = b"".join(self._buf), []
            if not self._t.is_closing():
                self._t.write(data)

    def close(self) -> None:
        self._flush()
        self._t.close()

    def __getattr__(self, name):
        return getattr(self._t, name)


def _response_complete_without_timer(self) -> None:
    """uvicorn's ``on_response_complete`` (httptools), less its keep-alive timer, which it set and
    cancelled at every request: the protocol's read timer already closes a connection idle for
    ``read_timeout_s``."""
    self.server_state.total_requests += 1
    if self.transport.is_closing():
        return
    self.flow.resume_reading()
    if self.pipeline:
        cycle, app = self.pipeline.pop()
        self._start_asgi_task(cycle, app)


MAX_HEAD_BYTES = 64 << 10  # a request's line and headers together
MAX_HEADERS = 100  # header lines of one request


class _HeadRefused(Exception):
    """Raised in a parser callback: the request head is over a limit (answered 431, then closed)."""


class _Guards:
    """Before uvicorn's HTTP protocol (:func:`_make_protocol`): a cap on connections (one count per
    listening socket: the private Unix socket is never filled by TCP connections), a read timeout, a
    cap on the request head's size and header count, and a deadline for the whole head (a slow-loris
    that sends a byte now and then is closed all the same)."""

    # set by _make_protocol: refusals said through, the caps, and the connections per socket family
    _dropped: _Dropped
    _max_connections: int
    _read_timeout_s: float
    _counts: dict
    _refused, _timer, _last = False, None, 0.0
    _family, _head_start, _head_bytes, _head_size, _head_refused = None, None, 0, 0, None

    def connection_made(self, transport) -> None:  # noqa: D401
        sock = transport.get_extra_info("socket")
        self._family = getattr(sock, "family", socket.AF_INET)
        if self._counts.get(self._family, 0) >= self._max_connections:
            self._refused = True
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            transport.close()
            self._dropped.say(f"more than {self._max_connections} connections at once; refused one")
            return
        self._counts[self._family] = self._counts.get(self._family, 0) + 1
        super().connection_made(_Coalesced(transport, self.loop))
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._refused or self._head_refused:
            return
        self._arm()
        super().data_received(data)
        if self._head_start is not None and not self._head_refused:  # (a head still coming in)
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_head(f"a request head over {MAX_HEAD_BYTES:,} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_start, self._head_bytes, self._head_size = self.loop.time(), 0, 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        if len(self.headers) >= MAX_HEADERS or self._head_size > MAX_HEAD_BYTES:
            self._head_refused = (
                f"more than {MAX_HEADERS} header lines"
                if len(self.headers) >= MAX_HEADERS
                else f"request headers over {MAX_HEAD_BYTES:,} bytes"
            )
            raise _HeadRefused(self._head_refused)  # (stops the parser; answered in send_400_response)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_start = None
        super().on_headers_complete()

    def _refuse_head(self, why: str) -> None:
        self._head_refused = why
        body = f"{why}; at most {MAX_HEADERS} header lines and {MAX_HEAD_BYTES:,} bytes".encode()
        if not self.transport.is_closing():
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: text/plain\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
            )
            self.transport.close()
        self._dropped.say(f"refused a request: {why}")

    def connection_lost(self, exc) -> None:
        if self._refused:
            return
        self._counts[self._family] = self._counts.get(self._family, 1) - 1
        if self._timer is not None:
            self._timer.cancel()
        cycle = self.cycle
        if exc is not None or (cycle is not None and not cycle.response_complete):
            why = f"{type(exc).__name__}: {str(exc)[:120]}" if exc is not None else "closed by the client"
            self._dropped.say(f"a connection ended early ({why})")
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        if self._head_refused:  # (the parser stopped at a header over a limit)
            return self._refuse_head(self._head_refused)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # bytes past a request being answered do not
            cycle.keep_alive = False  # parse: that answer goes first, then the connection closes
            return
        super().send_400_response(msg)

    def _arm(self) -> None:  # (one timer per connection, moved on only when it fires: no cancel per read)
        self._last = self.loop.time()
        if self._timer is None:
            self._timer = self.loop.call_later(self._read_timeout_s, self._idle)

    def _idle(self) -> None:
        self._timer = None
        left = self._last + self._read_timeout_s - self.loop.time()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body:
            left = self._read_timeout_s  # a whole request is being answered: the wait is the engine's, not the client's
        if self._head_start is not None:  # a head has its own deadline, however often bytes of it come
            left = min(left, self._head_start + self._read_timeout_s - self.loop.time())
        if left > 0:
            self._timer = self.loop.call_later(left, self._idle)
        elif not self.transport.is_closing():
            self.transport.close()


def _make_protocol(dropped: _Dropped, max_connections: int, read_timeout_s: float, counts: dict):
    """uvicorn's protocol class (httptools, else h11) with :class:`_Guards` before it."""
    base = _protocol_base()
    complete = _response_complete_without_timer if hasattr(base, "_start_asgi_task") else base.on_response_complete
    return type(
        "Protocol",
        (_Guards, base),
        {
            "_dropped": dropped,
            "_max_connections": max_connections,
            "_read_timeout_s": read_timeout_s,
            "_counts": counts,
            "on_response_complete": complete,
        },
    )


class Server:
    """uvicorn on its own thread and event loop, bound to ``127.0.0.1`` on a free port, and to a Unix
    socket in a directory of this user's alone (mode 0700), ``uds_path``: the clients asyncrl lends
    to agents in this process connect there, so another local user who fills the TCP port's
    connections (or cannot be told from an agent) takes none of theirs. Each has its own cap."""

    def __init__(self, app, max_connections: int, read_timeout_s: float) -> None:
        import tempfile

        import uvicorn

        _raise_fd_limit(8 * max_connections + 1024)
        self.dropped = _Dropped()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4096)  # a whole batch of agents connecting at once
        self.server_address = self.sock.getsockname()
        self.uds_dir = tempfile.mkdtemp(prefix="asyncrl-endpoint-")  # (0700: no one else may connect)
        self.uds_path = os.path.join(self.uds_dir, "http.sock")
        self.uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.uds.bind(self.uds_path)
        self.uds.listen(4096)
        protocol = _make_protocol(self.dropped, max_connections, read_timeout_s, {})
        config = uvicorn.Config(
            app,
            http=protocol,
            loop="asyncio",
            lifespan="off",
            log_config=None,
            log_level="critical",
            access_log=False,
            timeout_keep_alive=int(max(read_timeout_s, 1)),
            timeout_graceful_shutdown=1,
            server_header=False,
            date_header=False,
            proxy_headers=False,
        )
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self.uvicorn = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, name="asyncrl-endpoint", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uvicorn.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not self.uvicorn.started:
            raise RuntimeError("the endpoint's HTTP server did not start")

    @property
    def _dropped(self) -> int:
        return self.dropped.count

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.uvicorn.serve(sockets=[self.sock, self.uds]))
        finally:
            self.loop.close()

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.uvicorn.force_exit = True
        self.thread.join(10)
        self.sock.close()
        self.uds.close()
        shutil.rmtree(self.uds_dir, ignore_errors=True)


# ---- the ASGI application ---------------------------------------------------------------------


async def send_json(send, status: int, body: Any, close: bool = False) -> None:
    data = _encode(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": _JSON + [(b"content-length", str(len(data)).encode())] + (_CLOSE if close else []),
        }
    )
    await send({"type": "http.response.body", "body": data})


async def send_events(send, events) -> None:
    """Server-sent events: each of ``events`` is ``(event name or None, payload)``; a payload of
    ``"[DONE]"`` is sent as is (chat and completions streams end so)."""
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
    parts = []
    for name, payload in events:
        data = payload.encode() if isinstance(payload, str) else _encode(payload)
        parts.append((b"event: " + name.encode() + b"\n" if name else b"") + b"data: " + data + b"\n\n")
    for i, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})
    if not parts:
        await send({"type": "http.response.body", "body": b""})


async def read_body(scope, receive, error, max_bytes: int, timeout_s: float) -> bytes:
    """The request body: a valid ``Content-Length`` (no chunked bodies) of at most ``max_bytes``,
    read within ``timeout_s``; otherwise ``error(status, code, message)`` (the connection is then
    closed after the answer)."""
    length = None
    for name, value in scope["headers"]:
        if name == b"content-length":
            length = value
            break
    if length is None:
        raise error(411, "length_required", "a POST needs a Content-Length header (chunked bodies are not taken)")
    text = length.decode("latin-1").strip()
    if not text.isdigit():
        raise error(400, "invalid_content_length", f"Content-Length {text[:40]!r} is not a non-negative integer")
    size = int(text)
    if size > max_bytes:
        raise error(413, "body_too_large", f"request body of {size:,} bytes; at most {max_bytes:,}")
    msg = await receive()  # (usually the whole body, already read with the head)
    if msg["type"] == "http.request" and not msg.get("more_body", False) and len(msg.get("body", b"")) <= size:
        return msg.get("body", b"")
    if msg["type"] == "http.disconnect":
        raise error(400, "client_disconnected", "the client closed the connection mid-request")
    chunks, got = [msg.get("body", b"")], len(msg.get("body", b""))
    if got > size:
        raise error(400, "invalid_content_length", "the body is longer than its Content-Length")
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise error(400, "client_disconnected", "the client closed the connection mid-request")
                chunk = msg.get("body", b"")
                got += len(chunk)
                if got > size:
                    raise error(400, "invalid_content_length", "the body is longer than its Content-Length")
                chunks.append(chunk)
                if not msg.get("more_body", False):
                    break
    except TimeoutError:
        raise error(408, "body_timeout", f"the request body did not arrive within {timeout_s:g} s") from None
    return b"".join(chunks)


def decode_json(raw: bytes, error) -> dict:
    try:
        body = _decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise error(400, "invalid_json", f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise error(400, "invalid_json", "the request body nests too deeply to be read") from None
    if not isinstance(body, dict):
        raise error(400, "invalid_json", "the request body must be a JSON object")
    return body
