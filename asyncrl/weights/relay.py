"""One copy of the weights per node (``asyncrl relay``; started by the Ray scheduler, one per node).

With several actors on a node, each would take every version from the learner over the network:
``actors x bytes`` per version. A relay subscribes to the learner once, like an actor (``subscribe``
with the version it holds; the learner sends the next version only when the relay holds the last,
over ``sync.type: zmq`` frames), writes each version into this node's shared memory with the
``ipc`` transport (:class:`asyncrl.weights.ipc.IpcPublisher`: two slots, a seqlock header) and serves
the node's actors on a ROUTER bound to an ``ipc://`` socket in a private directory (mode 0700:
only this user's processes reach it): the same ``subscribe`` / ``weights`` exchange as
the learner's weights channel, so an actor started with ``--weights-address`` (and
``sync.type=ipc``) cannot tell the difference. The learner sends each version once per node.

The relay renews its subscription every ``wire.lease_s / 3`` seconds (the learner drops silent
subscribers) and answers an actor that asks again after ``RESEND_S``. It prints one line per
version relayed. Nothing here listens on a network address.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import tempfile
import time

import zmq

from ..wire.codec import decode, decode_weights, encode
from ..wire.messages import Subscribe
from ..wire.sockets import apply_curve_client, bind_ipc, connect, drain, private_dir, send_frames, send_routed
from .ipc import IpcPublisher

RESEND_S = 5.0


class WeightRelay:
    def __init__(self, learner_weights: str, relay_id: str, wire_cfg, sync_cfg, sock_dir: str | None = None):
        self.relay_id = relay_id
        self.lease_s = float(wire_cfg.lease_s)
        self.ctx = zmq.Context()
        self.up = self.ctx.socket(zmq.DEALER)
        self.up.setsockopt(zmq.LINGER, 0)
        # (a random part, as an actor's identity has: no one can take this subscription over)
        self.up.setsockopt(zmq.IDENTITY, f"relay-{relay_id}:{os.getpid()}:{secrets.token_hex(8)}".encode())
        if wire_cfg.curve_dir:
            apply_curve_client(self.up, wire_cfg.curve_dir, f"relay-{relay_id}")
        connect(self.up, learner_weights)
        self._own_dir = None if sock_dir else tempfile.mkdtemp(prefix="asyncrl-relay-")
        self.sock_dir = private_dir(sock_dir or self._own_dir)
        self.down = self.ctx.socket(zmq.ROUTER)
        self.down.setsockopt(zmq.LINGER, 0)
        self.down.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.address = bind_ipc(self.down, self.sock_dir, f"relay-{relay_id}"[:40])
        self.publisher = IpcPublisher(sync_cfg)
        self.version, self.frames = -1, None
        self.subscribers: dict[bytes, list] = {}  # identity -> [have, sent version, sent at]
        self.bytes_in = 0
        self.versions = 0
        self._asked_at = 0.0
        self.stopping = False

    def _ask(self) -> None:
        send_frames(self.up, encode("subscribe", Subscribe(actor_id=f"relay-{self.relay_id}", have=self.version)))
        self._asked_at = time.monotonic()

    def _on_weights(self, frames: list) -> None:
        size = sum(len(f) for f in frames)
        msg = decode(frames, kinds=("weights",))
        version, tensors = decode_weights(msg)
        self.frames = self.publisher.frames(tensors, version, msg.body.digest)  # (the learner's receipt)
        self.version = version
        self.bytes_in += size
        self.versions += 1
        self._ask()  # holds it: the learner may send the next one
        served = 0
        for ident in list(self.subscribers):
            served += self._offer(ident)
        print(
            f"[relay {self.relay_id}] version {version}: {size} bytes from the learner, offered to {served} "
            f"actor(s) on this node",
            flush=True,
        )

    def _offer(self, ident: bytes) -> int:
        have, sent, sent_at = self.subscribers[ident]
        if self.frames is None or have == self.version:
            return 0
        if sent == self.version and time.monotonic() - sent_at < RESEND_S:
            return 0
        try:
            send_routed(self.down, ident, self.frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # gone, or not reading: it asks again
            self.subscribers.pop(ident, None)
            return 0
        self.subscribers[ident][1:] = [self.version, time.monotonic()]
        return 1

    def _on_subscribe(self, frames: list) -> None:
        ident = bytes(frames[0])
        body = decode(frames[1:], kinds=("subscribe",)).body
        entry = self.subscribers.setdefault(ident, [-1, -1, 0.0])
        entry[0] = body.have
        self._offer(ident)

    def run(self, deadline_s: float | None = None) -> int:
        """Relay until stopped (SIGTERM/SIGINT or ``stopping``), or ``deadline_s`` seconds."""
        poller = zmq.Poller()
        poller.register(self.up, zmq.POLLIN)
        poller.register(self.down, zmq.POLLIN)
        started = time.monotonic()
        self._ask()
        while not self.stopping and (deadline_s is None or time.monotonic() - started < deadline_s):
            events = dict(poller.poll(200))
            if self.up in events:
                drain(self.up, self._on_weights, limit=8, on_error=self._report)
            if self.down in events:
                drain(self.down, self._on_subscribe, limit=256, on_error=self._report)
            if time.monotonic() - self._asked_at > self.lease_s / 3:
                self._ask()  # renews the learner's lease on this subscription
        return 0

    def _report(self, error: Exception) -> None:
        print(f"[relay {self.relay_id}] dropped a message: {error}", flush=True)

    def close(self) -> None:
        self.publisher.close()
        self.up.close(0)
        self.down.close(0)
        self.ctx.term()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)


def main(cfg, learner_weights: str, relay_id: str, sock_dir: str | None = None) -> int:
    """``asyncrl relay``: prints ``relay listening on ADDRESS`` once bound, then relays until stopped."""
    if cfg.sync.type != "zmq":
        print(
            f"asyncrl relay: the learner must publish with sync.type zmq (the relay takes its frames), got "
            f"{cfg.sync.type!r}",
            file=sys.stderr,
        )
        return 2
    relay = WeightRelay(learner_weights, relay_id, cfg.wire, cfg.sync, sock_dir)

    def _stop(*_):
        relay.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"relay listening on {relay.address}", flush=True)
    try:
        return relay.run()
    finally:
        print(f"[relay {relay_id}] stopping after {relay.versions} version(s), {relay.bytes_in} bytes in", flush=True)
        relay.close()
