"""ZeroMQ socket helpers: loopback-only binding unless CURVE keys are set, CURVE key handling,
and sending / receiving wire messages (see ``asyncrl.wire.codec`` for the frame layout).

Security rule (DESIGN.md section 2): a process may bind a non-loopback address only on a socket
that is a CURVE server (``apply_curve_server`` before ``bind``). Keys live in one directory made by
``asyncrl keys --out DIR`` (:func:`make_curve_keys`)::

    DIR/server.key  DIR/server.key_secret  DIR/client.key  DIR/client.key_secret

The learner (binding side) uses the server pair, actors use the client pair plus ``server.key``.
CURVE alone encrypts and authenticates the server to clients; to also reject clients whose key is
not in DIR, run :func:`start_curve_auth` on the server's context.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

import zmq
import zmq.auth

from asyncrl.wire.codec import Message, WireError, decode

KEY_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")
_KEYS_HINT = ("make keys with `asyncrl keys --out DIR`, then set `wire.curve_dir=DIR` on the "
              "learner and on every actor (copy DIR to the actors' machines)")


class WireSecurityError(RuntimeError):
    """Refused for security reasons (non-loopback bind without CURVE, missing key files)."""


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
            f"refusing to bind {host!r}: only loopback addresses (127.0.0.1, ::1, localhost) may "
            f"be bound without ZeroMQ CURVE encryption; {_KEYS_HINT}")
    _key_path(curve_dir, "server.key_secret")


def make_curve_keys(out_dir: str) -> tuple[str, str, str, str]:
    """Create a server and a client CURVE key pair in ``out_dir``; returns the paths of
    (server public, server secret, client public, client secret). Secret files are mode 0600."""
    os.makedirs(out_dir, exist_ok=True)
    server_pub, server_sec = zmq.auth.create_certificates(out_dir, "server")
    client_pub, client_sec = zmq.auth.create_certificates(out_dir, "client")
    for path in (server_sec, client_sec):
        os.chmod(path, 0o600)
    return str(server_pub), str(server_sec), str(client_pub), str(client_sec)


def apply_curve_server(sock: zmq.Socket, curve_dir: str) -> None:
    """Make ``sock`` a CURVE server with the key pair in ``curve_dir`` (call before ``bind``)."""
    public, secret = zmq.auth.load_certificate(_key_path(curve_dir, "server.key_secret"))
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_server = True


def apply_curve_client(sock: zmq.Socket, curve_dir: str) -> None:
    """Make ``sock`` a CURVE client with the client pair and the server's public key in
    ``curve_dir`` (call before ``connect``)."""
    public, secret = zmq.auth.load_certificate(_key_path(curve_dir, "client.key_secret"))
    server_public, _ = zmq.auth.load_certificate(_key_path(curve_dir, "server.key"))
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_serverkey = server_public


def start_curve_auth(ctx: zmq.Context, curve_dir: str):
    """Start a ZAP authenticator on ``ctx`` that admits only CURVE clients whose public key is a
    ``*.key`` file in ``curve_dir``. Returns it; call ``.stop()`` before terminating ``ctx``."""
    from zmq.auth.thread import ThreadAuthenticator

    _key_path(curve_dir, "client.key")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(curve_dir))
    return auth


def _key_path(curve_dir: str, name: str) -> str:
    path = os.path.join(curve_dir, name)
    if not os.path.isfile(path):
        raise WireSecurityError(f"CURVE key file {path} not found; {_KEYS_HINT}")
    return path


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


def send_frames(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    """Send one multipart message without copying large frames (pyzmq copies small ones)."""
    sock.send_multipart(frames, flags=flags, copy=False)


def recv_message(sock: zmq.Socket, flags: int = 0) -> Message:
    """Receive and decode one message; the whole message is consumed even if decoding raises
    WireError, so the next call gets the next message."""
    return decode(sock.recv_multipart(flags=flags, copy=False))


def send_routed(sock: zmq.Socket, identity: Any, frames: list, flags: int = 0) -> None:
    """ROUTER side: send ``frames`` to the peer ``identity`` (from :func:`recv_routed`)."""
    sock.send_multipart([identity, *frames], flags=flags, copy=False)


def recv_routed(sock: zmq.Socket, flags: int = 0) -> tuple[bytes, Message]:
    """ROUTER side: ``(identity, message)`` from a DEALER peer. The message is consumed even if
    decoding raises WireError; the error then carries the sender in ``.identity``."""
    frames = sock.recv_multipart(flags=flags, copy=False)
    identity = frames[0].bytes
    try:
        return identity, decode(frames[1:])
    except WireError as e:
        e.identity = identity
        raise
