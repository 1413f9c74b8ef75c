"""An authenticated, bounded rendezvous store for torch.distributed, served over ZeroMQ.

``torch.distributed.TCPStore`` listens on every interface (``*:PORT`` whatever host it is given),
admits anyone who connects, and holds whatever they ``set``: a process on the same host could
register fake members of the weight-sync group (each stalling the learner until the group's timeout)
or grow the learner's memory without limit. :class:`StoreServer` replaces it where asyncrl serves a
store (the ``nccl`` weight-sync group, ``asyncrl run --learner-procs``):

- it binds only the configured host (a non-loopback host only as a CURVE server, with the learner's
  ZAP authenticator admitting the keys in ``authorized/``, as every other learner socket);
- every request carries the store's secret (random per store, handed to members over an
  authenticated channel: the learner's ``weights`` message, or the launcher's environment); a
  request without it is answered ``refused`` and changes nothing;
- it holds at most ``max_keys`` keys, ``max_value_bytes`` per value and ``max_total_bytes`` in all,
  and a larger message is dropped by ZeroMQ before it is read (``MAXMSGSIZE``).

:class:`StoreClient` and :class:`LocalStore` are ``torch.distributed.Store`` objects (a process
group takes either): the first talks to a server over a DEALER socket, the second is the server's
own process. Requests and replies are msgpack arrays ``[secret, id, op, *args]`` / ``[id, ok,
value]``, never pickle.
"""

from __future__ import annotations

import datetime
import secrets
import threading
import time

import msgpack
import torch.distributed as dist
import zmq

from ..wire.sockets import apply_curve_client, apply_curve_server, bind, connect, start_curve_auth

_POLL_MS = 50
_MAX_WAITERS = 256  # blocking requests (get, wait) answered at once; more are refused


class StoreError(RuntimeError):
    """A store request was refused (wrong secret, store full, value too large) or timed out."""


def new_secret() -> str:
    return secrets.token_hex(16)


def _as_bytes(v) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode()
    return bytes(v)


class _Table:
    """The store's keys under one lock, with the bounds and the waiters."""

    def __init__(self, max_keys: int, max_value_bytes: int, max_total_bytes: int):
        self.max_keys, self.max_value, self.max_total = max_keys, max_value_bytes, max_total_bytes
        self.data: dict[str, bytes] = {}
        self.total = 0
        self.cv = threading.Condition()
        self.refused = 0  # requests refused (secret, bounds, malformed): the learner reports them
        self.cancelled: set[str] = set()  # key prefixes whose waiters are answered at once (a failed group)

    def _put(self, key: str, value: bytes, bounded: bool = True) -> None:
        """Store ``key``; ``bounded`` False (the serving process's own writes, a few keys of its
        making) skips the bounds, so that members filling the store can never stop the learner."""
        old = self.data.get(key)
        total = self.total + len(value) + len(key) - (0 if old is None else len(old) + len(key))
        if bounded:
            if len(value) > self.max_value:
                raise StoreError(f"value of {len(value)} bytes for {key!r}; this store takes at most {self.max_value}")
            if old is None and len(self.data) >= self.max_keys:
                raise StoreError(f"store full ({self.max_keys} keys); refused {key!r}")
            if total > self.max_total:
                raise StoreError(f"store full ({self.max_total} bytes); refused {key!r}")
        self.data[key], self.total = value, total
        self.cv.notify_all()

    def set(self, key: str, value: bytes, bounded: bool = True) -> None:
        with self.cv:
            self._put(key, value, bounded)

    def add(self, key: str, n: int, bounded: bool = True) -> int:
        with self.cv:
            v = int(self.data.get(key, b"0")) + int(n)
            self._put(key, str(v).encode(), bounded)
            return v

    def compare_set(self, key: str, expected: bytes, desired: bytes, bounded: bool = True) -> bytes:
        with self.cv:
            cur = self.data.get(key)
            if (cur is None and expected == b"") or cur == expected:
                self._put(key, desired, bounded)
                return desired
            return expected if cur is None else cur

    def delete(self, key: str) -> bool:
        with self.cv:
            old = self.data.pop(key, None)
            if old is None:
                return False
            self.total -= len(old) + len(key)
            return True

    def drop(self, *prefixes: str) -> None:
        """Delete every key under ``prefixes`` (and forget their cancellation): a finished group."""
        with self.cv:
            for key in [k for k in self.data if k.startswith(prefixes)]:
                self.total -= len(self.data.pop(key)) + len(key)
            self.cancelled.difference_update(prefixes)

    def check(self, keys: list[str]) -> bool:
        with self.cv:
            return all(k in self.data for k in keys)

    def cancel(self, prefix: str) -> None:
        """Fail every present and future wait for keys under ``prefix`` (a group that will never
        form: its members stop waiting for a peer that did not come)."""
        with self.cv:
            self.cancelled.add(prefix)
            self.cv.notify_all()

    def wait(self, keys: list[str], timeout_s: float) -> bool:
        with self.cv:
            self.cv.wait_for(
                lambda: all(k in self.data for k in keys) or any(k.startswith(p) for k in keys for p in self.cancelled),
                timeout=timeout_s,
            )
            return all(k in self.data for k in keys)

    def get(self, key: str, timeout_s: float) -> bytes:
        if not self.wait([key], timeout_s):
            raise StoreError(f"key {key!r} not set within {timeout_s:g} s")
        with self.cv:
            return self.data[key]

    def values(self, keys: list[str]) -> list[bytes | None]:
        with self.cv:
            return [self.data.get(k) for k in keys]

    def wait_change(self, keys: list[str], seen: list, timeout_s: float) -> list[bytes | None]:
        """The values of ``keys`` once any differs from ``seen`` (or after ``timeout_s``)."""
        with self.cv:
            self.cv.wait_for(lambda: [self.data.get(k) for k in keys] != seen, timeout=timeout_s)
            return [self.data.get(k) for k in keys]


class StoreServer:
    """The store, served on ``tcp://host:port`` by a thread of its own (see the module docstring).

    ``local()`` is the serving process's own ``torch.distributed.Store`` view; ``address`` is
    ``host:port``; ``secret`` must accompany every remote request."""

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        secret: str | None = None,
        curve_dir: str | None = None,
        max_keys: int = 4096,
        max_value_bytes: int = 1 << 20,
        max_total_bytes: int = 64 << 20,
        max_wait_s: float = 600.0,
    ):
        self.secret = secret or new_secret()
        self.table = _Table(max_keys, max_value_bytes, max_total_bytes)
        self.max_wait_s = max_wait_s
        self.ctx = zmq.Context()
        self.auth = start_curve_auth(self.ctx, curve_dir) if curve_dir else None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_value_bytes + 64 * 1024)  # a bigger message drops its sender
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if curve_dir:
            apply_curve_server(self.sock, curve_dir)
        endpoint = bind(self.sock, host, port)  # refuses a non-loopback host without CURVE
        self.host, self.port = host, int(endpoint.rsplit(":", 1)[1])
        self.address = f"{host}:{self.port}"
        self._out: list[list[bytes]] = []  # replies from waiter threads, sent by the serving thread
        self._out_lock = threading.Lock()
        self._waiting = 0
        self._wake_send, self._wake_recv = self.ctx.socket(zmq.PAIR), self.ctx.socket(zmq.PAIR)
        wake = f"inproc://store-wake-{id(self)}"
        self._wake_recv.bind(wake)
        self._wake_send.connect(wake)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="rendezvous-store")
        self._thread.start()

    def local(self, timeout_s: float = 300.0) -> "LocalStore":
        return LocalStore(self.table, timeout_s)

    # -- serving --------------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(_POLL_MS))
            if self._wake_recv in ready:
                while self._wake_recv.poll(0):
                    self._wake_recv.recv()
                with self._out_lock:
                    out, self._out = self._out, []
                for frames in out:
                    self._send(frames)
            if self.sock in ready:
                for _ in range(256):
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)

    def _send(self, frames: list[bytes]) -> None:
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:  # the peer is gone or not reading: its loss
            pass

    def _reply(self, identity: bytes, rid, ok: bool, value, from_thread: bool = False) -> None:
        frames = [identity, msgpack.packb([rid, ok, value], use_bin_type=True)]
        if not from_thread:
            self._send(frames)
            return
        with self._out_lock:  # (the PAIR socket is this thread's alone while the lock is held)
            self._out.append(frames)
            try:
                self._wake_send.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        try:
            req = msgpack.unpackb(
                frames[-1],
                raw=False,
                strict_map_key=True,
                max_bin_len=self.table.max_value,
                max_str_len=self.table.max_value,
                max_array_len=1024,
                max_map_len=0,
            )
            if not isinstance(req, list) or len(req) < 3 or not isinstance(req[2], str):
                raise StoreError("expected [secret, id, op, *args]")
            secret, rid, op, args = req[0], req[1], req[2], req[3:]
        except Exception as e:  # noqa: BLE001 - malformed: refused, nothing kept
            self.table.refused += 1
            self._reply(identity, None, False, f"malformed store request ({type(e).__name__}: {e})"[:300])
            return
        if not isinstance(secret, str) or not secrets.compare_digest(secret, self.secret):
            self.table.refused += 1
            self._reply(identity, rid, False, "refused: wrong or missing store secret")
            return
        try:
            if op in ("get", "wait", "wait_change"):  # may block: answered from a thread of its own
                if self._waiting >= _MAX_WAITERS:
                    raise StoreError(f"{_MAX_WAITERS} requests already waiting")
                with self._out_lock:
                    self._waiting += 1
                threading.Thread(target=self._blocking, args=(identity, rid, op, args), daemon=True).start()
                return
            self._reply(identity, rid, True, self._op(op, args))
        except Exception as e:  # noqa: BLE001 - bounds, bad arguments: this request alone fails
            self.table.refused += 1
            self._reply(identity, rid, False, f"{type(e).__name__}: {e}"[:300])

    def _timeout(self, ms) -> float:
        return min(max(float(ms) / 1000.0, 0.0), self.max_wait_s)

    def _op(self, op: str, args: list):
        t = self.table
        if op == "set":
            t.set(str(args[0]), _as_bytes(args[1]))
            return None
        if op == "add":
            return t.add(str(args[0]), int(args[1]))
        if op == "compare_set":
            return t.compare_set(str(args[0]), _as_bytes(args[1]), _as_bytes(args[2]))
        if op == "delete":
            return t.delete(str(args[0]))
        if op == "check":
            return t.check([str(k) for k in args[0]])
        if op == "num_keys":
            return len(t.data)
        raise StoreError(f"unknown store operation {op!r}")

    def _blocking(self, identity: bytes, rid, op: str, args: list) -> None:
        try:
            t = self.table
            if op == "get":
                value = t.get(str(args[0]), self._timeout(args[1]))
            elif op == "wait":
                if not t.wait([str(k) for k in args[0]], self._timeout(args[1])):
                    raise StoreError(f"keys {list(args[0])[:4]} not set within {self._timeout(args[1]):g} s")
                value = None
            else:
                value = t.wait_change([str(k) for k in args[0]], list(args[1]), self._timeout(args[2]))
            self._reply(identity, rid, True, value, from_thread=True)
        except Exception as e:  # noqa: BLE001
            self._reply(identity, rid, False, f"{type(e).__name__}: {e}"[:300], from_thread=True)
        finally:
            with self._out_lock:
                self._waiting -= 1

    def close(self) -> None:
        if self._stop.is_set():
            return  # (closed already)
        self._stop.set()
        self._thread.join(timeout=5)
        with self._out_lock:
            self._wake_send.close(0)
        for s in (self._wake_recv, self.sock):
            s.close(0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


class LocalStore(dist.Store):
    """The serving process's ``torch.distributed.Store`` over the table itself. Its own writes are
    not bounded (the bounds are for members: a member that fills the store must not be able to make
    the learner's next announcement fail)."""

    def __init__(self, table: _Table, timeout_s: float):
        super().__init__()
        self._t, self._timeout_s = table, timeout_s

    def set(self, key, value):
        self._t.set(key, _as_bytes(value), bounded=False)

    def get(self, key):
        return self._t.get(key, self._timeout_s)

    def add(self, key, value):
        return self._t.add(key, value, bounded=False)

    def compare_set(self, key, expected, desired):
        return self._t.compare_set(key, _as_bytes(expected), _as_bytes(desired), bounded=False)

    def delete_key(self, key):
        return self._t.delete(key)

    def check(self, keys):
        return self._t.check(list(keys))

    def wait(self, keys, timeout=None):
        t = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else self._timeout_s
        if not self._t.wait(list(keys), t):
            raise StoreError(f"keys {list(keys)[:4]} not set within {t:g} s")

    def num_keys(self):
        return len(self._t.data)

    def wait_change(self, keys: list[str], seen: list, timeout_s: float) -> list:
        return self._t.wait_change(keys, seen, timeout_s)


class StoreClient(dist.Store):
    """A ``torch.distributed.Store`` backed by a :class:`StoreServer` at ``host:port``.

    ``curve_dir`` (and ``actor_id``) make the connection a CURVE client, as an actor's other
    sockets; every call is bounded by ``timeout_s`` and raises StoreError when refused."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: str,
        *,
        timeout_s: float = 300.0,
        curve_dir: str | None = None,
        actor_id: str | None = None,
    ):
        super().__init__()
        self._secret, self._timeout_s = secret, float(timeout_s)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        if curve_dir:
            apply_curve_client(self._sock, curve_dir, actor_id)
        h = host.strip().strip("[]")
        connect(self._sock, f"tcp://[{h}]:{port}" if ":" in h else f"tcp://{h}:{port}")
        self._lock = threading.Lock()
        self._next = 0

    def _call(self, op: str, *args, wait_s: float | None = None):
        bound = (wait_s or 0.0) + self._timeout_s
        deadline = time.monotonic() + bound
        with self._lock:
            self._next += 1
            rid = self._next
            self._sock.send(msgpack.packb([self._secret, rid, op, *args], use_bin_type=True))
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._sock.poll(int(min(left, 1.0) * 1000) + 1):
                    if left <= 0:
                        raise StoreError(f"no answer from the rendezvous store to {op!r} within {bound:.0f} s")
                    continue
                reply = msgpack.unpackb(self._sock.recv(), raw=False)
                if not isinstance(reply, list) or len(reply) != 3:
                    raise StoreError(f"malformed reply from the rendezvous store: {reply!r:.100}")
                if reply[0] != rid and reply[0] is not None:
                    continue  # a late answer to an earlier call that timed out
                if not reply[1]:
                    raise StoreError(f"rendezvous store refused {op!r}: {reply[2]}")
                return reply[2]

    def set(self, key, value):
        self._call("set", key, _as_bytes(value))

    def get(self, key):
        return self._call("get", key, int(self._timeout_s * 1000), wait_s=self._timeout_s)

    def add(self, key, value):
        return int(self._call("add", key, int(value)))

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, _as_bytes(expected), _as_bytes(desired))

    def delete_key(self, key):
        return bool(self._call("delete", key))

    def check(self, keys):
        return bool(self._call("check", list(keys)))

    def wait(self, keys, timeout=None):
        t = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else self._timeout_s
        self._call("wait", list(keys), int(t * 1000), wait_s=t)

    def num_keys(self):
        return int(self._call("num_keys"))

    def wait_change(self, keys: list[str], seen: list, timeout_s: float) -> list:
        """The values of ``keys`` as soon as one differs from ``seen`` (at most ``timeout_s``)."""
        return self._call("wait_change", list(keys), list(seen), int(timeout_s * 1000), wait_s=timeout_s)

    def close(self) -> None:
        with self._lock:
            if self._sock.closed:
                return
            self._sock.close(0)
        self._ctx.term()
