"""Another local user, for tests/e2e/test_local_users.py: started as the test's user, it loads what it
needs, drops to uid/gid 65534 (``nobody``: on a shared machine, anyone else) and then attacks a run
as such a user would, printing one JSON line of what it got.

    python -m tests.support.other_user ATTACK SECONDS ARG...

``subscribe ADDRESS`` (the weights channel), ``hello ADDRESS`` (control), ``push ADDRESS``
(episodes: a valid episode of actor ``intruder``), ``events ADDRESS`` (the event stream): each
connects, sends, and reports what arrived within SECONDS. ``read PATH...``: which files it can read.
``bind DIRECTORY``: whether it can bind a socket there (a relay's address, to serve its own
weights). ``mkdir PATH``: a directory of its own, mode 0777. ``uds PATH``: whether it can connect to a Unix socket. ``curve ADDRESS SERVER_KEY_FILE``: ``hello`` as a CURVE client with a key of its own.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import numpy as np
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from asyncrl.types import Episode, Trajectory
from asyncrl.wire.codec import decode, encode, encode_episode
from asyncrl.wire.messages import Hello, Subscribe

NOBODY = 65534


def drop_privileges() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    assert os.getuid() == NOBODY and os.geteuid() == NOBODY


def _episode() -> list:
    mask = np.r_[np.zeros(3), np.ones(3)]
    t = Trajectory(token_ids=np.full(6, 5), loss_mask=mask, behavior_logprobs=-0.5 * mask, policy_version=0, reward=1.0)
    return encode_episode(Episode(trajectories=[t], actor_id="intruder"))


def _talk(ctx, kind: int, address: str, frames: list | None, seconds: float, setup=None) -> dict:
    """Connect, send ``frames``, and collect what arrives for ``seconds``; whether a connection was
    ever made, its ZMTP handshake done (a socket monitor), the kinds of the messages received."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.DEALER:
        sock.setsockopt(zmq.IDENTITY, f"intruder:{os.getpid()}".encode())
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if setup is not None:
        setup(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(address)
    connected, kinds, errors = False, [], []
    if frames is not None:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            errors.append("not connected: nothing sent")
    deadline = time.time() + seconds
    while time.time() < deadline:
        while monitor.poll(0):
            if recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                connected = True
        if kind != zmq.PUSH and sock.poll(100):
            got = sock.recv_multipart()
            try:
                kinds.append(decode(got).kind)
            except Exception as e:  # noqa: BLE001 - whatever arrived counts
                kinds.append(f"undecodable: {type(e).__name__}")
        elif kind == zmq.PUSH:
            time.sleep(0.1)
    sock.disable_monitor()
    monitor.close(0)
    sock.close(0)
    return {"connected": connected, "received": kinds, "errors": errors}


def main(argv: list[str]) -> dict:
    attack, seconds, args = argv[0], float(argv[1]), argv[2:]
    ctx = zmq.Context()
    curve = None
    if attack == "curve":
        server_public, _ = zmq.auth.load_certificate(args[1])
        curve = (zmq.curve_keypair(), server_public)
    drop_privileges()
    out: dict = {"uid": os.getuid()}
    if attack == "subscribe":
        out.update(
            _talk(ctx, zmq.DEALER, args[0], encode("subscribe", Subscribe(actor_id="intruder", have=-1)), seconds)
        )
    elif attack == "hello":
        out.update(_talk(ctx, zmq.DEALER, args[0], encode("hello", Hello(actor_id="intruder", capacity=8)), seconds))
    elif attack == "push":
        out.update(_talk(ctx, zmq.PUSH, args[0], _episode(), seconds))
    elif attack == "events":
        out.update(_talk(ctx, zmq.SUB, args[0], None, seconds))
    elif attack == "curve":
        (public, secret), server_public = curve

        def keys(sock):
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public

        out.update(
            _talk(ctx, zmq.DEALER, args[0], encode("hello", Hello(actor_id="actor-0", capacity=8)), seconds, setup=keys)
        )
    elif attack == "read":
        out["readable"] = []
        for path in args:
            try:
                with open(path, "rb") as f:
                    f.read(1)
                out["readable"].append(path)
            except OSError:
                pass
    elif attack == "uds":  # a Unix socket of another user's (the rollout endpoint's, for its agents)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(args[0])
            out["connected"] = True
        except OSError as e:
            out["connected"], out["error"] = False, str(e)
        sock.close()
    elif attack == "mkdir":  # a directory of its own, open to all, where a run of someone else's may go
        os.mkdir(args[0])
        os.chmod(args[0], 0o777)
        out["made"] = True
    elif attack == "bind":
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(f"ipc://{os.path.join(args[0], 'intruder')}")
            out["bound"] = True
        except zmq.ZMQError as e:
            out["bound"], out["error"] = False, str(e)
        sock.close(0)
    else:
        raise SystemExit(f"unknown attack {attack!r}")
    ctx.term()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
