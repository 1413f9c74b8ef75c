"""The actors a learner knows, and the work they hold (:class:`ActorTable`).

- **Admission.** A ``hello`` (or a ``status`` from an actor the table does not know: dropped by its
  lease, or this learner is new) admits an actor, with a ``welcome``. A full table
  (``wire.max_actors``) refuses a newcomer, but an actor that delivered before comes back: the
  stranger admitted first makes room for it (told to stop).
- **Leases.** An actor silent for ``wire.lease_s`` is dropped with its outstanding credits.
- **Credits.** Granted one at a time, round-robin over the actors below their capacity, starting
  after the actor served first last time; strangers (no valid episode yet) share a cap. An actor keeps
  its credits while it makes progress: a valid episode delivered, or tokens generated (its heartbeat's
  ``tokens`` advancing); one that does neither for ``wire.credit_timeout_s`` loses them and gets one
  at a time until it delivers (a hog), its clock restarting with each such credit.

Messages go out through ``send(identity, body)``: the table owns no socket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ...wire.codec import WireError
from ...wire.messages import Credit, Status, Stop, Welcome


@dataclass
class ActorState:
    identity: bytes
    actor_id: str
    capacity: int
    outstanding: int = 0
    weights_version: int = -1
    status: Status | None = None
    last_seen: float = field(default_factory=time.monotonic)
    withheld_sent: set | None = None  # replay: the skip set as last sent to this actor (None: never)
    admitted_at: float = field(default_factory=time.monotonic)
    progress_at: float = field(default_factory=time.monotonic)  # its last valid episode or generated token, or
    # the grant that gave it work
    tokens: int = -1  # the engine's token count its last status reported (-1: no status yet)
    settled: bool = True  # all it was given came back as valid episodes (the next grant starts its clock anew)
    delivered: int = 0  # episodes received from it
    hog: bool = False  # its credits were taken back for want of progress: one at a time until it delivers


def credit_timeout_s(wire_cfg) -> float:
    """``wire.credit_timeout_s``, or three leases when unset."""
    return wire_cfg.credit_timeout_s or 3 * wire_cfg.lease_s


class ActorTable:
    """The admitted actors by routing identity, their leases and their credits."""

    def __init__(self, wire_cfg, send: Callable[[bytes, object], None], welcome: Callable[[], Welcome]):
        self.send, self.welcome = send, welcome
        self.lease_s = wire_cfg.lease_s
        self.credit_timeout_s = credit_timeout_s(wire_cfg)
        self.max_capacity, self.max_actors = wire_cfg.max_capacity, wire_cfg.max_actors
        self.states: dict[bytes, ActorState] = {}
        self.reclaimed: list[tuple[ActorState, int]] = []  # credits taken back since the last call
        self.evicted: list[ActorState] = []  # strangers dropped for a returning actor since the last call
        self._hogs: dict[str, None] = {}  # actor ids whose credits were taken back (kept across hellos)
        self._known: dict[str, None] = {}  # actor ids that delivered an episode (never refused for a stranger)
        self._credit_cursor = 0  # which actor is served first by the next grant

    def __len__(self) -> int:
        return len(self.states)

    def values(self):
        return self.states.values()

    @property
    def in_flight(self) -> int:
        return sum(a.outstanding for a in self.states.values())

    def admit(self, identity: bytes, actor_id: str, capacity: int) -> ActorState:
        """Admit (or admit again) an actor, with a ``welcome``; raises WireError when the table is full."""
        if identity not in self.states and len(self.states) >= self.max_actors:
            strangers = [a for a in self.states.values() if a.delivered == 0]
            if actor_id not in self._known or not strangers:
                raise WireError(
                    f"actor table full ({self.max_actors} actors, wire.max_actors); refused {actor_id!r}",
                    reason="actors_full",
                )
            # an actor that delivered before comes back: the stranger admitted first makes room
            stranger = min(strangers, key=lambda a: a.admitted_at)
            del self.states[stranger.identity]
            self.evicted.append(stranger)
            self.send(
                stranger.identity,
                Stop(reason=f"the actor table is full and {actor_id!r}, which delivered episodes before, came back"),
            )
        state = ActorState(identity, actor_id, min(capacity, self.max_capacity), hog=actor_id in self._hogs)
        self.states[identity] = state
        self.send(identity, self.welcome())
        return state

    def renew(self, status: Status) -> ActorState:
        """A heartbeat: renew the actor's lease (admitting it again if the table does not know it)."""
        main = status.identity.encode()
        state = self.states.get(main) or self.admit(main, status.actor_id, status.capacity)
        state.last_seen = time.monotonic()
        state.status = status
        state.weights_version = status.version
        if status.tokens > state.tokens >= 0:  # generating: a batch in progress is progress (its credits stay)
            state.progress_at = state.last_seen
        state.tokens = status.tokens
        return state

    def forget(self, identity: bytes) -> None:
        self.states.pop(identity, None)

    def expire(self) -> list[ActorState]:
        """Drop the actors silent for longer than the lease (their credits return to the pool), and
        take back the credits of actors without progress for the credit timeout. Returns the dropped."""
        now = time.monotonic()
        dead = [a for a in self.states.values() if now - a.last_seen > self.lease_s]
        for a in dead:
            del self.states[a.identity]
        for a in self.states.values():  # credits are renewed by progress, not by heartbeats
            if a.outstanding and now - a.progress_at > self.credit_timeout_s:
                self.reclaimed.append((a, a.outstanding))
                a.outstanding, a.hog = 0, True
                a.settled = True  # the one credit it gets next starts its clock anew: one reclaim per timeout, no storm
                self._remember(self._hogs, a.actor_id)
        return dead

    def _remember(self, table: dict, actor_id: str) -> None:
        table.pop(actor_id, None)
        table[actor_id] = None
        while len(table) > 4 * self.max_actors:  # bounded: the oldest are forgotten first
            del table[next(iter(table))]

    def take_reclaimed(self) -> tuple[list[tuple[ActorState, int]], list[ActorState]]:
        """Credits taken back for want of progress, and strangers evicted, since the last call."""
        out = (self.reclaimed, self.evicted)
        self.reclaimed, self.evicted = [], []
        return out

    def identities_of(self) -> dict[str, list[bytes]]:
        """Actor id -> the routing identities it is connected with."""
        idents: dict[str, list[bytes]] = {}
        for ident, a in self.states.items():
            idents.setdefault(a.actor_id, []).append(ident)
        return idents

    def received_from(self, actor_id: str, n: int) -> None:
        """``n`` episodes arrived from ``actor_id``, valid or not: its credits are used and its
        lease renewed. Progress is :meth:`delivered`."""
        now = time.monotonic()
        for a in self.states.values():
            if a.actor_id == actor_id:
                a.outstanding = max(0, a.outstanding - n)
                a.last_seen = now

    def delivered(self, actor_id: str, n: int) -> None:
        """``n`` valid episodes from ``actor_id`` went into the buffer: that, and only that, is
        progress (it keeps its credits, stops being a hog or a stranger)."""
        now = time.monotonic()
        for a in self.states.values():
            if a.actor_id == actor_id:
                a.progress_at = now
                a.delivered += n
                a.hog = False
                a.settled = a.outstanding == 0
        self._hogs.pop(actor_id, None)
        if actor_id not in self._known:
            self._remember(self._known, actor_id)

    def _stranger(self, a: ActorState) -> bool:
        return a.delivered == 0 and a.actor_id not in self._known

    def grant_credits(self, free: int, min_version: int, work=None, stranger_cap: int | None = None) -> int:
        """Hand out up to ``free`` credits one at a time, round-robin over the actors below their
        capacity, starting after the actor served first last time, so that every connected actor
        gets a share of each step's work (and so generates with each new ``min_version``).
        Strangers (actors that have not delivered a valid episode) hold at most ``stranger_cap``
        credits all together (None: no cap).

        ``work(actor_state, n) -> dict``, if given, adds fields to an actor's credit message (the
        learner's replay assignments and skip-set changes, see ``asyncrl.learner.experience``)."""
        actors = list(self.states.items())
        if not actors:
            return 0
        start = self._credit_cursor % len(actors)
        order = actors[start:] + actors[:start]
        self._credit_cursor += 1
        grants = {ident: 0 for ident, _ in order}
        granted = 0
        strangers = {ident for ident, a in order if self._stranger(a)}
        stranger_room = (
            len(self.states) * self.max_capacity
            if stranger_cap is None
            else max(0, stranger_cap - sum(self.states[i].outstanding for i in strangers))
        )
        while free > 0:
            progress = False
            for ident, a in order:
                if (
                    free > 0
                    and a.outstanding + grants[ident] < (1 if a.hog else a.capacity)
                    and (stranger_room > 0 or ident not in strangers)
                ):
                    grants[ident] += 1
                    free -= 1
                    granted += 1
                    stranger_room -= ident in strangers
                    progress = True
            if not progress:
                break
        for ident, a in order:
            if grants[ident]:
                extra = work(a, grants[ident]) if work is not None else {}
                self.send(ident, Credit(n=grants[ident], min_version=min_version, **extra))
                if not a.outstanding and a.settled:  # the clock for its progress starts with the work (not
                    a.progress_at = time.monotonic()  # again for credits its rejected episodes used up)
                a.settled = False
                a.outstanding += grants[ident]
        return granted

    def stop_all(self, reason: str = "") -> None:
        for ident in list(self.states):
            self.send(ident, Stop(reason=reason))
