"""The actor's heartbeat: a thread with a control socket of its own.

Every ``actor.heartbeat_s`` it sends the actor's ``status`` (which renews the actor's lease on the
learner, ``wire.lease_s``) and reads the learner's ``alive`` answers. Being a thread, it keeps the
lease while the main thread spends minutes in one generation batch (the engine releases the GIL in
its tensor operations). It is also the actor's ear for a learner that went away: after
``actor.learner_timeout_s`` without an answer it says so, once and then every ten times as long;
when the learner answers again it says that too; and with ``actor.exit_after_learner_gone_s`` set it
asks the actor to stop.
"""

from __future__ import annotations

import os
import threading
import time

import zmq

from ..wire.codec import decode, encode
from ..wire.messages import Status
from ..wire.sockets import apply_curve_client, connect, drain, send_frames


class Heartbeat(threading.Thread):
    def __init__(self, actor, address: str):
        super().__init__(daemon=True, name=f"{actor.actor_id}-heartbeat")
        self.actor, self.address = actor, address
        cfg = actor.cfg.actor
        self.interval, self.timeout, self.exit_after = (
            cfg.heartbeat_s,
            cfg.learner_timeout_s,
            cfg.exit_after_learner_gone_s,
        )
        self.last_word = time.monotonic()
        self.session: str | None = None
        self.gone_reason: str | None = None
        self._warned_at: float | None = None
        self._halt = threading.Event()

    def stop(self, timeout: float = 5.0) -> None:
        """Send a last status (``stopping``) and end the thread."""
        self._halt.set()
        if self.is_alive():
            self.join(timeout)

    def run(self) -> None:
        sock = self._socket()
        next_beat = 0.0
        try:
            while not self._halt.is_set():
                # the first status goes out as soon as the connection is up, then every interval
                if time.monotonic() >= next_beat and sock.poll(100, zmq.POLLOUT):
                    self._send(sock)
                    next_beat = time.monotonic() + self.interval
                drain(sock, self._on_reply, limit=100, on_error=lambda e: None)
                self._watch()
                self._halt.wait(min(0.1, self.interval))
            if sock.poll(500, zmq.POLLOUT):
                self._send(sock)  # the last one says stopping
        finally:
            sock.close(linger=500)

    def _socket(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.actor.identity + b":hb")  # (secret like the actor's own)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queue of stale heartbeats for a learner that is down
        sock.setsockopt(zmq.SNDHWM, 1)
        if self.actor.cfg.wire.curve_dir:
            apply_curve_client(sock, self.actor.cfg.wire.curve_dir, self.actor.actor_id)
        connect(sock, self.address)
        return sock

    def _send(self, sock: zmq.Socket) -> None:
        a = self.actor
        spans, states = a.clock.take()
        status = Status(
            actor_id=a.actor_id,
            identity=a.identity.decode(),
            pid=os.getpid(),
            capacity=a.cfg.actor.tasks_per_batch,
            version=max(a.engine.version, -1),
            batches=a.batches,
            weight_updates=a.weight_updates,
            unacked=len(a.unacked),
            credits=max(a.credits, 0),
            generate_s=a._gen_s,
            up_s=time.time() - a.started,
            tokens=int(getattr(a.engine, "tokens_generated", 0)),
            stopping=a.stopping,
            weights_digest=a.weights_digest,
            holding=a.holding(),
            spans=[(state, start, end) for state, start, end in spans],
            states=states,
        )
        try:
            send_frames(sock, encode("status", status), flags=zmq.NOBLOCK)
        except zmq.Again:  # not connected (the learner is down): nothing to queue (its spans go with the next)
            a.clock.put_back(spans)

    def _on_reply(self, frames) -> None:
        msg = decode(frames, kinds=("alive", "stop"))
        if msg.kind == "stop":  # (a revoked key: the learner answers whichever socket spoke)
            if not self.actor.stopping:
                print(f"[{self.actor.actor_id}] the learner stopped this actor: {msg.body.reason}", flush=True)
            self.actor.stopping = True
            return
        now = time.monotonic()
        if self._warned_at is not None:
            print(
                f"[{self.actor.actor_id}] the learner is back (session {msg.body.session[:8]}) after "
                f"{now - self.last_word:.0f} s without word",
                flush=True,
            )
            self._warned_at = None
        self.last_word, self.session = now, msg.body.session

    def _watch(self) -> None:
        now = time.monotonic()
        silent = now - self.last_word
        if silent >= self.timeout and (self._warned_at is None or now - self._warned_at >= 10 * self.timeout):
            self._warned_at = now
            until = (
                f"exiting after {self.exit_after:g} s (actor.exit_after_learner_gone_s)"
                if self.exit_after
                else "stop with Ctrl-C"
            )
            print(
                f"[{self.actor.actor_id}] no word from the learner at {self.address} for {silent:.0f} s; "
                f"waiting for it to come back (a restarted learner resumes; {len(self.actor.unacked)} "
                f"unacknowledged episodes are kept for it) - {until}",
                flush=True,
            )
        if self.exit_after is not None and silent >= self.exit_after and self.gone_reason is None:
            self.gone_reason = (
                f"no word from the learner at {self.address} for {silent:.0f} s "
                f"(actor.exit_after_learner_gone_s={self.exit_after:g}); "
                f"{len(self.actor.unacked)} unacknowledged episodes dropped"
            )
            self.actor.stopping = True  # the main loop ends after its batch
