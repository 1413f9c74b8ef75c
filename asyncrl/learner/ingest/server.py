"""The learner's side of the wire.

Sockets (all bound by the learner; actors connect):
- ``episodes`` PULL: actors PUSH finished episodes (high-water mark ``wire.hwm``).
- ``control`` ROUTER: actors send ``hello`` and ``status`` (heartbeats); the learner answers
  ``welcome`` (the other addresses, its session id, the lease), ``alive``, ``ack`` (episode ids now
  in the WAL, and those rejected), ``credit`` (how many episodes an actor may generate, the least
  policy version to generate them with, replay assignments) and ``stop``.
- ``weights`` ROUTER: an actor sends ``subscribe`` (``have``: the version it holds); the learner
  sends it the newest version, and the next one only once the actor says it has the last one, so
  at most one version per subscriber is ever queued (plus a send high-water mark of 2 as a
  backstop). A ROUTER rather than PUB so that a late subscriber never misses weights.
- ``events`` PUB: every event written to the run log, for live viewers.

Who can connect: without CURVE keys (``wire.curve_dir``) the sockets are ``ipc://`` files in the
run's private socket directory (``asyncrl.wire.sockets.socket_dir``: mode 0700), so only this user's
processes on this host reach them; with keys they are TCP CURVE servers (loopback too), every
authorised key bound to its name: a message whose actor id (or routing identity) is not its key's
is refused, so an authorised actor cannot speak for another.

Peers are not trusted. Every message is decoded into its typed body (:mod:`asyncrl.wire.messages`)
with size limits (``ZMQ_MAXMSGSIZE`` per frame, a header limit per channel, a frame count per
channel); one that fails is reported to ``on_bad_message`` and dropped, alone. Each ``poll`` takes
at most ``budget`` messages, a few from each socket in turn, so neither a flood nor one busy channel
holds the learner.

Flow control (AReaL's capacity rule): credits are granted only while ``in_flight + buffered`` stays
within the pool the learner's :class:`.staleness.StalenessPolicy` sets, which bounds staleness. Credits are
leases: an actor silent for ``wire.lease_s`` is dropped with its outstanding credits (``expire``);
any message from it renews the lease, and a dropped actor's next heartbeat admits it again. An actor
keeps its credits while it makes progress: a valid episode delivered, or tokens generated (its
heartbeat's ``tokens`` count advancing, so a batch that takes minutes keeps them); one that does
neither for ``wire.credit_timeout_s`` loses them and gets one at a time until it delivers, its clock
restarting with each such credit.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import zmq

from ...wire.codec import Message, WireError, decode, decode_episode, encode, episode_identity
from ...wire.messages import Ack, Alive, Credit, Event, Hello, Rejected, Status, Stop, Subscribe, Welcome
from ...wire.sockets import (
    apply_curve_server,
    bind,
    bind_ipc,
    check_wire,
    drain,
    key_allows,
    private_dir,
    send_frames,
    send_routed,
    start_curve_auth,
)

_CHUNK = 16  # messages taken from one socket before the next socket's turn
_WEIGHTS_HWM = 2  # weights messages queued per subscriber, at most (one is the rule, see _send_weights)
_WEIGHTS_RESEND_S = 5.0  # a subscriber asking again for a version already sent gets it again after this
_BYTES_PER_TOKEN = 4  # the widest per-token array (int32 token ids, float32 log-probs)


@dataclass
class Limits:
    """What the learner accepts from peers (``wire`` config plus the model's context length)."""

    header_bytes: int  # an episode's msgpack header
    control_bytes: int  # any control / weights-channel message
    max_trajectories: int
    max_tokens: int  # per trajectory

    @classmethod
    def from_config(cls, wire_cfg, max_positions: int | None = None) -> "Limits":
        tokens = wire_cfg.max_tokens_per_trajectory or 4 * (max_positions or 4096)
        return cls(
            header_bytes=wire_cfg.max_header_kb << 10,
            control_bytes=wire_cfg.max_control_kb << 10,
            max_trajectories=wire_cfg.max_trajectories_per_episode,
            max_tokens=tokens,
        )

    @property
    def frame_bytes(self) -> int:
        """ZMQ_MAXMSGSIZE of the episodes socket: the largest legal frame."""
        return max(self.header_bytes, self.max_trajectories * self.max_tokens * _BYTES_PER_TOKEN)


class Arrival(NamedTuple):
    """An episode as received: the decoded Episode, its frames (for the WAL) and its arrays
    (concatenated over trajectories, for validation)."""

    episode: object
    frames: list
    arrays: dict[str, np.ndarray]


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


@dataclass
class Subscriber:
    actor_id: str
    have: int = -1  # the version it says it holds
    sent: int = -1  # the newest version sent to it
    sent_at: float = 0.0
    last_seen: float = field(default_factory=time.monotonic)


def credit_timeout_s(wire_cfg) -> float:
    """``wire.credit_timeout_s``, or three leases when unset."""
    return wire_cfg.credit_timeout_s or 3 * wire_cfg.lease_s


@dataclass
class Housekeeping:
    """What one round of upkeep found (:meth:`LearnerServer.housekeeping`), for the learner to report."""

    dropped: list  # ActorState: silent past their lease (wire.lease_s); their credits return to the pool
    reclaimed: list  # (ActorState, credits): held credits without progress for credit_timeout_s
    evicted: list  # ActorState: made room in a full actor table for an actor that delivers
    denied: list  # (CURVE key, time): clients refused by the authenticator


class LearnerServer:
    def __init__(
        self,
        wire_cfg,
        on_bad_message: Callable[[str, Exception], None],
        previous: dict[str, str] | None = None,
        limits: Limits | None = None,
        sock_dir: Path | None = None,
    ):
        """``sock_dir``: the private directory of the ipc sockets (without CURVE keys); None makes a
        temporary one, removed by :meth:`close`."""
        check_wire(wire_cfg)
        self.tcp = bool(wire_cfg.curve_dir)
        self._own_dir = None
        if not self.tcp and sock_dir is None:
            sock_dir = self._own_dir = private_dir(tempfile.mkdtemp(prefix="asyncrl-sock-"))
        self.sock_dir = sock_dir
        self.ctx = zmq.Context.instance()
        self.session = uuid.uuid4().hex
        self.lease_s = wire_cfg.lease_s
        self.credit_timeout_s = credit_timeout_s(wire_cfg)
        self.reclaimed: list[tuple[ActorState, int]] = []  # credits taken back since the last call
        self.evicted: list[ActorState] = []  # strangers dropped for a returning actor since the last call
        self._hogs: dict[str, None] = {}  # actor ids whose credits were taken back (kept across hellos)
        self._known: dict[str, None] = {}  # actor ids that delivered an episode (never refused for a stranger)
        self.max_capacity, self.max_actors = wire_cfg.max_capacity, wire_cfg.max_actors
        self.limits = limits or Limits.from_config(wire_cfg)
        self.auth = start_curve_auth(self.ctx, wire_cfg.curve_dir) if wire_cfg.curve_dir else None
        self.on_bad_message = on_bad_message
        prev = previous or {}
        lim = self.limits
        self.episodes = self._socket(
            zmq.PULL, wire_cfg, "episodes", prev.get("episodes"), max_bytes=lim.frame_bytes, hwm=wire_cfg.hwm
        )
        self.control = self._socket(zmq.ROUTER, wire_cfg, "control", prev.get("control"), max_bytes=lim.control_bytes)
        self.weights = self._socket(
            zmq.ROUTER, wire_cfg, "weights", prev.get("weights"), max_bytes=lim.control_bytes, hwm=_WEIGHTS_HWM
        )
        self.events = self._socket(
            zmq.PUB, wire_cfg, "events", prev.get("events"), max_bytes=lim.control_bytes, hwm=wire_cfg.hwm
        )
        self.addresses = {
            name: sock.getsockopt_string(zmq.LAST_ENDPOINT)
            for name, sock in (
                ("episodes", self.episodes),
                ("control", self.control),
                ("weights", self.weights),
                ("events", self.events),
            )
        }
        self.actors: dict[bytes, ActorState] = {}
        self.subscribers: dict[bytes, Subscriber] = {}
        self.undecodable: list[tuple[str, str, WireError]] = []
        self._credit_cursor = 0  # which actor is served first by the next grant
        self.poller = zmq.Poller()
        for s in (self.episodes, self.control, self.weights):
            self.poller.register(s, zmq.POLLIN)
        self._weights_frames: list | None = None
        self._weights_nbytes = 0
        self.weights_version = -1
        self.weights_bytes_sent = 0  # every weights message sent to any subscriber, all frames
        self.decode_s = 0.0  # time spent receiving-side on episodes: key check, decode (the ingest's first part)
        self._published_at: dict[int, float] = {}  # version -> unix time published (the last 64)
        self.applied: list[tuple[str, int, float]] = []  # (actor, version, seconds publish -> applied)

    def _socket(self, kind, wire_cfg, name: str, previous_address: str | None, max_bytes: int, hwm: int | None = None):
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)  # a larger frame disconnects its sender
        if hwm is not None:
            sock.setsockopt(zmq.SNDHWM if kind != zmq.PULL else zmq.RCVHWM, hwm)
        if kind == zmq.ROUTER:  # a reconnecting actor takes its identity back at once (a cut link's old pipe
            # may linger); only this user's processes (ipc) or authorised keys (CURVE) connect at all, and
            # an actor's identity ends in a random part it tells no one but the learner (asyncrl.actor.actor)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if kind == zmq.ROUTER and hwm is not None:  # weights: a full queue or a gone peer is reported
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if not self.tcp:  # (a resumed learner binds the same paths again: its actors reconnect)
            bind_ipc(sock, self.sock_dir, name)
            return sock
        apply_curve_server(sock, wire_cfg.curve_dir)
        port = getattr(wire_cfg, f"{name}_port")
        if (
            port == 0 and previous_address and previous_address.startswith("tcp://")
        ):  # a resumed learner keeps its ports
            try:
                bind(sock, wire_cfg.host, int(previous_address.rsplit(":", 1)[1]))
                return sock
            except (zmq.ZMQError, ValueError):
                pass
        bind(sock, wire_cfg.host, port)
        return sock

    # -- receiving ------------------------------------------------------------------------------
    def poll(self, timeout_ms: int, budget: int = 256) -> tuple[list[Arrival], list[tuple[bytes, Message]]]:
        """Take what has arrived (waiting up to ``timeout_ms`` for the first message), at most
        ``budget`` messages, ``_CHUNK`` at a time from each socket in turn. Returns (episodes,
        control messages as (identity, Message)); weights-channel messages are handled here."""
        episodes: list[Arrival] = []
        control: list[tuple[bytes, Message]] = []
        if not self.poller.poll(timeout_ms):
            return episodes, control
        channels = (
            (self.control, lambda fr: self._take_routed(fr, control, "control"), 2, "control"),
            (self.episodes, lambda fr: self._take_episode(fr, episodes), 6, "episodes"),
            (self.weights, lambda fr: self._take_routed(fr, None, "weights"), 2, "weights"),
        )
        taken, progress = 0, True
        while progress and taken < budget:
            progress = False
            for sock, handle, max_parts, channel in channels:
                n = drain(
                    sock,
                    handle,
                    min(_CHUNK, budget - taken),
                    max_parts=max_parts,
                    on_error=lambda e, ch=channel: self.on_bad_message(ch, e),
                )
                taken += n
                progress = progress or n > 0
        return episodes, control

    def _check_key(self, frames, channel: str) -> str | None:
        """With CURVE: the name the message's key is bound to; a message whose connection's key is
        no longer authorised (revoked while the learner runs: its connection predates the
        revocation) is refused and the sender stopped. None without CURVE."""
        if self.auth is None:
            return None
        user = frames[0].get("User-Id")
        name = self.auth.keys.name_of(user or "")
        if name is not None:
            return name
        if channel == "control":
            identity = frames[0].bytes
            main = identity[:-3] if identity.endswith(b":hb") else identity  # (its heartbeat socket)
            self.actors.pop(main, None)
            self.send_control(
                identity,
                Stop(
                    reason=f"this actor's CURVE key {user} was revoked (no longer in "
                    f"the learner's authorized/ directory)"
                ),
            )
        raise WireError(
            f"a {channel} message from CURVE key {user}, which is no longer authorised (revoked); dropped",
            reason="revoked_key",
        )

    def _check_speaker(self, key_name: str | None, actor_id: str, identity: bytes | None, channel: str) -> None:
        """With CURVE: refuse a message whose actor id, or routing identity (``<actor id>:...``), is
        not the one its key is bound to (an authorised actor speaking for another)."""
        if self.auth is None:
            return
        if (
            key_name is not None
            and key_allows(key_name, actor_id)
            and (identity is None or identity.startswith(f"{actor_id}:".encode()))
        ):
            return
        said = f"actor id {actor_id!r}" + ("" if identity is None else f" (identity {identity[:80]!r})")
        raise WireError(
            f"a {channel} message with {said} came with the CURVE key of {key_name!r}; a key speaks "
            f"only for the actor it was made for",
            reason="wrong_key",
        )

    def _take_episode(self, frames, out: list[Arrival]) -> None:
        t0 = time.perf_counter()
        try:
            key_name = self._check_key(frames, "episodes")
            msg = decode(frames, max_header_bytes=self.limits.header_bytes, kinds=("episode",))
            episode = decode_episode(msg)
            self._check_speaker(key_name, episode.actor_id, None, "episodes")
        except WireError as e:  # its actor is told when the header still names it (never to resend it)
            ids = episode_identity(frames[0]) if frames[0].buffer.nbytes <= self.limits.header_bytes else None
            if ids is not None and e.reason not in ("revoked_key", "wrong_key"):
                self.undecodable.append((*ids, e))
            raise
        finally:
            self.decode_s += time.perf_counter() - t0
        out.append(Arrival(episode, [f.buffer for f in frames], msg.arrays))

    def take_undecodable(self) -> list[tuple[str, str, WireError]]:
        """(actor_id, episode_id, error) of episodes refused by the decoder since the last call."""
        out, self.undecodable = self.undecodable, []
        return out

    def _take_routed(self, frames, out: list | None, channel: str) -> None:
        key_name = self._check_key(frames, channel)
        identity = frames[0].bytes
        if channel == "weights":
            msg = decode(frames[1:], max_header_bytes=self.limits.control_bytes, kinds=("subscribe",))
            self._check_speaker(key_name, msg.body.actor_id, identity, channel)
            self._on_subscribe(identity, msg.body)
        else:
            msg = decode(frames[1:], max_header_bytes=self.limits.control_bytes, kinds=("hello", "status"))
            self._check_speaker(key_name, msg.body.actor_id, identity, channel)
            if msg.kind == "status":  # the identity it names is the one its actor's main socket has
                self._check_speaker(key_name, msg.body.actor_id, msg.body.identity.encode(), channel)
            out.append((identity, msg))

    # -- actors ---------------------------------------------------------------------------------
    def handle_control(self, identity: bytes, msg: Message) -> ActorState:
        """Admit (``hello``) or renew (``status``) an actor; returns its state. A status from an
        actor the learner does not know (dropped by its lease, or this learner is new) admits it
        again. Raises WireError when the actor table is full."""
        body = msg.body
        if isinstance(body, Hello):
            return self._admit(identity, body.actor_id, body.capacity)
        assert isinstance(body, Status)
        main = body.identity.encode()
        state = self.actors.get(main) or self._admit(main, body.actor_id, body.capacity)
        state.last_seen = time.monotonic()
        state.status = body
        state.weights_version = body.version
        if body.tokens > state.tokens >= 0:  # generating: a batch in progress is progress (its credits stay)
            state.progress_at = state.last_seen
        state.tokens = body.tokens
        self.send_control(identity, Alive(session=self.session, version=max(self.weights_version, 0)))
        return state

    def _admit(self, identity: bytes, actor_id: str, capacity: int) -> ActorState:
        if identity not in self.actors and len(self.actors) >= self.max_actors:
            strangers = [a for a in self.actors.values() if a.delivered == 0]
            if actor_id not in self._known or not strangers:
                raise WireError(
                    f"actor table full ({self.max_actors} actors, wire.max_actors); refused {actor_id!r}",
                    reason="actors_full",
                )
            # an actor that delivered before comes back: the stranger admitted first makes room
            stranger = min(strangers, key=lambda a: a.admitted_at)
            del self.actors[stranger.identity]
            self.evicted.append(stranger)
            self.send_control(
                stranger.identity,
                Stop(reason=f"the actor table is full and {actor_id!r}, which delivered episodes before, came back"),
            )
        state = ActorState(identity, actor_id, min(capacity, self.max_capacity), hog=actor_id in self._hogs)
        self.actors[identity] = state
        self.send_control(identity, Welcome(session=self.session, addresses=self.addresses, lease_s=self.lease_s))
        return state

    def expire(self) -> list[ActorState]:
        """Drop the actors and weight subscribers silent for longer than the lease; the dropped
        actors' outstanding credits return to the pool. Returns the dropped actors."""
        now = time.monotonic()
        dead = [a for a in self.actors.values() if now - a.last_seen > self.lease_s]
        for a in dead:
            del self.actors[a.identity]
        for a in self.actors.values():  # credits are renewed by progress, not by heartbeats
            if a.outstanding and now - a.progress_at > self.credit_timeout_s:
                self.reclaimed.append((a, a.outstanding))
                a.outstanding, a.hog = 0, True
                a.settled = True  # the one credit it gets next starts its clock anew: one reclaim per timeout, no storm
                self._remember(self._hogs, a.actor_id)
        live_ids = {a.actor_id for a in self.actors.values()}
        for ident in [
            i for i, s in self.subscribers.items() if now - s.last_seen > self.lease_s and s.actor_id not in live_ids
        ]:
            del self.subscribers[ident]
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

    def send_control(self, identity: bytes, body) -> None:
        send_routed(self.control, identity, encode(body.KIND, body))

    def ack(self, by_actor: dict[str, list[str]], rejected: dict[str, list[Rejected]] | None = None) -> None:
        """Acknowledge episode ids (durable in the WAL) and rejected episodes to every connected
        actor with that actor id (an actor ignores ids it does not hold)."""
        rejected = rejected or {}
        idents: dict[str, list[bytes]] = {}
        for ident, a in self.actors.items():
            idents.setdefault(a.actor_id, []).append(ident)
        for actor_id in set(by_actor) | set(rejected):
            ids, rej = by_actor.get(actor_id, []), rejected.get(actor_id, [])
            for ident in idents.get(actor_id, ()) if (ids or rej) else ():
                self.send_control(ident, Ack(ids=ids, rejected=rej))

    def received_from(self, actor_id: str, n: int) -> None:
        """``n`` episodes arrived from ``actor_id``, valid or not: its credits are used and its
        lease renewed. Progress is :meth:`delivered`."""
        now = time.monotonic()
        for a in self.actors.values():
            if a.actor_id == actor_id:
                a.outstanding = max(0, a.outstanding - n)
                a.last_seen = now

    def delivered(self, actor_id: str, n: int) -> None:
        """``n`` valid episodes from ``actor_id`` went into the buffer: that, and only that, is
        progress (it keeps its credits, stops being a hog or a stranger)."""
        now = time.monotonic()
        for a in self.actors.values():
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
        actors = list(self.actors.items())
        if not actors:
            return 0
        start = self._credit_cursor % len(actors)
        order = actors[start:] + actors[:start]
        self._credit_cursor += 1
        grants = {ident: 0 for ident, _ in order}
        granted = 0
        strangers = {ident for ident, a in order if self._stranger(a)}
        stranger_room = (
            len(self.actors) * self.max_capacity
            if stranger_cap is None
            else max(0, stranger_cap - sum(self.actors[i].outstanding for i in strangers))
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
                self.send_control(ident, Credit(n=grants[ident], min_version=min_version, **extra))
                if not a.outstanding and a.settled:  # the clock for its progress starts with the work (not
                    a.progress_at = time.monotonic()  # again for credits its rejected episodes used up)
                a.settled = False
                a.outstanding += grants[ident]
        return granted

    @property
    def in_flight(self) -> int:
        return sum(a.outstanding for a in self.actors.values())

    def stop_actors(self, reason: str = "") -> None:
        for ident in list(self.actors):
            self.send_control(ident, Stop(reason=reason))

    def housekeeping(self) -> Housekeeping:
        """Expire leases, then take what was reclaimed, evicted and denied since the last call."""
        dropped = self.expire()
        reclaimed, evicted = self.take_reclaimed()
        return Housekeeping(dropped, reclaimed, evicted, self.take_denied())

    def has_actors(self) -> bool:
        return bool(self.actors)

    def take_denied(self) -> list[tuple[str, float]]:
        """CURVE client keys the authenticator refused since the last call (key, unix time)."""
        return self.auth.keys.take_denied() if self.auth is not None else []

    # -- weights --------------------------------------------------------------------------------
    def publish_weights(self, frames: list, version: int) -> None:
        """Make ``version`` the current weights: ``frames`` is its ``weights`` message (made by the
        sync transport, ``asyncrl.weights``; zero-copy frames must not change until sent). Sent at once
        to every subscriber that holds all it was sent; the others get the newest version when they
        say they have the previous one."""
        self._weights_frames = frames
        self._weights_nbytes = sum(memoryview(f).nbytes for f in frames)  # (counted once per version, sent many times)
        self.weights_version = version
        self._published_at[version] = time.time()
        for old in sorted(self._published_at)[:-64]:
            del self._published_at[old]
        for ident, s in list(self.subscribers.items()):
            if s.sent <= s.have:
                self._send_weights(ident, s)

    def _on_subscribe(self, identity: bytes, body: Subscribe) -> None:
        s = self.subscribers.get(identity)
        if s is None:
            s = self.subscribers[identity] = Subscriber(body.actor_id)
        published = self._published_at.get(body.have)
        if body.applied_at is not None and body.have > s.have and published is not None:
            self.applied.append((s.actor_id, body.have, max(body.applied_at - published, 0.0)))
        s.have, s.last_seen = body.have, time.monotonic()
        if self._weights_frames is None or self.weights_version <= s.have:
            return
        if s.sent < self.weights_version or time.monotonic() - s.sent_at > _WEIGHTS_RESEND_S:
            self._send_weights(identity, s)

    def _send_weights(self, identity: bytes, s: Subscriber) -> None:
        try:
            send_routed(self.weights, identity, self._weights_frames, flags=zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full: it is not reading; it asks again when it does
            return
        except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone
            self.subscribers.pop(identity, None)
            return
        s.sent, s.sent_at = self.weights_version, time.monotonic()
        self.weights_bytes_sent += self._weights_nbytes

    # -- events ---------------------------------------------------------------------------------
    def publish_event(self, record: dict) -> None:
        try:
            send_frames(self.events, encode("event", Event(event=record)), flags=zmq.NOBLOCK)
        except (zmq.Again, WireError):  # no reader keeping up, or a record the UI could not decode
            pass

    def close(self) -> None:
        for s in (self.episodes, self.control, self.weights, self.events):
            s.close(0)
        if self.auth is not None:
            self.auth.stop()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
