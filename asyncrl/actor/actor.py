"""``asyncrl serve``: a rollout actor.

The actor connects to the learner's control address, is told the other addresses (``welcome``),
and then loops: take work credits -> make sure its weights are at least the credit's version ->
run the workflow on a batch of tasks -> push the episodes. With ``actor.weight_update: batch`` new
weights are applied only between generation batches, and every trajectory records the version that
produced it. With ``inflight`` (:meth:`Actor.run_inflight`) the engine generates continuously on this
thread, one decode step at a time, for up to ``actor.concurrent_batches`` batches whose workflows run on
rollout threads; new weights are applied between two decode steps, and every token records the
version that produced it.

Delivery: each episode is kept until the learner acknowledges that it is in its write-ahead log
(or rejects it as invalid: then it is dropped, with the reason printed). When the learner comes back
with a new session (it restarted), everything unacknowledged is resent; the learner de-duplicates
by episode id.

The protocol (sockets, hello/welcome, sessions, credits, ack and resend, the weight subscription)
is :class:`asyncrl.actor.link.ActorLink`; this module is the loop that generates.

Peers: a heartbeat thread (``asyncrl.actor.heartbeat``) keeps the actor's lease and says when the
learner is gone. A ``welcome`` means the learner holds no credits for this actor (it is new, or it
dropped the actor by its lease), so the actor's own count restarts at zero. Every message is
decoded into its typed body; a bad one is reported (rate-limited) and dropped, never fatal.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ..config import Config, SyncConfig, cpu_threads, deterministic_torch
from ..engine import make_engine
from ..envs.base import make_env
from ..envs.guard import EnvFailure
from ..envs.guard import request_stop as request_env_stop
from ..envs.tasks import task_stream
from ..models.loading import load_model, load_tokenizer, resolve_model_path
from ..rollout.workflow import RolloutContext, get_workflow
from ..timeline import StateClock
from ..types import Task
from ..weights import make_receiver
from ..weights.base import WeightsError, check_weight_values
from ..weights.digest import short, weights_digest
from ..wire.codec import decode
from ..wire.messages import Credit
from .heartbeat import Heartbeat
from .link import ActorLink

_WEIGHTS_ASK_S = 2.0  # while waiting for newer weights, ask the learner again this often


class Actor:
    def __init__(
        self, cfg: Config, control_address: str, actor_id: str, index: int = 0, weights_address: str | None = None
    ):
        self.cfg = cfg
        self.actor_id = actor_id
        self.seed = cfg.seed * 1_000_003 + 7919 * (index + 1)
        torch.set_num_threads(cpu_threads(cfg, "actor"))
        deterministic_torch(cfg)
        torch.manual_seed(self.seed)
        self.workflow = get_workflow(cfg.algorithm, cfg)
        model_dir = resolve_model_path(cfg.model, cfg.seed, warmstart_formats=type(self.workflow).warmstart_formats)
        self.tokenizer = load_tokenizer(model_dir, cfg.tasks.prompt_format)
        self.engine = make_engine(
            cfg, model_dir, self.tokenizer, lambda: load_model(model_dir, cfg.model.dtype, cfg.engine.device)
        )
        self.weights_in = make_receiver(cfg.sync, cfg.wire, actor_id)
        self.env = make_env(cfg.env)
        self.tasks = task_stream(cfg.tasks, self.seed)
        # the routing identity on the learner's sockets: the pid is public (ps), the random part is told only
        # to the learner, so no other process can take this actor's identity (and its acks and credits) over
        self.identity = f"{actor_id}:{os.getpid()}:{secrets.token_hex(8)}".encode()
        self.net = ActorLink(
            cfg.wire,
            control_address,
            actor_id,
            self.identity,
            on_credit=self._on_replay_work,
            on_welcome=self._on_welcome,
            weights_address=weights_address,
            relay_timeout_s=cfg.actor.relay_timeout_s,
            on_relay_lost=self._on_relay_lost,
        )
        self._waiting_since: float | None = None  # waiting for weights the credits need since
        self.heartbeat = Heartbeat(self, control_address)
        self._weights_session = None  # the learner session whose weights the engine holds
        self._applied_at: float | None = None  # when the engine last took new weights (unix time)
        self._stop_asked = False
        self.batches = 0
        self.weight_updates = 0
        self._gen_s = 0.0  # seconds generating (batch: in engine calls; inflight: in decode steps)
        self.clock = StateClock("waiting for the learner")  # where the time goes (sent in the heartbeat)
        self.started = time.time()
        # experience replay: tasks the learner assigned (task, fresh rollouts, replayed k), generated
        # before fresh ones, and task ids withheld from the fresh stream (the learner's skip set)
        self.assigned: deque[tuple[Task, int, int]] = deque()
        self.withheld: set[str] = set()
        # the learner's ledger: fresh tasks it dealt with the credits (and their tickets), and the tickets
        # of the batches being generated (said in a hello: the learner deals the others again)
        self.dealt: deque[tuple[Task, str]] = deque()
        self._generating: dict[int, list[str]] = {}
        # weight receipts (asyncrl.weights.digest): the digest of what the engine holds, by version
        self.weights_digest = ""
        self._digests: dict[int, str] = {}

    # -- what the heartbeat and the loop read -------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._stop_asked or self.net.stop_requested

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self._stop_asked = value

    @property
    def unacked(self):
        return self.net.unacked

    @property
    def credits(self) -> int:
        return self.net.credits

    @property
    def session(self) -> str | None:
        return self.net.session

    def _report_bad(self, channel: str, error: Exception) -> None:
        self.net.report_bad(channel, error)

    def holding(self) -> list[str]:
        """The tickets of the dealt tasks this actor will still deliver: its unacknowledged episodes'
        and the batches it is generating (read from the heartbeat's thread too)."""
        for _ in range(5):
            try:
                return sorted(
                    {t for tickets in list(self._generating.values()) for t in tickets} | set(self.net.tickets.values())
                )
            except RuntimeError:  # (changed while being read: read again)
                continue
        return []

    def hello(self) -> None:
        self.net.hello(self.cfg.actor.tasks_per_batch, self.engine.version, os.getpid(), self.holding())

    def _on_welcome(self, new_session: bool) -> None:
        """A welcome: the learner holds no assignments for this actor now; a new session (it
        restarted) also resends its skip set and is told which weights this actor holds."""
        self.assigned.clear()
        self.dealt.clear()  # (not started: the learner deals them again; see hello)
        if new_session:
            print(f"[{self.actor_id}] connected to the learner; asking for its weights", flush=True)
            self.withheld = set()
            self.ask_weights()

    # -- weights --------------------------------------------------------------------------------
    def _on_relay_lost(self) -> None:
        """The node's relay is gone (``ActorLink.check_relay``): the learner sends tensor frames
        (a relay always takes ``sync.type: zmq`` from it), so the receiver changes with the source."""
        self.weights_in.close()
        self.weights_in = make_receiver(SyncConfig(type="zmq"), self.cfg.wire, self.actor_id)
        if self.session is not None:
            self.ask_weights()

    def ask_weights(self) -> None:
        """Tell the learner which of its versions this actor holds (``subscribe``; -1: none, e.g.
        after it restarted: a resumed learner's versions may repeat numbers of a lost timeline). It
        sends anything newer, one version at a time, so this is also the acknowledgement that lets
        the next one go."""
        have = self.engine.version if self._weights_session == self.session else -1
        self.net.subscribe(have, self._applied_at)

    def apply_weights(self, timeout_ms: int = 0) -> bool:
        """Apply the newest weights that have arrived (waiting up to ``timeout_ms`` for some)."""
        newest = self.net.newest_weights(timeout_ms)  # only the newest version is applied
        if newest is None:
            return False
        left = self.clock.enter("applying weights")
        try:
            msg = decode(newest, kinds=("weights",))
            version, tensors = self.weights_in.tensors(msg)
            if version == self.engine.version and self._weights_session == self.session:
                return False  # (any other version is applied, older ones too: a resumed learner's)
            check_weight_values(tensors)  # (names and shapes: the engine checks them before it changes any)
            digest = self._received_digest(msg.body.digest, version, tensors)
            self.engine.update_weights(tensors, version)
            self._check_loaded(tensors, version, digest)
            self._weights_session = self.session
            self._applied_at = time.time()
        except Exception as e:  # noqa: BLE001 - bad weights (a wrong file, a shape mismatch) are dropped
            if isinstance(e, WeightsError) and "digest" in str(e):
                print(f"[{self.actor_id}] error: {e}", file=sys.stderr, flush=True)
            self._report_bad("weights", e)
            return False
        finally:
            self.clock.enter(left)
            if self.session is not None:
                self.ask_weights()
        self.weight_updates += 1
        if self.weight_updates == 1:  # (the first only: a version a step would be a line a step)
            print(f"[{self.actor_id}] weights version {version} applied; generating", flush=True)
        return True

    def _received_digest(self, published: str | None, version: int, tensors: dict) -> str:
        """The digest of what arrived; WeightsError (nothing loaded) when it is not the one the
        learner published for ``version``."""
        if not self.cfg.sync.digest:
            return ""
        got = weights_digest(tensors)
        if published and got != published:
            raise WeightsError(
                f"weights version {version} arrived with digest {short(got)}, but the learner published "
                f"{short(published)}: damaged on the way; not loaded, not generating with it"
            )
        return got

    def _check_loaded(self, tensors: dict, version: int, digest: str) -> None:
        """The engine holds exactly what arrived (an engine that can read its weights back:
        ``loaded_mismatch``), or WeightsError: this actor does not generate with the version."""
        problem = self.engine.loaded_mismatch(tensors) if hasattr(self.engine, "loaded_mismatch") else None
        if problem:
            self._weights_session = None  # (the engine's weights are not this session's version)
            self.weights_digest = ""
            raise WeightsError(
                f"weights version {version} (digest {short(digest)}) did not load: {problem}; not generating "
                f"with these weights"
            )
        self.weights_digest = digest
        if digest:
            self._digests[int(version)] = digest
            for old in sorted(self._digests)[:-64]:
                del self._digests[old]

    def _stamp(self, episodes: list, tickets: list[str | None]) -> None:
        """Each episode's ticket (the task the learner dealt) and the digests of the weight versions
        that generated its tokens."""
        for ep, ticket in zip(episodes, tickets):
            if ticket:
                ep.ticket = ticket
            versions = set()
            for t in ep.trajectories:
                if not t.is_replay:
                    versions.add(int(t.policy_version))
                    if t.token_versions is not None and len(t.token_versions):
                        versions.update(int(v) for v in np.unique(t.token_versions))
            ep.weights_digests = {str(v): self._digests[v] for v in sorted(versions) if v in self._digests}

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        """Generate until the learner says stop (or a signal, or ``actor.exit_after_learner_gone_s``:
        then SystemExit with the reason, exit code 1)."""
        if self.cfg.actor.weight_update == "inflight":
            return self.run_inflight()
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        self.heartbeat.start()
        self.hello()
        next_hello = time.time() + 1.0
        while not self.stopping:
            self.net.poll(timeout_ms=0 if self.credits else 100)
            self.net.check_relay()
            next_hello = self._hello_again(next_hello)
            if self.session is None:
                self.clock.enter("waiting for the learner")
                continue
            self.apply_weights(0)
            if not self.has_work():
                self.clock.enter("waiting for credits")
                continue
            if not self._weights_ok(100):
                continue
            self.generate_batch()
        self.close()
        if self.heartbeat.gone_reason:
            raise SystemExit(f"[{self.actor_id}] stopped: {self.heartbeat.gone_reason}")

    def _hello_again(self, next_hello: float) -> float:
        """Say hello again (at most once a second) while there is no welcome yet (learner not up, or
        our hello lost) or the heartbeat met a new learner whose welcome went astray (sent before
        this socket had reconnected); returns when the next one may go."""
        if (self.session is None or self.heartbeat.session not in (None, self.session)) and time.time() > next_hello:
            self.hello()
            return time.time() + 1.0
        return next_hello

    def _weights_ok(self, wait_ms: int) -> bool:
        """True when the engine holds this session's weights at the credits' ``min_version``; else
        ask for them (every few seconds) and wait up to ``wait_ms`` for them to arrive."""
        if self.engine.version >= self.net.min_version and self._weights_session == self.session:
            self._waiting_since = None
            return True
        self.clock.enter("waiting for weights")
        now = time.monotonic()
        self._waiting_since = self._waiting_since or now
        self.net.check_relay(now - self._waiting_since)
        if time.monotonic() - self.net.asked_weights_at > _WEIGHTS_ASK_S:
            self.ask_weights()
        self.apply_weights(wait_ms)
        return False

    def run_inflight(self) -> None:
        """``actor.weight_update: inflight``: this thread owns the engine and runs its decode steps;
        up to ``actor.concurrent_batches`` batches run their workflows on rollout threads, whose
        engine calls wait for the steps (a ``per_task`` workflow's batch as one rollout per task, each
        episode sent when its task is done). Between two steps: messages, new weights, new batches,
        finished episodes. A stop request lets the batches in flight finish (for at most 60 s)."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        self.engine.start_continuous(self.cfg.actor.kv_on_update)
        self.heartbeat.start()
        self.hello()
        next_hello = time.time() + 1.0
        running: list[tuple[Future, int, str | None]] = []  # (rollout, its tasks, the session it began in)
        # a per-task workflow rolls out each task on its own (its episode leaves as soon as it is done)
        size = 1 if self.workflow.per_task else self.cfg.actor.tasks_per_batch
        slots = self.cfg.actor.concurrent_batches * (self.cfg.actor.tasks_per_batch // size)
        if getattr(self.env, "drives_generation", False):  # agents: a batch per rollout thread, all of their
            size = self.cfg.actor.tasks_per_batch  # calls on one endpoint, each thread generating what is queued
            slots = self.cfg.actor.concurrent_batches
        pool = ThreadPoolExecutor(slots, thread_name_prefix=f"{self.actor_id}-rollout")
        stop_by = None
        try:
            while running or not self.stopping:
                if self.stopping and stop_by is None:
                    stop_by = time.monotonic() + 60.0
                if stop_by is not None and time.monotonic() > stop_by:
                    break
                self.net.poll(timeout_ms=0 if running or self.credits else 100)
                self.net.check_relay()
                next_hello = self._hello_again(next_hello)
                self.apply_weights(0)
                if (
                    not self.stopping
                    and self.session is not None
                    and self.has_work()
                    and len(running) < slots
                    and self._weights_ok(0)
                ):
                    batch = self._take_batch(size)
                    running.append((pool.submit(self._rollout_batch, *batch), len(batch[0]), self.session))
                t0 = time.time()
                if self.engine.step():
                    self._gen_s += time.time() - t0
                    self.clock.enter("generating", at=t0)
                else:
                    self.clock.enter("environment" if running else self._idle_state(), at=t0)
                    if running:
                        self.engine.batcher.wait_for_work(0.005)
                for item in [r for r in running if r[0].done()]:
                    running.remove(item)
                    self._send(item[0].result(), item[1], item[2])
        finally:
            self.engine.stop_continuous("the actor is stopping")
            pool.shutdown(wait=True, cancel_futures=True)
        self.close()
        if self.heartbeat.gone_reason:
            raise SystemExit(f"[{self.actor_id}] stopped: {self.heartbeat.gone_reason}")

    def _idle_state(self) -> str:
        """What an in-flight actor with no rollout running waits for."""
        if self.session is None:
            return "waiting for the learner"
        if not self.has_work():
            return "waiting for credits"
        return "waiting for weights"

    def _on_replay_work(self, body: Credit) -> None:
        """Replay fields of a credit message: assigned tasks and skip-set changes (typed and bounded
        by the decoder; an assignment with more rollouts than sampling.n is reported and dropped)."""
        if body.replay and not self.workflow.supports_replay:
            print(
                f"[{self.actor_id}] the learner assigned replay tasks but workflow "
                f"{self.cfg.algorithm!r} cannot take per-task rollout counts; generating them fresh",
                flush=True,
            )
        self.dealt.extend((d.task, d.ticket) for d in body.deal)
        for i, item in enumerate(body.replay):
            if item.n > self.cfg.sampling.n:
                self._report_bad(
                    "credit",
                    ValueError(f"replay task {i}: n={item.n}, expected at most sampling.n ({self.cfg.sampling.n})"),
                )
                continue
            self.assigned.append((item.task, item.n, item.k))
        w = body.withhold
        if w is not None:
            if w.reset:
                self.withheld = set()
            self.withheld.update(w.add)
            self.withheld.difference_update(w.remove)

    def _fresh_task(self) -> Task:
        """The next task of the stream that the learner does not withhold (fully solved); after
        1000 withheld ones in a row, the next one anyway (a small dataset may be all solved)."""
        for _ in range(1000):
            task = next(self.tasks)
            if task.id not in self.withheld:
                return task
        return next(self.tasks)

    def request_stop(self, *_args) -> None:
        """Stop after the current batch; guarded environment calls in flight give up at once."""
        self.stopping = True
        request_env_stop()

    def has_work(self) -> bool:
        """Credits, and (when the learner deals every task) tasks to spend them on."""
        return self.credits > 0 and (not self.net.deals or bool(self.assigned or self.dealt))

    def generate_batch(self) -> None:
        batch, session = self._take_batch(), self.session
        self.clock.enter("generating")
        t0 = time.time()
        episodes = self._rollout_batch(*batch)
        self._gen_s += time.time() - t0
        self._send(episodes, len(batch[0]), session)

    def _send(self, episodes: list | None, num_tasks: int, session: str | None) -> None:
        """Push a batch's episodes; a batch that failed as a whole did not spend its credits (given
        back unless a welcome has restarted the count since)."""
        if episodes is None:
            if session == self.session:
                self.net.use_credits(-num_tasks)
            return
        for ep in episodes:
            self.net.send_episode(ep)

    def _take_batch(self, size: int | None = None) -> tuple[list[Task], list[int], list, int, list]:
        """The next batch's tasks (at most ``size``, default ``actor.tasks_per_batch``; assigned
        replay tasks first, then the tasks the learner dealt, or this actor's own stream when it
        deals none), rollout counts, replay k's, seed and tickets; its credits are used now."""
        k = min(self.credits, size or self.cfg.actor.tasks_per_batch)
        if self.net.deals:
            k = min(k, len(self.assigned) + len(self.dealt))
        replay = self.workflow.supports_replay
        tasks, counts, ks, tickets = [], [], [], []
        while self.assigned and len(tasks) < k:
            task, n, kk = self.assigned.popleft()
            tasks.append(task)
            counts.append(n if replay else self.cfg.sampling.n)
            ks.append(kk if replay else None)
            tickets.append(None)
        while len(tasks) < k:
            task, ticket = self.dealt.popleft() if self.net.deals else (self._fresh_task(), None)
            tasks.append(task)
            counts.append(self.cfg.sampling.n)
            ks.append(None)
            tickets.append(ticket)
        seed = self.seed + 100_003 * self.batches
        self.batches += 1
        self.net.use_credits(k)
        return tasks, counts, ks, seed, tickets

    def _rollout_batch(
        self, tasks: list[Task], counts: list[int], ks: list, seed: int, tickets: list | None = None
    ) -> list | None:
        """The workflow's episodes for one batch (None when the environment failed the whole batch:
        its assigned replay and dealt tasks go back in the queue, and the caller gives its credits
        back), stamped with their tickets and weight digests."""
        ctx = RolloutContext(self.engine, self.tokenizer, self.env, self.cfg, self.actor_id, seed=seed)
        tickets = tickets or [None] * len(tasks)
        held = [t for t in tickets if t]
        if held:
            self._generating[seed] = held
        try:
            return self._rollout(tasks, counts, ks, ctx, tickets)
        finally:
            self._generating.pop(seed, None)

    def _rollout(self, tasks, counts, ks, ctx, tickets) -> list | None:
        try:
            if any(kk is not None for kk in ks):
                episodes = self.workflow.rollout(tasks, ctx, counts=counts)
                for ep, n, kk in zip(episodes, counts, ks):
                    if kk is not None:
                        ep.decision["replay"] = {"k": kk, "fresh": n}
            else:
                episodes = self.workflow.rollout(tasks, ctx)
        except EnvFailure as e:  # a workflow that cannot record it per conversation: redo the batch
            print(f"[{self.actor_id}] the environment failed a whole batch; generating it again: {e}", flush=True)
            for task, n, kk in reversed([x for x in zip(tasks, counts, ks) if x[2] is not None]):
                self.assigned.appendleft((task, n, kk))
            for task, ticket in reversed([x for x in zip(tasks, tickets) if x[1]]):
                self.dealt.appendleft((task, ticket))
            return None
        self._stamp(episodes, tickets)
        return episodes

    def close(self) -> None:
        print(
            f"[{self.actor_id}] stopping: {self.batches} batches generated, {self.weight_updates} weight "
            f"updates, {len(self.net.unacked)} episodes not acknowledged",
            flush=True,
        )
        self.heartbeat.stop()  # its last status says stopping
        self.net.close()
        self.weights_in.close()
