"""The actor's side of the protocol (:class:`ActorLink`), the peer of ``asyncrl.learner.ingest.server.LearnerServer``:
its sockets, hello/welcome, learner sessions, credits, delivery (ack and resend), the weight
subscription and replay assignments as they arrive. The actor's loop (``asyncrl.actor.actor``)
generates; everything it says to or hears from the learner goes through here.

- ``hello`` admits the actor; a ``welcome`` names the other channels (the episode PUSH and weights
  DEALER sockets are opened on the first one) and the learner's session. A welcome means the learner
  holds no credits for this actor, so ``credits`` restarts at zero; a new session (the learner
  restarted) resends every unacknowledged episode and asks for weights from scratch.
- ``send_episode`` keeps the episode's frames until an ``ack`` names it (or rejects it, printed
  once with the reason); ``unacked`` is what a restarted learner is sent again.
- ``on_welcome(new_session)`` lets the actor reset what it holds of the learner's (assignments,
  skip set, the weights it asks for).
- ``credit`` adds work and raises ``min_version``; its replay fields go to ``on_credit``.
- ``stop`` (the learner's, or a revoked key's) sets ``stop_requested`` with the reason printed.
- ``subscribe`` says which version this actor holds; ``newest_weights`` takes the newest weights
  message that arrived.
- With CURVE, a refused handshake is said once, in one line (a socket monitor).
- With a node's weights relay (``weights_address``), :meth:`check_relay` falls back to the learner's
  weights channel (and ``on_relay_lost``) once the relay has been unreachable, or the actor has
  waited for newer weights, for ``actor.relay_timeout_s`` (six times that before the relay's first
  version): a dead or stuck relay never stalls its node. Said once, in one line.

Bad messages are reported at a limited rate (per channel the first three, then every 100th) and
dropped, never fatal.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..types import Episode
from ..wire.codec import Message, decode, encode, encode_episode
from ..wire.messages import Ack, Credit, Hello, Stop, Subscribe, Welcome
from ..wire.sockets import apply_curve_client, connect, drain, refused_actor_line, send_frames

_CONTROL_KINDS = ("welcome", "credit", "ack", "stop")
RELAY_FIRST_FACTOR = 6  # a relay that has never delivered is waited for this many times actor.relay_timeout_s


class ActorLink:
    def __init__(
        self,
        wire_cfg,
        control_address: str,
        actor_id: str,
        identity: bytes,
        on_credit: Callable[[Credit], None] | None = None,
        on_welcome: Callable[[bool], None] | None = None,
        weights_address: str | None = None,
        relay_timeout_s: float = 10.0,
        on_relay_lost: Callable[[], None] | None = None,
    ):
        self.wire_cfg, self.actor_id, self.identity = wire_cfg, actor_id, identity
        self.weights_address = weights_address  # a node's weight relay (asyncrl.weights.relay) instead of the learner
        self.relay_timeout_s, self.on_relay_lost = relay_timeout_s, on_relay_lost
        self._relay_monitor: zmq.Socket | None = None
        self._relay_down_since: float | None = None  # not connected to the relay since (None: connected)
        self._relay_delivered = False  # the relay has sent weights at least once
        self.learner_weights: str | None = None  # the learner's weights address (from its welcome)
        self.on_credit, self.on_welcome = on_credit, on_welcome
        self.ctx = zmq.Context.instance()
        self.control, self._auth_monitor = self._monitored(
            zmq.DEALER, control_address, zmq.EVENT_HANDSHAKE_FAILED_AUTH if wire_cfg.curve_dir else None
        )
        self._refused_said = False
        self.episodes: zmq.Socket | None = None
        self.weights: zmq.Socket | None = None
        self.session: str | None = None
        self.unacked: OrderedDict[str, list] = OrderedDict()
        self.tickets: dict[str, str] = {}  # unacknowledged episode id -> its dealt task's ticket
        self.credits = 0
        self.deals = False  # the learner deals every fresh task (its welcome says so)
        self.min_version = 0
        self.stop_requested = False
        self.bad: Counter[str] = Counter()  # bad messages from the learner per channel
        self.rejected = 0
        self.asked_weights_at = 0.0

    def _socket(self, kind, address: str, curve: bool = True) -> zmq.Socket:
        return self._monitored(kind, address, None, curve)[0]

    def _monitored(self, kind, address: str, events: int | None, curve: bool = True):
        """A socket connected to ``address``, and a monitor of its ``events`` (None: none), attached
        before it connects: libzmq tells a monitor only what happens after the monitor is attached,
        and it says a CURVE refusal once (it does not try again), so a monitor attached after
        ``connect`` missed the refusal whenever the handshake was quicker than this thread (CI, under
        load: a refused actor waited on without a word)."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 2000)
        if kind == zmq.DEALER:
            sock.setsockopt(zmq.IDENTITY, self.identity)
        if kind == zmq.PUSH:
            sock.setsockopt(zmq.SNDHWM, self.wire_cfg.hwm)
        if self.wire_cfg.curve_dir and curve:
            apply_curve_client(sock, self.wire_cfg.curve_dir, self.actor_id)
        monitor = sock.get_monitor_socket(events) if events is not None else None
        connect(sock, address)
        return sock, monitor

    # -- control --------------------------------------------------------------------------------
    def hello(self, capacity: int, version: int, pid: int, holding: list[str] | None = None) -> bool:
        """Say hello to the learner; False when it could not be queued (the learner refused this
        actor's key, so the connection is gone, or a thousand hellos wait for a learner that is down).
        Never waits: a blocking send here held a refused actor for ever, before it could say why.
        The actor says hello again every second until it is welcomed."""
        try:
            send_frames(
                self.control,
                encode(
                    "hello",
                    Hello(
                        actor_id=self.actor_id,
                        capacity=capacity,
                        version=max(version, -1),
                        pid=pid,
                        holding=list(holding or ()),
                    ),
                ),
                flags=zmq.NOBLOCK,
            )
        except zmq.Again:
            self._check_refused()
            return False
        return True

    def poll(self, timeout_ms: int) -> None:
        """Handle every control message that has arrived (waiting up to ``timeout_ms`` for one)."""
        self._check_refused()
        if self.control.poll(timeout_ms):
            drain(
                self.control,
                lambda fr: self._on_control(decode(fr, kinds=_CONTROL_KINDS)),
                limit=1000,
                on_error=lambda e: self.report_bad("control", e),
            )

    def _check_refused(self) -> None:
        if self._auth_monitor is None:
            return
        while self._auth_monitor.poll(0):
            line = refused_actor_line(recv_monitor_message(self._auth_monitor))
            if line and not self._refused_said:
                self._refused_said = True
                print(f"[{self.actor_id}] {line}", flush=True)

    def report_bad(self, channel: str, error: Exception) -> None:
        """A message from the learner that could not be used: per channel the first three, then
        every 100th."""
        self.bad[channel] += 1
        n = self.bad[channel]
        if n <= 3 or n % 100 == 0:
            print(
                f"[{self.actor_id}] dropped a bad {channel} message ({n} so far): {type(error).__name__}: {error}",
                flush=True,
            )

    def _on_control(self, msg: Message) -> None:
        body = msg.body
        if isinstance(body, Welcome):
            self._on_welcome(body)
        elif isinstance(body, Ack):
            for eid in body.ids:
                self.unacked.pop(eid, None)
                self.tickets.pop(eid, None)
            for r in body.rejected:
                self.tickets.pop(r.id, None)
                if self.unacked.pop(r.id, None) is not None:
                    self.rejected += 1
                    if self.rejected <= 3 or self.rejected % 100 == 0:
                        print(
                            f"[{self.actor_id}] the learner rejected episode {r.id} ({self.rejected} so "
                            f"far; dropped, not sent again): {r.reason}",
                            flush=True,
                        )
        elif isinstance(body, Credit):
            self.credits += body.n
            self.min_version = max(self.min_version, body.min_version)
            if self.on_credit is not None:
                self.on_credit(body)
        elif isinstance(body, Stop):
            self.stop_requested = True
            if body.reason:
                print(f"[{self.actor_id}] the learner stopped this actor: {body.reason}", flush=True)

    def _on_welcome(self, body: Welcome) -> None:
        new_session = body.session != self.session
        self.session = body.session
        self.deals = body.deals
        self.learner_weights = body.addresses.get("weights") or self.learner_weights
        if self.episodes is None:  # both sockets or neither (a bad address fails this message only)
            episodes = self._socket(zmq.PUSH, body.addresses["episodes"])
            try:
                if self.weights_address is None:
                    self.weights = self._socket(zmq.DEALER, body.addresses["weights"])
                else:  # the relay's private ipc socket (this user only): no CURVE
                    self.weights, self._relay_monitor = self._monitored(
                        zmq.DEALER, self.weights_address, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED, curve=False
                    )
                    self._relay_down_since = time.monotonic()
            except Exception:
                episodes.close(0)
                raise
            self.episodes = episodes
        self.credits = 0  # the learner holds none for us now (new learner, or we were dropped by lease)
        if new_session:
            self.min_version = 0  # a resumed learner may be at an older version than we last saw
        if self.on_welcome is not None:
            self.on_welcome(new_session)
        if new_session:
            for frames in self.unacked.values():  # the learner restarted: resend what it never acked
                send_frames(self.episodes, frames)

    # -- episodes -------------------------------------------------------------------------------
    def send_episode(self, episode: Episode) -> None:
        """Push ``episode``, kept until the learner acknowledges (or rejects) it."""
        frames = encode_episode(episode)
        self.unacked[episode.id] = frames
        if episode.ticket:
            self.tickets[episode.id] = episode.ticket
        send_frames(self.episodes, frames)

    def use_credits(self, n: int) -> None:
        self.credits -= n

    # -- weights --------------------------------------------------------------------------------
    def subscribe(self, have: int, applied_at: float | None) -> None:
        """Tell the learner which of its versions this actor holds (-1: none of this session). It
        sends anything newer, one version at a time, so this also lets the next one go."""
        self.asked_weights_at = time.monotonic()
        send_frames(
            self.weights,
            encode(
                "subscribe",
                Subscribe(actor_id=self.actor_id, have=max(have, -1), applied_at=applied_at if have >= 0 else None),
            ),
        )

    def check_relay(self, waiting_s: float = 0.0) -> bool:
        """With a relay: fall back to the learner's weights channel when the relay has been
        unreachable, or the caller has waited ``waiting_s`` for newer weights, for longer than
        ``relay_timeout_s``. True when it fell back now."""
        if self.weights_address is None or self._relay_monitor is None:
            return False
        while self._relay_monitor.poll(0):
            event = recv_monitor_message(self._relay_monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._relay_down_since = None
            elif event == zmq.EVENT_DISCONNECTED and self._relay_down_since is None:
                self._relay_down_since = time.monotonic()
        down_s = 0.0 if self._relay_down_since is None else time.monotonic() - self._relay_down_since
        # (until the relay's first version, waiting is given longer: at start the learner may not have published)
        wait_limit = self.relay_timeout_s * (1 if self._relay_delivered else RELAY_FIRST_FACTOR)
        if (down_s <= self.relay_timeout_s and waiting_s <= wait_limit) or self.learner_weights is None:
            return False
        why = (
            f"unreachable for {down_s:.0f} s"
            if down_s > self.relay_timeout_s
            else f"has not sent the weights this actor waits for in {waiting_s:.0f} s"
        )
        print(
            f"[{self.actor_id}] the weights relay at {self.weights_address} {why} (actor.relay_timeout_s="
            f"{self.relay_timeout_s:g}); taking weights from the learner at {self.learner_weights} from now on",
            flush=True,
        )
        self._drop_relay_monitor()
        self.weights.close(0)
        self.weights_address = None
        self.weights = self._socket(zmq.DEALER, self.learner_weights)
        if self.on_relay_lost is not None:
            self.on_relay_lost()
        return True

    def newest_weights(self, timeout_ms: int = 0) -> list | None:
        """The frames of the newest weights message that has arrived (waiting up to ``timeout_ms``
        for one), older ones dropped; None when there is none."""
        if self.weights is None or not self.weights.poll(timeout_ms):
            return None
        newest: list = [None]

        def keep(frames) -> None:
            newest[0] = frames

        drain(self.weights, keep, limit=64, on_error=lambda e: self.report_bad("weights", e))
        if newest[0] is not None and self.weights_address is not None:
            self._relay_delivered = True
        return newest[0]

    def _drop_relay_monitor(self) -> None:
        if self._relay_monitor is not None:
            self.weights.disable_monitor()
            self._relay_monitor.close(0)
            self._relay_monitor = None

    def close(self) -> None:
        self._drop_relay_monitor()
        if self._auth_monitor is not None:
            self.control.disable_monitor()
            self._auth_monitor.close(0)
            self._auth_monitor = None
        for s in (self.control, self.episodes, self.weights):
            if s is not None:
                s.close()
