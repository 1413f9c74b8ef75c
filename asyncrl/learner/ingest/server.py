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

Who does what: this class owns the sockets, receiving and decoding, the acknowledgements and the
events; :class:`.actors.ActorTable` (``self.actors``) admits actors and keeps their leases and credits
(AReaL's capacity rule: credits only within the pool the learner's
:class:`.staleness.StalenessPolicy` sets, which bounds staleness); :class:`.subscribers.WeightSubscribers`
(``self.subscribers``) delivers weights, one version in flight per actor.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import zmq

from ...wire.codec import Message, WireError, decode, decode_episode, encode, episode_identity
from ...wire.messages import Ack, Alive, Event, Hello, Rejected, Status, Stop, Welcome
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
from .actors import ActorState, ActorTable
from .subscribers import WEIGHTS_HWM, WeightSubscribers

_CHUNK = 16  # messages taken from one socket before the next socket's turn
_BYTES_PER_TOKEN = 4  # the widest per-token array (int32 token ids, float32 log-probs)


@dataclass
class Limits:
    """What the learner accepts from peers (``wire`` config plus the model's context length)."""

    header_bytes: int  # an episode's msgpack header
    control_bytes: int  # any control / weights-channel message
    max_trajectories: int
    max_tokens: int  # per trajectory
    routing_width: int = 0  # Trajectory.routing's row (routing replay; 0: the model has no experts, none accepted)
    num_experts: int = 0  # expert indices in routing are in [-1, num_experts)

    @classmethod
    def from_config(cls, wire_cfg, max_positions: int | None = None, routing: tuple[int, int] = (0, 0)) -> "Limits":
        """``routing``: ``(width, num_experts)`` of the model's routing replay (``(0, 0)``: none)."""
        tokens = wire_cfg.max_tokens_per_trajectory or 4 * (max_positions or 4096)
        return cls(
            header_bytes=wire_cfg.max_header_kb << 10,
            control_bytes=wire_cfg.max_control_kb << 10,
            max_trajectories=wire_cfg.max_trajectories_per_episode,
            max_tokens=tokens,
            routing_width=routing[0],
            num_experts=routing[1],
        )

    @property
    def frame_bytes(self) -> int:
        """ZMQ_MAXMSGSIZE of the episodes socket: the largest legal frame (routing: int16 x its width)."""
        per_token = max(_BYTES_PER_TOKEN, 2 * self.routing_width)
        return max(self.header_bytes, self.max_trajectories * self.max_tokens * per_token)


class Arrival(NamedTuple):
    """An episode as received: the decoded Episode, its frames (for the WAL) and its arrays
    (concatenated over trajectories, for validation)."""

    episode: object
    frames: list
    arrays: dict[str, np.ndarray]


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
            zmq.ROUTER, wire_cfg, "weights", prev.get("weights"), max_bytes=lim.control_bytes, hwm=WEIGHTS_HWM
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
        # the actors' admission, leases and credits; the weights channel's subscribers
        self.deals = False  # the learner's ledger deals every fresh task (said in each welcome)
        self.actors = ActorTable(
            wire_cfg,
            self.send_control,
            lambda: Welcome(session=self.session, addresses=self.addresses, lease_s=self.lease_s, deals=self.deals),
        )
        self.subscribers = WeightSubscribers(self.weights, wire_cfg.lease_s)
        self.undecodable: list[tuple[str, str, WireError]] = []
        self.poller = zmq.Poller()
        for s in (self.episodes, self.control, self.weights):
            self.poller.register(s, zmq.POLLIN)
        self.decode_s = 0.0  # time spent receiving-side on episodes: key check, decode (the ingest's first part)

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
            self.actors.forget(main)
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
            self.subscribers.on_subscribe(identity, msg.body)
        else:
            msg = decode(frames[1:], max_header_bytes=self.limits.control_bytes, kinds=("hello", "status"))
            self._check_speaker(key_name, msg.body.actor_id, identity, channel)
            if msg.kind == "status":  # the identity it names is the one its actor's main socket has
                self._check_speaker(key_name, msg.body.actor_id, msg.body.identity.encode(), channel)
            out.append((identity, msg))

    # -- actors ---------------------------------------------------------------------------------
    def handle_control(self, identity: bytes, msg: Message) -> ActorState:
        """Admit (``hello``) or renew (``status``, answered with ``alive``) an actor; returns its
        state (:class:`.actors.ActorTable`). Raises WireError when the actor table is full."""
        body = msg.body
        if isinstance(body, Hello):
            return self.actors.admit(identity, body.actor_id, body.capacity)
        assert isinstance(body, Status)
        state = self.actors.renew(body)
        self.send_control(identity, Alive(session=self.session, version=max(self.subscribers.version, 0)))
        return state

    def expire(self) -> list[ActorState]:
        """Drop the actors and weight subscribers silent for longer than the lease, take back credits
        held without progress; returns the dropped actors."""
        dead = self.actors.expire()
        self.subscribers.expire({a.actor_id for a in self.actors.values()})
        return dead

    def send_control(self, identity: bytes, body) -> None:
        send_routed(self.control, identity, encode(body.KIND, body))

    def ack(self, by_actor: dict[str, list[str]], rejected: dict[str, list[Rejected]] | None = None) -> None:
        """Acknowledge episode ids (durable in the WAL) and rejected episodes to every connected
        actor with that actor id (an actor ignores ids it does not hold)."""
        rejected = rejected or {}
        idents = self.actors.identities_of()
        for actor_id in set(by_actor) | set(rejected):
            ids, rej = by_actor.get(actor_id, []), rejected.get(actor_id, [])
            for ident in idents.get(actor_id, ()) if (ids or rej) else ():
                self.send_control(ident, Ack(ids=ids, rejected=rej))

    def housekeeping(self) -> Housekeeping:
        """Expire leases, then take what was reclaimed, evicted and denied since the last call."""
        dropped = self.expire()
        reclaimed, evicted = self.actors.take_reclaimed()
        return Housekeeping(dropped, reclaimed, evicted, self.take_denied())

    def has_actors(self) -> bool:
        return bool(self.actors)

    def take_denied(self) -> list[tuple[str, float]]:
        """CURVE client keys the authenticator refused since the last call (key, unix time)."""
        return self.auth.keys.take_denied() if self.auth is not None else []

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
