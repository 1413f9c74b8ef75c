"""The learner's side of the wire.

Sockets (all bound by the learner; actors connect):
- ``episodes`` PULL: actors PUSH finished episodes (high-water mark ``wire.hwm``).
- ``control`` ROUTER: actors send ``hello``/``status``; the learner answers ``welcome`` (with the other
  addresses and its session id), ``ack`` (episode ids now in the WAL), ``credit`` (how many episodes an
  actor may generate, and the least policy version to generate them with) and ``stop``.
- ``weights`` ROUTER: an actor sends ``subscribe``; the learner sends it every published version (and
  the current one at once). A ROUTER rather than PUB so that a late subscriber never misses weights.
- ``events`` PUB: every event written to the run log, for live viewers.

Flow control (AReaL's capacity rule): credits are granted only while
``in_flight + buffered <= (max_staleness + 1) * batch_tasks``, which bounds staleness. A malformed
message or one with the wrong schema version is reported (event ``bad_message``) and dropped; the
learner keeps running.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import zmq

from ..wire.codec import Message, WireError, decode, decode_episode, encode_msg, encode_weights
from ..wire.sockets import apply_curve_server, bind, check_bind_host, start_curve_auth


@dataclass
class ActorState:
    identity: bytes
    actor_id: str
    capacity: int
    outstanding: int = 0
    weights_version: int = -1
    status: dict = field(default_factory=dict)
    last_seen: float = field(default_factory=time.time)
    withheld_sent: set | None = None  # replay: the skip set as last sent to this actor (None: never)


class LearnerNet:
    def __init__(self, wire_cfg, on_bad_message, previous: dict[str, str] | None = None):
        check_bind_host(wire_cfg.host, wire_cfg.curve_dir)
        self.ctx = zmq.Context.instance()
        self.session = uuid.uuid4().hex
        self.auth = start_curve_auth(self.ctx, wire_cfg.curve_dir) if wire_cfg.curve_dir else None
        self.on_bad_message = on_bad_message
        prev = previous or {}
        self.episodes = self._socket(zmq.PULL, wire_cfg, wire_cfg.episodes_port, prev.get("episodes"))
        self.control = self._socket(zmq.ROUTER, wire_cfg, wire_cfg.control_port, prev.get("control"))
        self.weights = self._socket(zmq.ROUTER, wire_cfg, wire_cfg.weights_port, prev.get("weights"))
        self.events = self._socket(zmq.PUB, wire_cfg, wire_cfg.events_port, prev.get("events"))
        self.addresses = {name: sock.getsockopt_string(zmq.LAST_ENDPOINT)
                          for name, sock in (("episodes", self.episodes), ("control", self.control),
                                             ("weights", self.weights), ("events", self.events))}
        self.actors: dict[bytes, ActorState] = {}
        self.subscribers: dict[bytes, int] = {}  # identity -> last version sent
        self._credit_cursor = 0  # which actor is served first by the next grant
        self.poller = zmq.Poller()
        for s in (self.episodes, self.control, self.weights):
            self.poller.register(s, zmq.POLLIN)
        self._weights_frames: list | None = None
        self.weights_version = -1

    def _socket(self, kind, wire_cfg, port, previous_address: str | None = None):
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind in (zmq.PULL, zmq.PUB):
            sock.setsockopt(zmq.RCVHWM if kind == zmq.PULL else zmq.SNDHWM, wire_cfg.hwm)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if wire_cfg.curve_dir:
            apply_curve_server(sock, wire_cfg.curve_dir)
        if port == 0 and previous_address:  # a resumed learner keeps its ports so actors reconnect
            try:
                bind(sock, wire_cfg.host, int(previous_address.rsplit(":", 1)[1]))
                return sock
            except (zmq.ZMQError, ValueError):
                pass
        bind(sock, wire_cfg.host, port)
        return sock

    # -- receiving ------------------------------------------------------------------------------
    def poll(self, timeout_ms: int) -> tuple[list[tuple], list[tuple[bytes, Message]]]:
        """Drain what has arrived (waiting up to ``timeout_ms`` for the first message). Returns
        (episodes as (Episode, frames), control messages as (identity, Message))."""
        episodes, control = [], []
        events = dict(self.poller.poll(timeout_ms))
        while events:
            if self.episodes in events:
                self._drain(self.episodes, lambda fr: self._take_episode(fr, episodes))
            if self.control in events:
                self._drain(self.control, lambda fr: self._take_routed(fr, control, "control"))
            if self.weights in events:
                self._drain(self.weights, lambda fr: self._take_routed(fr, [], "weights"))
            events = dict(self.poller.poll(0))
        return episodes, control

    @staticmethod
    def _drain(sock, handle, limit: int = 1000) -> None:
        for _ in range(limit):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle(frames)

    def _take_episode(self, frames, out) -> None:
        try:
            msg = decode(frames)
            if msg.kind != "episode":
                raise WireError(f"episodes socket got a {msg.kind!r} message; expected 'episode'")
            out.append((decode_episode(msg), [f.buffer for f in frames]))
        except WireError as e:
            self.on_bad_message("episodes", str(e))

    def _take_routed(self, frames, out, channel: str) -> None:
        identity, rest = frames[0].bytes, frames[1:]
        try:
            msg = decode(rest)
        except WireError as e:
            self.on_bad_message(channel, str(e))
            return
        if channel == "weights":
            self._on_subscribe(identity, msg)
        else:
            out.append((identity, msg))

    # -- actors ---------------------------------------------------------------------------------
    def register(self, identity: bytes, msg: Message) -> ActorState:
        body = msg.body
        state = self.actors.get(identity)
        if state is None or msg.kind == "hello":
            state = ActorState(identity, str(body.get("actor_id", identity.hex())),
                               int(body.get("capacity", 1)))
            self.actors[identity] = state
            self.send_control(identity, "welcome", session=self.session, addresses=self.addresses)
        state.last_seen = time.time()
        if msg.kind == "status":
            state.status = dict(body)
            state.weights_version = int(body.get("version", state.weights_version))
        return state

    def send_control(self, identity: bytes, kind: str, **body) -> None:
        self.control.send_multipart([identity, *encode_msg(kind, **body)], copy=False)

    def ack(self, by_actor: dict[str, list[str]]) -> None:
        ident_of = {a.actor_id: ident for ident, a in self.actors.items()}
        for actor_id, ids in by_actor.items():
            if actor_id in ident_of and ids:
                self.send_control(ident_of[actor_id], "ack", ids=ids)

    def received_from(self, actor_id: str, n: int) -> None:
        for a in self.actors.values():
            if a.actor_id == actor_id:
                a.outstanding = max(0, a.outstanding - n)

    def grant_credits(self, free: int, min_version: int, work=None) -> int:
        """Hand out up to ``free`` credits one at a time, round-robin over the actors below their
        capacity, starting after the actor served first last time, so that every connected actor
        gets a share of each step's work (and so generates with each new ``min_version``).

        ``work(actor_state, n) -> dict``, if given, adds fields to an actor's credit message (the
        learner's replay tasks and skip-set changes, see ``asyncrl.learner.replay``)."""
        actors = list(self.actors.items())
        if not actors:
            return 0
        start = self._credit_cursor % len(actors)
        order = actors[start:] + actors[:start]
        self._credit_cursor += 1
        grants = {ident: 0 for ident, _ in order}
        granted = 0
        while free > 0:
            progress = False
            for ident, a in order:
                if free > 0 and a.outstanding + grants[ident] < a.capacity:
                    grants[ident] += 1
                    free -= 1
                    granted += 1
                    progress = True
            if not progress:
                break
        for ident, a in order:
            if grants[ident]:
                extra = work(a, grants[ident]) if work is not None else {}
                self.send_control(ident, "credit", n=grants[ident], min_version=min_version, **extra)
                a.outstanding += grants[ident]
        return granted

    @property
    def in_flight(self) -> int:
        return sum(a.outstanding for a in self.actors.values())

    def stop_actors(self) -> None:
        for ident in list(self.actors):
            self.send_control(ident, "stop")

    # -- weights --------------------------------------------------------------------------------
    def publish_weights(self, named_tensors, version: int, path: str | None = None) -> None:
        """Send ``named_tensors`` to every subscriber, or, when ``path`` is given (filesystem sync,
        the tensors already saved there), only a reference to the file."""
        self._weights_frames = (encode_msg("weights", version=version, path=path) if path
                                else encode_weights(named_tensors, version))
        self.weights_version = version
        for ident in list(self.subscribers):
            self._send_weights(ident)

    def _on_subscribe(self, identity: bytes, msg: Message) -> None:
        if msg.kind != "subscribe":
            self.on_bad_message("weights", f"weights socket got {msg.kind!r}; expected 'subscribe'")
            return
        self.subscribers[identity] = int(msg.body.get("have", -1))
        if self._weights_frames is not None and self.subscribers[identity] < self.weights_version:
            self._send_weights(identity)

    def _send_weights(self, identity: bytes) -> None:
        self.weights.send_multipart([identity, *self._weights_frames], copy=False)
        self.subscribers[identity] = self.weights_version

    # -- events ---------------------------------------------------------------------------------
    def publish_event(self, record: dict) -> None:
        try:
            self.events.send_multipart(encode_msg("event", event=record), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass

    def close(self) -> None:
        for s in (self.episodes, self.control, self.weights, self.events):
            s.close(0)
        if self.auth is not None:
            self.auth.stop()
