"""The weights channel's subscribers (:class:`WeightSubscribers`): each actor's weights socket
says which version it holds (``subscribe``, ``have``); it is sent the newest version, and the next
one only once it says it has the last one, so at most one version per subscriber is ever queued
(plus a send high-water mark of 2 as a backstop). How long publish -> applied took is kept per
subscriber (``applied``), for the learner's ``sync/*`` metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import zmq

from ...wire.messages import Subscribe
from ...wire.sockets import send_routed

WEIGHTS_HWM = 2  # weights messages queued per subscriber, at most (one is the rule, see _send)
_WEIGHTS_RESEND_S = 5.0  # a subscriber asking again for a version already sent gets it again after this


@dataclass
class Subscriber:
    actor_id: str
    have: int = -1  # the version it says it holds
    sent: int = -1  # the newest version sent to it
    sent_at: float = 0.0
    last_seen: float = field(default_factory=time.monotonic)


class WeightSubscribers:
    """The newest published version and who holds what, over the weights ROUTER socket."""

    def __init__(self, socket: zmq.Socket, lease_s: float):
        self.socket, self.lease_s = socket, lease_s
        self.states: dict[bytes, Subscriber] = {}
        self._frames: list | None = None
        self._nbytes = 0
        self.version = -1
        self.bytes_sent = 0  # every weights message sent to any subscriber, all frames
        self._published_at: dict[int, float] = {}  # version -> unix time published (the last 64)
        self.applied: list[tuple[str, int, float]] = []  # (actor, version, seconds publish -> applied)

    def __len__(self) -> int:
        return len(self.states)

    def values(self):
        return self.states.values()

    def publish(self, frames: list, version: int) -> None:
        """Make ``version`` the current weights: ``frames`` is its ``weights`` message (made by the
        sync transport, ``asyncrl.weights``; zero-copy frames must not change until sent). Sent at once
        to every subscriber that holds all it was sent; the others get the newest version when they
        say they have the previous one."""
        self._frames = frames
        self._nbytes = sum(memoryview(f).nbytes for f in frames)  # (counted once per version, sent many times)
        self.version = version
        self._published_at[version] = time.time()
        for old in sorted(self._published_at)[:-64]:
            del self._published_at[old]
        for ident, s in list(self.states.items()):
            if s.sent <= s.have:
                self._send(ident, s)

    def on_subscribe(self, identity: bytes, body: Subscribe) -> None:
        s = self.states.get(identity)
        if s is None:
            s = self.states[identity] = Subscriber(body.actor_id)
        published = self._published_at.get(body.have)
        if body.applied_at is not None and body.have > s.have and published is not None:
            self.applied.append((s.actor_id, body.have, max(body.applied_at - published, 0.0)))
        s.have, s.last_seen = body.have, time.monotonic()
        if self._frames is None or self.version <= s.have:
            return
        if s.sent < self.version or time.monotonic() - s.sent_at > _WEIGHTS_RESEND_S:
            self._send(identity, s)

    def _send(self, identity: bytes, s: Subscriber) -> None:
        try:
            send_routed(self.socket, identity, self._frames, flags=zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full: it is not reading; it asks again when it does
            return
        except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone
            self.states.pop(identity, None)
            return
        s.sent, s.sent_at = self.version, time.monotonic()
        self.bytes_sent += self._nbytes

    def expire(self, live_actor_ids: set[str]) -> None:
        """Forget subscribers silent past the lease whose actor is gone too."""
        now = time.monotonic()
        for ident in [
            i for i, s in self.states.items() if now - s.last_seen > self.lease_s and s.actor_id not in live_actor_ids
        ]:
            del self.states[ident]
