"""ZeroMQ socket helpers: loopback-only binding unless CURVE keys are set, CURVE key bundles, and
the one receive loop every process uses (see ``asyncrl.wire.codec`` for the frame layout).

Security rule (docs/design/events.md, "Channels and keys"): a process may bind a non-loopback address only
on a socket that is a CURVE server (``apply_curve_server`` before ``bind``). ``asyncrl keys --out
DIR`` (:func:`make_curve_keys`) makes one bundle per party, so that no machine holds a secret it
does not need::

    DIR/server/server.key  DIR/server/server.key_secret      the learner's pair
    DIR/server/authorized/actor-<name>.key                    public keys the learner admits
    DIR/actor-<name>/actor.key  DIR/actor-<name>/actor.key_secret  one actor's pair
    DIR/actor-<name>/server.key                               the learner's public key

``wire.curve_dir`` names a bundle (``DIR/server`` on the learner, ``DIR/actor-<name>`` on an actor)
or DIR itself, in which case the learner takes ``DIR/server`` and actor ``<id>`` takes ``DIR/<id>``
(``asyncrl run`` on one machine: actor ids are ``actor-0``, ``actor-1``, ...). The learner's
authenticator (:func:`start_curve_auth`) admits only the public keys in ``server/authorized`` and
reports every other key it refuses.

Who may connect (docs/design/security.md): loopback is not a trust boundary (every local user reaches
127.0.0.1), so no learner socket listens on plain TCP. Without CURVE keys the learner binds
``ipc://`` sockets in a private directory (:func:`private_dir`: owned by this user, mode 0700), so the
operating system refuses every other user's ``connect``; with keys it binds TCP (loopback included)
as a CURVE server. Under CURVE every authorised key is bound to the name of its file in
``authorized/`` (``actor-<name>.key`` -> ``actor-<name>``), and :meth:`_AuthorizedKeys.name_of` lets
the learner refuse a message whose actor id is not its key's.
"""

from __future__ import annotations

import collections
import hashlib
import ipaddress
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import zmq
import zmq.auth

from asyncrl.wire.codec import Message, WireError, decode

_KEYS_HINT = (
    "make keys with `asyncrl keys --out DIR`, then set `wire.curve_dir=DIR/server` on the "
    "learner and `wire.curve_dir=DIR/actor-<name>` on each actor (copy only that actor's "
    "directory to its machine)"
)


class WireSecurityError(RuntimeError):
    """Refused for security reasons (non-loopback bind without CURVE, missing key files, a socket
    directory another user could reach)."""


# --- private ipc sockets -----------------------------------------------------------------------

_IPC_PATH_MAX = 100  # sockaddr_un holds 107 bytes of path; the longest socket name is added to the dir


def private_dir(path: str | Path) -> Path:
    """``path`` as a directory that only this user can enter: created with mode 0700 (parents as
    needed), or, when it exists, checked to be a real directory (not a link) owned by this user,
    its mode tightened to 0700. WireSecurityError when another user owns it."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise WireSecurityError(f"cannot make the private socket directory {path}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise WireSecurityError(f"{path} should be a private directory of sockets but is a link or a file; remove it")
    if st.st_uid != os.geteuid():
        raise WireSecurityError(
            f"{path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): another "
            f"user could reach sockets made there; remove it or pick another run directory"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def socket_dir(run_dir: str | Path) -> Path:
    """Where a run's ipc sockets live: ``<run_dir>/sock`` (mode 0700), or, when that path is too
    long for a socket address, ``<runtime dir>/asyncrl-<uid>/<hash of run_dir>`` (the runtime dir is
    ``$XDG_RUNTIME_DIR`` or the temp directory), the same path again on every start of the run."""
    run_dir = Path(run_dir).resolve()
    near = run_dir / "sock"
    if len(str(near)) <= _IPC_PATH_MAX - 12:
        return private_dir(near)
    runtime = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    base = private_dir(Path(runtime) / f"asyncrl-{os.geteuid()}")
    return private_dir(base / hashlib.sha256(str(run_dir).encode()).hexdigest()[:16])


def bind_ipc(sock: zmq.Socket, directory: Path, name: str) -> str:
    """Bind ``sock`` to ``ipc://<directory>/<name>`` (``directory`` made by :func:`private_dir`);
    returns the address. A socket file left by a process that is gone is replaced."""
    address = f"ipc://{Path(directory) / name}"
    if len(address) - len("ipc://") > _IPC_PATH_MAX + 6:
        raise WireSecurityError(f"the socket path {address[6:]} is too long for a unix socket address")
    sock.bind(address)
    return address


def is_ipc(address: str) -> bool:
    return address.startswith("ipc://")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 (also bracketed or IPv4-mapped) and ``localhost``."""
    h = host.strip().strip("[]").lower()
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def check_bind_host(host: str, curve_dir: str | None) -> None:
    """Raise WireSecurityError unless ``host`` is loopback or ``curve_dir`` has the server keys."""
    if is_loopback(host):
        return
    if not curve_dir:
        raise WireSecurityError(
            f"refusing to bind {host!r} (wire.host): only loopback addresses (127.0.0.1, ::1, "
            f"localhost) may be bound without ZeroMQ CURVE encryption; {_KEYS_HINT}"
        )
    server_bundle(curve_dir)


PORT_FIELDS = ("episodes_port", "control_port", "weights_port", "events_port")


def check_wire(wire_cfg) -> None:
    """The learner's socket rules for a ``wire`` config, checked before anything is bound: a
    non-loopback host needs CURVE keys (:func:`check_bind_host`), and so does any TCP port: without
    keys the learner binds private ipc sockets, which have no ports."""
    check_bind_host(wire_cfg.host, wire_cfg.curve_dir)
    if wire_cfg.curve_dir:
        return
    ports = [f"wire.{f}={getattr(wire_cfg, f)}" for f in PORT_FIELDS if getattr(wire_cfg, f)]
    if ports:
        raise WireSecurityError(
            f"{', '.join(ports)} asks for TCP, and the learner listens on TCP only with CURVE keys (loopback is "
            f"reachable by every local user); leave the ports at 0 for private ipc sockets on this host, or "
            f"{_KEYS_HINT}"
        )


# --- CURVE key bundles -------------------------------------------------------------------------


def make_curve_keys(out_dir: str, names: list[str]) -> dict[str, str]:
    """Create (or complete) the key bundles in ``out_dir`` for actors ``names``: the server
    bundle once (an existing server pair is kept, so earlier actor bundles stay valid), then each
    missing ``actor-<name>`` bundle (``relay-<x>`` for a name ``relay-<x>``: a weights relay's own
    key), authorised in ``server/authorized``. Secret files are mode 0600. Returns
    ``{"server": dir, "actor-<name>": dir, ...}``."""
    root = Path(out_dir)
    _refuse_old_layout(root)
    server = root / "server"
    if not (server / "server.key_secret").is_file():
        server.mkdir(parents=True, exist_ok=True)
        _, secret = zmq.auth.create_certificates(str(server), "server")
        os.chmod(secret, 0o600)
    (server / "authorized").mkdir(exist_ok=True)
    out = {"server": str(server)}
    for name in names:
        name = name if name.startswith("relay-") else f"actor-{name}"
        bundle = root / name
        if not (bundle / "actor.key_secret").is_file():
            bundle.mkdir(parents=True, exist_ok=True)
            public, secret = zmq.auth.create_certificates(str(bundle), "actor")
            os.chmod(secret, 0o600)
            shutil.copyfile(server / "server.key", bundle / "server.key")
        shutil.copyfile(bundle / "actor.key", server / "authorized" / f"{name}.key")
        out[name] = str(bundle)
    return out


def server_bundle(curve_dir: str) -> Path:
    """The learner's bundle: ``curve_dir`` itself or ``curve_dir/server`` (WireSecurityError
    naming what is missing otherwise)."""
    root = Path(curve_dir)
    _refuse_old_layout(root)
    for d in (root, root / "server"):
        if (d / "server.key_secret").is_file():
            if not (d / "authorized").is_dir():
                raise WireSecurityError(
                    f"CURVE server bundle {d} has no authorized/ directory of actor public keys; {_KEYS_HINT}"
                )
            return d
    raise WireSecurityError(
        f"no CURVE server keys in {root} (expected {root}/server.key_secret or "
        f"{root}/server/server.key_secret); {_KEYS_HINT}"
    )


def actor_bundle(curve_dir: str, actor_id: str | None = None) -> Path:
    """An actor's bundle: ``curve_dir`` itself, ``curve_dir/<actor_id>`` or
    ``curve_dir/actor-<actor_id>``; with no ``actor_id`` (a viewer such as ``asyncrl ui``) the
    first actor bundle under ``curve_dir``."""
    root = Path(curve_dir)
    _refuse_old_layout(root)
    candidates = [root]
    if actor_id:
        candidates += [root / actor_id, root / f"actor-{actor_id}"]
    elif root.is_dir():
        candidates += sorted(p for p in root.glob("actor-*") if p.is_dir())
    for d in candidates:
        if (d / "actor.key_secret").is_file() and (d / "server.key").is_file():
            if (d / "server.key_secret").exists() or (d / "server" / "server.key_secret").exists():
                warnings.warn(
                    f"the actor's CURVE bundle {d} holds the learner's secret key (server.key_secret): "
                    f"whoever reads this machine can impersonate the learner; copy only "
                    f"DIR/actor-<name> made by `asyncrl keys` to an actor's machine",
                    stacklevel=2,
                )
            return d
    raise WireSecurityError(
        f"no CURVE actor keys for {actor_id or 'this client'} in {root} "
        f"(expected actor.key_secret and server.key there or in "
        f"{root}/actor-<name>); {_KEYS_HINT}"
    )


def _refuse_old_layout(root: Path) -> None:
    if (root / "client.key_secret").is_file():
        raise WireSecurityError(
            f"{root} has the old single-directory CURVE layout (the server's secret key next to "
            f"the client keys, copied to every actor); regenerate with `asyncrl keys --out NEWDIR`, "
            f"which makes NEWDIR/server for the learner and NEWDIR/actor-<name> for each actor"
        )


def apply_curve_server(sock: zmq.Socket, curve_dir: str) -> None:
    """Make ``sock`` a CURVE server with the learner's pair (call before ``bind``)."""
    public, secret = zmq.auth.load_certificate(str(server_bundle(curve_dir) / "server.key_secret"))
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_server = True


def apply_curve_client(sock: zmq.Socket, curve_dir: str, actor_id: str | None = None) -> None:
    """Make ``sock`` a CURVE client with an actor bundle's pair and the learner's public key
    (call before ``connect``)."""
    bundle = actor_bundle(curve_dir, actor_id)
    public, secret = zmq.auth.load_certificate(str(bundle / "actor.key_secret"))
    server_public, _ = zmq.auth.load_certificate(str(bundle / "server.key"))
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_serverkey = server_public


class _AuthorizedKeys:
    """The authenticator's CURVE callback: admits the public keys in ``authorized/`` and keeps
    the refused ones (z85 text, time) for the learner to report. The directory is read again
    whenever it changes (at most every ``_RELOAD_S``), so a key deleted while the learner runs is
    refused at its next handshake, and :meth:`admits` lets the learner drop the messages of a
    connection made before the revocation."""

    _RELOAD_S = 0.2

    def __init__(self, directory: Path):
        self.directory = directory
        self.denied: collections.deque[tuple[str, float]] = collections.deque(maxlen=1000)
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._checked = 0.0
        self.keys: set[bytes] = set()
        self.names: dict[bytes, str] = {}  # key -> the name of its file (actor-<name>.key -> actor-<name>)
        self._reload(force=True)

    def _reload(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < self._RELOAD_S:
            return
        self._checked = now
        try:
            st = self.directory.stat()
            files = sorted(self.directory.glob("*.key"))
            stamp = (st.st_mtime_ns, st.st_ino, tuple((p.name, p.stat().st_mtime_ns) for p in files))
        except OSError:
            stamp, files = None, []
        if stamp == self._stamp and not force:
            return
        names: dict[bytes, str] = {}
        for p in files:
            try:
                key = zmq.auth.load_certificate(str(p))[0]
            except (OSError, ValueError):  # a half-written or foreign file admits nobody
                continue
            names[key] = p.stem if key not in names else names[key]  # (one key in two files: the first name)
        self.keys, self.names, self._stamp = set(names), names, stamp

    def admits(self, z85_key: str | bytes) -> bool:
        """Whether the key (z85, as ZeroMQ's User-Id of a CURVE connection) is authorised now."""
        with self._lock:
            self._reload()
            key = z85_key.encode("ascii") if isinstance(z85_key, str) else z85_key
            return key in self.keys

    def name_of(self, z85_key: str | bytes) -> str | None:
        """The name an authorised key is bound to (its file's name without ``.key``), or None."""
        with self._lock:
            self._reload()
            key = z85_key.encode("ascii") if isinstance(z85_key, str) else z85_key
            return self.names.get(key)

    def callback(self, domain: str, client_key: bytes) -> bool:
        with self._lock:
            self._reload()
            if client_key in self.keys:
                return True
            self.denied.append((client_key.decode("ascii", "replace"), time.time()))
        return False

    def take_denied(self) -> list[tuple[str, float]]:
        with self._lock:
            out = list(self.denied)
            self.denied.clear()
        return out


def start_curve_auth(ctx: zmq.Context, curve_dir: str):
    """Start a ZAP authenticator on ``ctx`` that admits only CURVE clients whose public key is in
    the server bundle's ``authorized/`` directory. Returns it (``.keys.take_denied()`` lists the
    refused client keys since the last call); call ``.stop()`` before terminating ``ctx``."""
    from zmq.auth.thread import ThreadAuthenticator

    keys = _AuthorizedKeys(server_bundle(curve_dir) / "authorized")
    deadline = time.monotonic() + 10.0
    while True:
        auth = ThreadAuthenticator(ctx)
        try:
            auth.start()
            break
        except zmq.ZMQError as e:
            # A context has one ZAP endpoint. Closing a socket is asynchronous in libzmq, so the
            # endpoint of an authenticator stopped a moment ago (a server closed and reopened in one
            # process) stays bound until its socket is reaped: wait for that, within a bound.
            if auth.zap_socket is not None:
                auth.zap_socket.close(0)
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise WireSecurityError(
                    "could not start the CURVE authenticator: this process's ZeroMQ context already has "
                    "one (inproc://zeromq.zap.01 is bound) and it did not go within 10 s; close the other "
                    "server on this context first"
                ) from e
            time.sleep(0.05)
    auth.configure_curve_callback(domain="*", credentials_provider=keys)
    auth.keys = keys
    return auth


def key_allows(key_name: str | None, actor_id: str) -> bool:
    """Whether a CURVE key bound to ``key_name`` (``actor-<name>``, ``relay-<name>``) may speak as
    ``actor_id``: its own name, or ``<name>`` for ``actor-<name>`` (``--actor-id NAME``)."""
    if not key_name:
        return False
    return actor_id == key_name or (key_name.startswith("actor-") and actor_id == key_name[len("actor-") :])


def refused_actor_line(event: dict | None) -> str | None:
    """One line for an actor whose CURVE handshake the learner refused (a socket monitor's
    ``EVENT_HANDSHAKE_FAILED_AUTH``; ``value`` is the ZAP status), else None."""
    if not event or event.get("event") != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return None
    return (
        f"the learner at {event.get('endpoint', b'').decode(errors='replace') or '?'} refused this actor's "
        f"CURVE key (ZAP status {event.get('value')}): its public key is not (or no longer) in the "
        f"learner's authorized/ directory; ask its operator to add it (`asyncrl keys --out DIR --names ...`)"
    )


def _tcp_host(sock: zmq.Socket, host: str) -> str:
    """``host`` as written in a tcp:// endpoint; enables IPv6 on ``sock`` for IPv6 hosts."""
    h = host.strip().strip("[]")
    if ":" in h:
        sock.ipv6 = True
        return f"[{h}]"
    return h


def bind(sock: zmq.Socket, host: str, port: int) -> str:
    """Bind ``sock`` to ``tcp://host:port`` (port 0: a free port) and return the bound address.

    A non-loopback host is refused (WireSecurityError) unless ``sock`` is already a CURVE server.
    """
    if not is_loopback(host) and not sock.curve_server:
        check_bind_host(host, None)
    h = _tcp_host(sock, host)
    if port == 0:
        port = sock.bind_to_random_port(f"tcp://{h}")
    else:
        sock.bind(f"tcp://{h}:{port}")
    return f"tcp://{h}:{port}"


def connect(sock: zmq.Socket, address: str) -> str:
    """Connect ``sock`` to a ``tcp://host:port`` address (enabling IPv6 if needed); returns it."""
    if address.startswith("tcp://["):
        sock.ipv6 = True
    sock.connect(address)
    return address


# --- sending and receiving ---------------------------------------------------------------------


def send_frames(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    """Send one multipart message without copying large frames (pyzmq copies small ones)."""
    sock.send_multipart(frames, flags=flags, copy=False)


def recv_frames(sock: zmq.Socket, flags: int = 0, max_parts: int | None = None) -> list:
    """One whole multipart message as ``zmq.Frame`` objects (no copy). Parts beyond
    ``max_parts`` are received and dropped, and then WireError (``too_large``) is raised, so a
    message of a million tiny parts costs no memory and the next call gets the next message."""
    first = sock.recv(flags, copy=False)
    frames, extra, more = [first], 0, first.more
    while more:
        part = sock.recv(copy=False)  # the rest of a multipart message has arrived with its first
        more = part.more
        if max_parts is None or len(frames) < max_parts:
            frames.append(part)
        else:
            extra += 1
    if extra:
        raise WireError(
            f"message of {len(frames) + extra} frames; this channel takes at most {max_parts}", reason="too_large"
        )
    return frames


def drain(
    sock: zmq.Socket,
    handle: Callable[[list], Any],
    limit: int,
    on_error: Callable[[Exception], Any] | None = None,
    max_parts: int | None = None,
) -> int:
    """The one receive loop: hand each message already waiting on ``sock`` (at most ``limit``,
    so that a flood cannot hold the caller) to ``handle(frames)``; returns how many were taken.

    With ``on_error``, a message that cannot be received whole (too many parts) or whose
    ``handle`` raises goes to ``on_error(exception)`` and is lost alone; the loop goes on. OSError
    is never caught here: a full disk or a permission error is the process's problem, not the
    message's (handlers catch the OSErrors a message can cause, such as a missing file it names).
    """
    taken = 0
    while taken < limit:
        try:
            frames = recv_frames(sock, zmq.NOBLOCK, max_parts)
        except zmq.Again:
            break
        except WireError as e:
            taken += 1
            if on_error is None:
                raise
            on_error(e)
            continue
        taken += 1
        try:
            handle(frames)
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure rejects this message only
            if on_error is None:
                raise
            on_error(e)
    return taken


def recv_message(sock: zmq.Socket, flags: int = 0) -> Message:
    """Receive and decode one message; the whole message is consumed even if decoding raises
    WireError, so the next call gets the next message."""
    return decode(recv_frames(sock, flags))


def send_routed(sock: zmq.Socket, identity: Any, frames: list, flags: int = 0) -> None:
    """ROUTER side: send ``frames`` to the peer ``identity`` (from :func:`recv_routed`)."""
    sock.send_multipart([identity, *frames], flags=flags, copy=False)


def recv_routed(sock: zmq.Socket, flags: int = 0) -> tuple[bytes, Message]:
    """ROUTER side: ``(identity, message)`` from a DEALER peer. The message is consumed even if
    decoding raises WireError; the error then carries the sender in ``.identity``."""
    frames = recv_frames(sock, flags)
    identity = frames[0].bytes
    try:
        return identity, decode(frames[1:])
    except WireError as e:
        e.identity = identity
        raise
