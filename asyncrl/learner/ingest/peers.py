"""The learner's dealings with peers it does not trust: episode validation, the ingest step
(validate -> write-ahead log -> acknowledge), control messages, leases, and rate-limited reports.

Promises (docs/design/events.md, "Peers that misbehave"):
- An episode is checked completely (:class:`EpisodeValidator`) before it is written to the WAL and
  acknowledged. An invalid one is never written and never acknowledged as kept: the actor's ``ack``
  lists it under ``rejected`` with the reason, and the actor drops it (it would be rejected again).
- No message stops the learner: a failure while handling one message rejects that message only
  (``bad_messages``); only an OSError (a full disk, a permission error) escapes, for the learner to
  stop cleanly.
- Reports are rate-limited (:class:`RateLimitedLog`): the first ``wire.bad_log_first`` of each
  reason are printed and written as events, the rest are counted and summarised every
  ``wire.bad_log_every_s`` seconds in one ``messages_suppressed`` event.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter, defaultdict
from typing import Callable, Protocol

import msgspec
import numpy as np

from ...timeline import MAX_SPANS
from ...weights.digest import short
from ...wire.codec import Message, WireError
from ...wire.messages import Rejected
from .actors import ActorState, ActorTable, credit_timeout_s
from .server import Arrival, Housekeeping, Limits

_REASON_CHARS = 300  # a rejection reason sent back to the actor (the Ack field allows 1024)


class EpisodeValidator:
    """Semantic checks of a decoded episode (its types and array sizes were checked by
    ``asyncrl.wire.codec.decode``): what the trainer and the run log rely on."""

    def __init__(self, vocab_size: int, limits: Limits):
        self.vocab_size = vocab_size
        self.limits = limits

    def check(self, arrival: Arrival, version: int) -> tuple[str, str] | None:
        """``(reason, explanation)`` for the first problem of the episode, or None when it may be
        trained by a learner at ``version``. Vectorised over the concatenated arrays."""
        ep, arrays = arrival.episode, arrival.arrays
        trajs = ep.trajectories
        if len(trajs) > self.limits.max_trajectories:
            return "too_many_trajectories", (
                f"{len(trajs)} trajectories; at most {self.limits.max_trajectories} (wire.max_trajectories_per_episode)"
            )
        if not trajs:
            v = ep.decision.get("policy_version", 0)
            if type(v) is not int or not 0 <= v <= version:
                return "version", f"decision.policy_version {v!r}; expected an int in [0, {version}]"
            return None
        return (
            self._check_lengths(trajs)
            or self._check_tokens(arrays)
            or self._check_floats(trajs, arrays)
            or self._check_versions(trajs, version)
        )

    def _check_lengths(self, trajs) -> tuple[str, str] | None:
        lengths = [len(t.token_ids) for t in trajs]
        if min(lengths) == 0:
            return "empty_trajectory", f"trajectory {lengths.index(0)} has no tokens"
        if max(lengths) > self.limits.max_tokens:
            return "too_long", (
                f"a trajectory of {max(lengths)} tokens; at most {self.limits.max_tokens} "
                f"(wire.max_tokens_per_trajectory)"
            )
        return None

    def _check_tokens(self, arrays) -> tuple[str, str] | None:
        ids = arrays["token_ids"]
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            return "token_range", f"token id {bad}; expected ids in [0, {self.vocab_size}) (the model's vocabulary)"
        for name in ("loss_mask", "exp_mask"):
            if name in arrays and arrays[name].size and int(arrays[name].max()) > 1:
                return "mask_values", f"{name} holds {int(arrays[name].max())}; expected 0 or 1"
        return self._check_routing(arrays.get("routing"))

    def _check_routing(self, routing) -> tuple[str, str] | None:
        """Routing replay's expert indices: the model's width, each in [-1, num_experts)."""
        if routing is None or not routing.size:
            return None
        width, experts = self.limits.routing_width, self.limits.num_experts
        if not width:
            return "routing", (
                "routing recorded, but this learner replays none (model.routing_replay is off, or its model has "
                "no expert routers); expected none"
            )
        if routing.shape[1] != width:
            return "routing", f"routing rows of {routing.shape[1]} entries; expected {width} (routed layers x top_k)"
        lo, hi = int(routing.min()), int(routing.max())
        if lo < -1 or hi >= experts:
            return "routing", f"expert index {lo if lo < -1 else hi}; expected -1 (none) or an expert in [0, {experts})"
        return None

    @staticmethod
    def _check_floats(trajs, arrays) -> tuple[str, str] | None:
        for name in ("behavior_logprobs", "recorded_logprobs"):
            a = arrays.get(name)
            if a is not None and a.size:
                if not np.isfinite(a).all():
                    return "nonfinite", f"{name} holds NaN or infinity"
                if float(a.max()) > 1e-3:
                    return "logprob_positive", f"{name} holds {float(a.max()):.4g}; log-probs are <= 0"
        values = [t.reward for t in trajs] + [t.advantage for t in trajs if t.advantage is not None]
        values += [v for t in trajs for v in t.scores.values() if v.__class__ is float]
        if not all(map(math.isfinite, values)):
            return "nonfinite", "a reward, advantage or score is NaN or infinite"
        return None

    @staticmethod
    def _check_versions(trajs, version: int) -> tuple[str, str] | None:
        versions = [t.policy_version for t in trajs]
        if max(versions) > version:
            return "future_version", (
                f"policy_version {max(versions)} is newer than the learner's "
                f"{version} (weights it never published, or a learner resumed "
                f"from an older checkpoint)"
            )
        if min(versions) < 0:
            return "version", f"policy_version {min(versions)}; expected >= 0"
        for i, t in enumerate(trajs):
            if t.token_versions is None:
                continue
            lo, hi = t.version_range()
            if hi > version:
                return "future_version", (
                    f"trajectory {i}: token_versions reach {hi}, newer than the learner's {version}"
                )
            if lo != t.policy_version or int(t.token_versions.min()) < lo:
                return "version", (
                    f"trajectory {i}: policy_version {t.policy_version} but its tokens' versions "
                    f"span {int(t.token_versions.min())}..{hi}; expected policy_version to be "
                    f"the oldest generated token's version, and no token older"
                )
        return None


class RateLimitedLog:
    """Reports of one kind of trouble (rejected messages, dropped actors, ...) that a peer can cause
    at any rate: per ``(kind, reason)``, the first ``first`` are printed and written as events
    one by one; later ones are counted and summarised at most every ``every_s`` seconds."""

    def __init__(self, event: Callable[..., None], first: int, every_s: float, prefix: str = "[learner]"):
        self.event, self.first, self.every_s, self.prefix = event, first, every_s, prefix
        self.seen: Counter[str] = Counter()
        self.pending: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        self._last_flush = time.monotonic()

    def report(self, kind: str, reason: str, text: str, **fields) -> None:
        key = f"{kind}:{reason}"
        self.seen[key] += 1
        if self.seen[key] <= self.first:
            tail = " (further ones are counted)" if self.seen[key] == self.first else ""
            print(f"{self.prefix} {kind} ({reason}): {text}{tail}", flush=True)
            self.event(kind, reason=reason, error=text, **fields)
        else:
            self.pending[key] += 1
            self.examples[key] = text

    def flush(self, force: bool = False) -> None:
        """Write the summary of what was counted since the last one, when ``every_s`` has passed."""
        now = time.monotonic()
        if not self.pending or (not force and now - self._last_flush < self.every_s):
            return
        counts, examples = dict(self.pending), {k: self.examples[k] for k in self.pending}
        window = now - self._last_flush
        self.pending.clear()
        self.examples.clear()
        self._last_flush = now
        print(
            f"{self.prefix} in the last {window:.0f} s, also: "
            + ", ".join(f"{n} x {k}" for k, n in sorted(counts.items())),
            flush=True,
        )
        self.event("messages_suppressed", seconds=round(window, 3), counts=counts, examples=examples)


class PeerLink(Protocol):
    """What :class:`Peers` needs of the learner's network (:class:`asyncrl.learner.ingest.server.LearnerServer`),
    and nothing more: arrivals and control messages, the actors' accounting, acknowledgements, upkeep."""

    def poll(self, timeout_ms: int) -> tuple[list[Arrival], list[tuple[bytes, Message]]]: ...

    def handle_control(self, identity: bytes, msg: Message) -> ActorState: ...

    def take_undecodable(self) -> list[tuple[str, str, WireError]]: ...

    actors: ActorTable  # received_from (credits used), delivered (progress)

    def ack(self, by_actor: dict[str, list[str]], rejected: dict[str, list[Rejected]] | None = None) -> None: ...

    def housekeeping(self) -> Housekeeping: ...

    def has_actors(self) -> bool: ...


class Peers:
    """One ``pump`` of the wire for the learner: ingest episodes (validate, WAL, acknowledge),
    handle control messages, expire leases, report refused CURVE clients. ``stop_reason`` is set
    when ``train.exit_after_no_actors_s`` has passed with no actor."""

    def __init__(self, cfg, net: PeerLink, buffer, event: Callable[..., None], vocab_size: int, limits: Limits):
        self.cfg, self.net, self.buffer, self.event = cfg, net, buffer, event
        self.validator = EpisodeValidator(vocab_size, limits)
        self.reports = RateLimitedLog(event, cfg.wire.bad_log_first, cfg.wire.bad_log_every_s)
        self.bad_messages = 0
        self.rejected_episodes = 0
        self.ingested = 0
        self.ingest_bytes = 0
        self.ingest_s = 0.0  # validate, WAL (fsync), ack; with net.decode_s: the whole ingest
        self.stop_reason: str | None = None
        self._no_actor_since = time.monotonic()
        self._status_logged: dict[bytes, float] = {}
        self._spans: dict[bytes, list] = {}  # timeline spans of statuses not logged yet (at most one a second)
        # version -> the digest the learner published for it (``asyncrl.weights.digest``; the learner fills it)
        self.digests: dict[int, str] = {}
        self.ledger = None  # the learner's TaskLedger (asyncrl.learner.ledger), told what arrives and what is refused
        self._digest_said: set[tuple[str, int]] = set()  # (actor, version) whose wrong heartbeat digest was said

    def bad_message(self, channel: str, error: Exception) -> None:
        """A message that could not be received, decoded or handled (``LearnerServer.on_bad_message``)."""
        self.bad_messages += 1
        reason = getattr(error, "reason", None) or type(error).__name__
        text = str(error) if isinstance(error, WireError) else f"{type(error).__name__}: {error}"
        self.reports.report("bad_message", f"{channel}:{reason}", text[:2000], channel=channel)

    def pump(self, timeout_ms: int, version: int) -> None:
        arrivals, control = self.net.poll(timeout_ms)
        for identity, msg in control:  # first: a hello that came with episodes admits their actor
            self._control(identity, msg, version)
        t0 = time.perf_counter()
        self._ingest(arrivals, version)
        self.ingest_s += time.perf_counter() - t0
        self._report(self.net.housekeeping())
        self._watch_actors()
        self.reports.flush()

    def _report(self, news: Housekeeping) -> None:
        wire = self.cfg.wire
        for a in news.dropped:
            self._status_logged.pop(a.identity, None)
            self._spans.pop(a.identity, None)
            self.reports.report(
                "actor_dropped",
                "lease",
                f"{a.actor_id} was silent for more than "
                f"{wire.lease_s:g} s (wire.lease_s); its {a.outstanding} credits "
                f"return to the pool",
                actor_id=a.actor_id,
                outstanding=a.outstanding,
            )
        for a, n in news.reclaimed:
            self.reports.report(
                "credits_reclaimed",
                "no_progress",
                f"{a.actor_id} held {n} credits, generated "
                f"no token and delivered no episode for {credit_timeout_s(wire):g} s (wire.credit_timeout_s); "
                f"they return to the pool and it gets one at a time until it delivers",
                actor_id=a.actor_id,
                outstanding=n,
            )
        for a in news.evicted:
            self._status_logged.pop(a.identity, None)
            self._spans.pop(a.identity, None)
            self.reports.report(
                "actor_dropped",
                "evicted",
                f"{a.actor_id} (never delivered an episode) made room in the full actor table for an actor that did",
                actor_id=a.actor_id,
                outstanding=a.outstanding,
            )
        for key, _ in news.denied:
            self.reports.report(
                "connection_refused",
                "curve_key",
                f"a CURVE client with key {key} is not in the server's authorized keys",
                client_key=key,
            )

    def _ingest(self, arrivals: list[Arrival], version: int) -> None:
        """Validate, write (WAL, fsync once) and acknowledge; invalid episodes are rejected."""
        acks: dict[str, list[str]] = defaultdict(list)
        rejected: dict[str, list[Rejected]] = defaultdict(list)
        for actor_id, eid, err in self.net.take_undecodable():  # (reported as bad messages already)
            self.rejected_episodes += 1
            rejected[actor_id].append(Rejected(id=eid, reason=f"{err.reason}: {err}"[:_REASON_CHARS]))
        for arrival in arrivals:
            ep = arrival.episode
            self.net.actors.received_from(ep.actor_id, 1)
            try:
                problem = self.validator.check(arrival, version)
            except (ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
                problem = ("invalid", f"{type(e).__name__}: {e}")
            problem = problem or self._check_digests(ep)
            if problem is not None:
                self._reject(ep, *problem, rejected)
                if self.ledger is not None:
                    self.ledger.refused(ep, problem[0], version)
                continue
            acks[ep.actor_id].append(ep.id)
            if self._write(ep, arrival.frames):
                if self.ledger is not None and not self.ledger.arrived(ep, version):
                    self.buffer.discard(ep.id)  # (its task's slot has an episode already: recorded, not trained)
                self.ingested += 1
                self.ingest_bytes += sum(memoryview(f).nbytes for f in arrival.frames)
                self.net.actors.delivered(ep.actor_id, 1)  # (progress: valid and in the buffer, nothing less)
            else:
                self.reports.report(
                    "duplicate_episode",
                    "duplicate",
                    f"episode {ep.id} from {ep.actor_id} is already in the buffer (a resend)",
                    episode_id=ep.id,
                    actor_id=ep.actor_id,
                )
        self._write(None, None)
        self.net.ack(acks, rejected)

    def _check_digests(self, ep) -> tuple[str, str] | None:
        """The episode's weight receipts: each version's digest must be the one published for it
        (a version this learner has no digest of, e.g. from before a resume, is taken unchecked)."""
        for v, digest in ep.weights_digests.items():
            want = self.digests.get(int(v)) if v.isdigit() else None
            if want is not None and digest != want:
                return "weights_digest", (
                    f"generated with weights of digest {short(digest)} as version {v}, but the learner published "
                    f"{short(want)} for it: the actor's engine does not hold the weights it says it does"
                )
        return None

    def _write(self, episode, frames) -> bool:
        """``buffer.add`` (or ``buffer.sync`` without an episode); a failed write names the WAL's
        directory (an OSError from os.write carries no file name) and is raised."""
        try:
            return self.buffer.add(episode, frames) if episode is not None else self.buffer.sync()
        except OSError as e:
            e.filename = e.filename or f"the write-ahead log in {self.buffer.dir}"
            raise

    def _reject(self, ep, reason: str, text: str, rejected: dict) -> None:
        self.rejected_episodes += 1
        rejected[ep.actor_id].append(Rejected(id=ep.id, reason=f"{reason}: {text}"[:_REASON_CHARS]))
        self.reports.report(
            "episode_rejected",
            reason,
            f"episode {ep.id} from {ep.actor_id}: {text}",
            episode_id=ep.id,
            actor_id=ep.actor_id,
        )

    def _control(self, identity: bytes, msg, version: int) -> None:
        # a heartbeat from an actor the table does not know admits it (with a welcome) as a hello does
        admitted = msg.kind == "hello" or (
            msg.kind == "status" and msg.body.identity.encode() not in self.net.actors.states
        )
        try:
            state = self.net.handle_control(identity, msg)
        except WireError as e:
            self.bad_message("control", e)
            return
        now = time.monotonic()
        if admitted and self.ledger is not None:  # (its queue of dealt tasks is emptied by the welcome)
            self.ledger.hello(msg.body.actor_id, state.identity, msg.body.holding, version)
        if msg.kind == "status" and msg.body.weights_digest:
            self._check_status_digest(msg.body)
        if msg.kind != "status":
            return
        pending = self._spans.setdefault(state.identity, [])
        pending.extend(msg.body.spans)
        del pending[: max(len(pending) - MAX_SPANS, 0)]
        if now - self._status_logged.get(state.identity, 0.0) >= 1.0:
            self._status_logged[state.identity] = now  # at most one actor_status event a second
            fields = msgspec.structs.asdict(msg.body)
            fields.pop("identity")
            fields["spans"] = [list(s) for s in pending]  # (with those of the statuses not logged since)
            pending.clear()
            self.event("actor_status", **fields)

    def _check_status_digest(self, status) -> None:
        """A heartbeat whose weights digest is not the one published for its version: one line, once
        per actor and version (its episodes are refused by :meth:`_check_digests`)."""
        want = self.digests.get(status.version)
        key = (status.actor_id, status.version)
        if want is None or status.weights_digest == want or key in self._digest_said:
            return
        self._digest_said.add(key)
        text = (
            f"{status.actor_id} holds weights of digest {short(status.weights_digest)} as version {status.version}, "
            f"but the learner published {short(want)}: its episodes of that version are refused"
        )
        print(f"[learner] error: {text}", file=sys.stderr, flush=True)
        self.event("weights_mismatch", actor_id=status.actor_id, weights_version=status.version, message=text)

    def _watch_actors(self) -> None:
        limit = self.cfg.train.exit_after_no_actors_s
        now = time.monotonic()
        if self.net.has_actors():
            self._no_actor_since = now
        elif limit is not None and self.stop_reason is None and now - self._no_actor_since > limit:
            self.stop_reason = f"no actor for {limit:g} s (train.exit_after_no_actors_s); stopping after a checkpoint"
