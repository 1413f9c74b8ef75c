"""``asyncrl learn``: the learner process.

The loop reads like the architecture diagram: pump the wire (ingest episodes into the WAL-backed
buffer, acknowledge, grant credits) -> take a batch within the staleness bound -> advantages,
proximal log-probs, loss, AdamW -> version += 1 -> publish weights -> metrics, events, checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from ..config import Config, cpu_threads, deterministic_torch
from ..engine.routing import routing_limits
from ..envs.guard import request_stop as request_env_stop
from ..models.lora import adapter_tensors, is_lora, require_peft
from ..objectives.advantages import informative
from ..rollout.workflow import workflow_class
from ..rundir import provenance
from ..rundir.layout import ADDRESSES, EVENTS, STOP_REASON, STOPPING, buffer_dir, checkpoint_step, list_checkpoints
from ..rundir.runlog import RunLog, check_trackers, open_trackers, read_jsonl
from ..types import Episode
from ..weights import make_publisher
from ..weights.digest import weights_digest
from ..wire.sockets import check_wire, socket_dir
from .archive import EpisodeArchive
from .checkpoint import save_checkpoint, write_critic
from .evaluate import EvaluationHung, Evaluator
from .experience import ExperiencePool, ReplayHook
from .hooks import LearnerHook
from .ingest.buffer import EpisodeQueue
from .ingest.peers import Peers
from .ingest.server import LearnerServer, Limits
from .ingest.staleness import StalenessPolicy
from .ledger import TaskLedger, make_ledger
from .progress import Progress, summary_table
from .startup import Startup
from .telemetry import Telemetry
from .trace import TokenTrace
from .training.mismatch import LaggedMismatch, merge_mismatch
from .training.ranks import Ranks, load_trainable
from .training.trainer import StepAbandoned

_DIGESTS_KEPT = 256  # versions whose published digest the learner keeps (checkpointed with it)


def _informative_episode(episode: Episode) -> bool:
    """Dynamic sampling (``buffer.filter_groups``): an episode is trained on when one of its groups has
    different rewards (:func:`asyncrl.objectives.advantages.informative`)."""
    return informative(episode.trajectories)


def _preflight(cfg: Config) -> None:
    """What would fail later, said in one line before the model builds."""
    check_trackers(cfg.log.trackers)  # a missing tracker library
    if cfg.model.lora is not None:
        require_peft()  # likewise peft for model.lora (the actors do not need it)
    check_wire(cfg.wire)  # a public address (or a TCP port) without keys


class Learner:
    def __init__(self, cfg: Config, overwrite: bool = False, ranks: Ranks | None = None):
        """Claim the run directory (``asyncrl.rundir.claim``: refused before anything is written if it is
        locked or holds a run that ``cfg.checkpoint.resume`` does not continue; ``overwrite`` deletes
        the old run first), build the model, then resume from the plan's checkpoint and WAL.

        ``ranks``: rank 0's handle on a group of learner processes (``asyncrl.learner.training.ranks``);
        by default one process."""
        self.cfg = cfg
        self.staleness = StalenessPolicy.from_config(cfg)  # credits, the buffer's drop rule, token truncation
        self.ranks = ranks or Ranks(None, "none")
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cpu_threads(cfg, "learner"))
        self.run_dir = cfg.run_dir
        _preflight(cfg)
        self.start = Startup(cfg, overwrite)  # claims the run dir: nothing is written before this
        workflow = workflow_class(cfg.algorithm)
        self.counts_for_reward = workflow.counts_for_reward  # which trained rows reward_mean averages
        model, self.tokenizer, self.model_dir = load_trainable(cfg)  # (model.lora: adapters on it)
        self.trainer = self.ranks.start(cfg, model, self.tokenizer, self.staleness)
        self.model = self.ranks.plain  # the full, current weights: published, evaluated, saved
        self.lagged = self._lagged_mismatch(cfg)  # train.mismatch_rows: older versions' weights, for mismatch
        self.buffer = EpisodeQueue(buffer_dir(self.run_dir), cfg.buffer.capacity)
        self.version, self.bad_messages = 0, 0
        self.weights_out = make_publisher(cfg.sync, self.run_dir, cfg.wire)
        self._open_wire(cfg)  # the sockets, the run log (and its trackers), the peers' intake
        self.hooks: list[LearnerHook] = _make_hooks(cfg, self.staleness, self.log.event)
        self.ledger = self._open_ledger(cfg)  # (the last hook: it deals what the others leave of the credits)
        self.telemetry = Telemetry(cfg, self.log, self.net.publish_event, self.model, self.tokenizer)
        self.trace = TokenTrace(self.trainer, self.model, self.tokenizer, cfg.log)  # token_trace events
        self.evaluator = Evaluator(cfg, self.tokenizer)
        self.heldout = _describe_heldout(cfg)
        for warning in self.evaluator.workflow.warnings:  # e.g. algo.sandbox.isolation: none
            self.log.event("warning", self.version, source=cfg.algorithm, message=warning)
        self._stop, self._stop_reason = False, None  # (the reason: a stop the user asked for in the config)
        self.trainer.should_stop = lambda: self._stop  # a stop gives up a long step instead of waiting for it
        self.trainer.tick = self._tick  # heartbeats answered, episodes taken in, during a long step
        self._abandoned: int | None = None  # episodes of the step a stop gave up (back in the buffer)
        self._checkpoint_s: float | None = None  # how long the last checkpoint took to write
        (self.run_dir / STOPPING).unlink(missing_ok=True)
        self._keep = _informative_episode if cfg.buffer.filter_groups else None  # dynamic sampling's rule
        self._last_tick = 0.0
        self.empty_steps = 0  # steps of this learner with no trajectory to train on (not counted as trained)
        self.version, state, report = self.start.restore(
            self.model, self.ranks.load, self.hooks, self.buffer, self.peers.validator, critic=self.trainer.critic_model
        )
        self.rewards_per_step: list[float] = list(state.get("rewards_per_step", []))
        self.peers.digests.update({int(v): d for v, d in state.get("weights_digests", {}).items()})
        if self.version:  # a resumed run: its summary starts at the run's start, not at the resume point
            self.evaluator.resumed(self._earlier_evaluations())
        self.start.flush(self.log, self.version, len(self.buffer), report)
        self.archive = self._reproducibility()
        self.buffer.open_wal(self.version)
        self._resume_ledger()
        (self.run_dir / ADDRESSES).write_text(json.dumps(self.net.addresses, indent=1))

    def _open_wire(self, cfg: Config) -> None:
        """The learner's side of the wire (:class:`LearnerServer`, binding its sockets where a resumed
        learner had them), the run log that publishes every event on it, and :class:`Peers`, which
        validates, stores and acknowledges what arrives."""
        self.net = LearnerServer(
            cfg.wire,
            self._on_bad_message,
            previous=self.start.previous_addresses(),
            limits=Limits.from_config(
                cfg.wire,
                getattr(self.model.config, "max_position_embeddings", None),
                routing_limits(self.model, cfg.model.routing_replay),
            ),
            sock_dir=None if cfg.wire.curve_dir else socket_dir(self.run_dir),
        )
        self.log = RunLog(
            self.run_dir,
            on_event=self.net.publish_event,
            trackers=open_trackers(
                cfg.log.trackers,
                self.run_dir,
                cfg.name,
                cfg.log.project,
                cfg.model_dump(mode="json"),
                resume=self.start.plan.mode == "resume",
            ),
        )
        self.peers = Peers(
            cfg,
            self.net,
            self.buffer,
            lambda kind, **f: self.log.event(kind, self.version, **f),
            vocab_size=self.model.get_input_embeddings().num_embeddings,
            limits=self.net.limits,
        )

    def _open_ledger(self, cfg: Config) -> TaskLedger | None:
        """``tasks.ledger``: the learner deals every fresh task (``asyncrl.learner.ledger``), told by the
        peers what arrives and is refused, by the buffer what it drops, by replay what is solved."""
        ledger = make_ledger(cfg, lambda kind, version, **f: self.log.event(kind, version, **f))
        if ledger is None:
            return None
        for hook in self.hooks:
            if isinstance(hook, ReplayHook) and cfg.replay.withhold_solved:
                ledger.withheld = lambda m=hook.manager: m.solved
        self.hooks.append(ledger)
        self.peers.ledger = ledger
        self.buffer.on_drop = ledger.dropped
        self.net.deals = True
        return ledger

    def _lagged_mismatch(self, cfg: Config) -> LaggedMismatch | None:
        """``train.mismatch_rows``: the published weights of older versions, kept to measure the
        mismatch on their tokens (``asyncrl.learner.training.mismatch``); None when off."""
        if not cfg.train.mismatch_rows:
            return None
        t = cfg.train
        return LaggedMismatch(self.trainer, self.model, t.mismatch_versions, t.mismatch_rows, t.mismatch_budget)

    def _resume_ledger(self) -> None:
        """After the restore: the ledger's record cut back to its checkpoint, the buffer's episodes
        (the checkpoint's and the WAL's) taken in as deliveries."""
        if self.ledger is not None:
            self.ledger.open_log(self.version)
            self.ledger.recovered(self.buffer, self.version)

    def _earlier_evaluations(self) -> list[dict]:
        """The run log's evaluations up to the resumed version (what the run's summary compares)."""
        return [
            {k: v for k, v in e.items() if k not in ("schema", "kind", "t", "step")}
            for e in read_jsonl(self.run_dir / EVENTS)
            if e.get("kind") == "eval" and (e.get("version") or 0) <= self.version
        ]

    def _reproducibility(self) -> EpisodeArchive | None:
        """``train.deterministic``'s torch settings; record the run's provenance (on a resume: warn of each
        difference); open the episode archive when ``log.archive_episodes`` asks for it."""
        cfg = self.cfg
        deterministic_torch(cfg)  # (before the first step and the first evaluation)
        for change in provenance.record(self.run_dir, resumed=self.start.plan.mode == "resume"):
            message = f"this run was made with another setup: {change} (provenance.json)"
            print(f"[learner] warning: {message}", file=sys.stderr, flush=True)
            self.log.event("warning", self.version, source="provenance", message=message)
        if not cfg.log.archive_episodes:
            return None
        meta = {
            "seed": cfg.seed,
            "threads": torch.get_num_threads(),
            "distributed": cfg.train.distributed,
            "torch": torch.__version__,
        }
        return EpisodeArchive(
            self.run_dir,
            cfg.log.archive_max_gb,
            self.version,
            meta,
            warn=lambda m: self.log.event("warning", self.version, source="log.archive_episodes", message=m),
        )

    # -- lifecycle ------------------------------------------------------------------------------
    def _on_bad_message(self, channel: str, error: Exception) -> None:
        """A peer's message that was refused (``asyncrl.learner.ingest.peers``: counted, reported at a limited rate)."""
        self.bad_messages += 1
        if hasattr(self, "peers"):
            self.peers.bad_message(channel, error)

    def request_stop(self, *_args) -> None:
        """Stop after the current step; guarded environment calls in flight (evaluation) give up.
        When ``asyncrl run`` stops the learner because a component failed, it says why first
        (``<run>/stop_reason.txt``): that is the run's stop reason (summary, exit code 1)."""
        self._stop = True
        reason_file = self.run_dir / STOP_REASON
        try:
            reason = reason_file.read_text().strip()
            reason_file.unlink()
        except OSError:
            reason = ""
        if reason and not self._stop_reason:
            self._stop_reason = reason
        request_env_stop()
        self._say_stopping()

    def _say_stopping(self) -> None:
        """``<run>/stopping.json``: how long this learner needs to stop (give up or finish the step in
        progress, write a checkpoint), so that ``asyncrl run`` waits for it rather than killing it
        (``asyncrl.schedulers.local.stop_all``)."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        write_s = self._checkpoint_s if self._checkpoint_s is not None else 3 * params / 50e6  # weights + AdamW
        need = 2 * self.trainer.micro_s + 2 * write_s + 10.0
        try:
            (self.run_dir / STOPPING).write_text(json.dumps({"pid": os.getpid(), "until": time.time() + need}))
        except OSError:
            pass

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> dict:
        """Train to ``train.total_steps`` (or a stop request) and return the summary table. A failed
        write (a full disk, a permission error: any OSError) stops the learner at once and raises
        SystemExit with one line; a stop for ``train.exit_after_no_actors_s`` ends like a stop
        request and then raises SystemExit (exit code 1 either way)."""
        try:
            summary = self._run()
        except OSError as e:
            self._stop_on_write_error(e)
        finally:
            self.ranks.stop()
            self.weights_out.close()  # e.g. ipc: its shared-memory segments
        if self._stop_reason:
            raise SystemExit(f"asyncrl learn: stopped at step {self.version}: {self._stop_reason}")
        return summary

    def _stop_on_write_error(self, err: OSError) -> NoReturn:
        """No checkpoint and no stop message to the actors: they keep what was not acknowledged and
        wait for the learner to be started again (it resumes; nothing acknowledged was lost, because
        an episode is acknowledged only once the write-ahead log holding it is fsynced)."""
        what = errno.errorcode.get(err.errno, str(err.errno))
        reason = f"{err.strerror or err} ({what}) writing {err.filename or self.run_dir}"
        try:
            self.log.event("learner_stop", self.version, interrupted=True, reason=reason, errno=what)
        except OSError:
            pass  # the event log may be on the full disk too
        self.net.close()
        try:
            self.log.close()
        except OSError:
            pass
        raise SystemExit(
            f"asyncrl learn: stopped at step {self.version}: {reason}. Actors keep their "
            f"unacknowledged episodes; fix it and start the learner again to resume"
        )

    def _run(self) -> dict:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        cfg = self.cfg
        self.publish()
        self.log.event(
            "learner_start",
            self.version,
            addresses=self.net.addresses,
            pid=os.getpid(),
            model_dir=str(self.model_dir),
            total_steps=cfg.train.total_steps,
            heldout=self.heldout,
        )
        start_version = self.version
        self.evaluate()
        progress = Progress(cfg.train.total_steps, self.version, enabled=cfg.log.progress)
        t_wait = 0.0
        while self.version < cfg.train.total_steps and not self._stop:
            t0 = time.time()
            self.pump(timeout_ms=50)
            episodes = self.buffer.take(cfg.train.batch_tasks, self.version, self.staleness, keep=self._keep)
            if episodes is None:
                self.clock.enter("waiting for episodes", at=t0)
                t_wait += time.time() - t0
                self._check_filtered()
                continue
            stats = self.train_on(episodes, wait_s=t_wait)
            if self._abandoned is not None:
                break
            t_wait = 0.0
            progress.update(self.version, stats)
            self.pump(timeout_ms=0)
            if cfg.checkpoint.every and self.version % cfg.checkpoint.every == 0:
                self.checkpoint()
        progress.close()
        self.clock.enter("stopping")
        if not self._stop:  # a stop request ends promptly: no final evaluation, just the checkpoint
            self.evaluate(force=True)
        if self._stop:
            self._say_stopping()  # (now with the step's real micro-batch time)
        saved = self.checkpoint()
        if self._stop:
            given_up = (
                f"; the step in progress was given up and its {self._abandoned} episodes are back in the "
                f"buffer, saved with it"
                if self._abandoned is not None
                else ""
            )
            print(
                f"[learner] stopping: checkpoint of step {self.version} written in {self._checkpoint_s:.1f} s to "
                f"{saved}{given_up}",
                flush=True,
            )
        if not self._stop or self._stop_reason:  # the run is over: the actors stop too
            self.net.actors.stop_all(self._stop_reason or "")
            time.sleep(0.2)  # let the stop messages leave before the sockets close
        # (a stop signal only stops this process: actors started on their own wait for a resumed
        # learner; under asyncrl run or a scheduler they are stopped by it)
        stopped = self._stop_reason or (f"stopped by a stop signal at step {self.version}" if self._stop else None)
        summary = summary_table(
            self.rewards_per_step,
            self.evaluator.history,
            trained_steps=self.version - start_version - self.empty_steps,
            total_steps=cfg.train.total_steps,
            stopped=stopped,
            heldout=self.heldout,
            empty_steps=self.empty_steps,
        )
        self.telemetry.timeline(self.version, force=True)
        self.log.event("learner_stop", self.version, interrupted=self._stop, reason=stopped, summary=summary)
        if self.ledger is not None:
            self.ledger.close()
        self.net.close()
        self.log.close()
        return summary

    def pump(self, timeout_ms: int) -> None:
        """Ingest arrivals (validated, made durable, acknowledged), answer actors, expire leases,
        grant credits (``asyncrl.learner.ingest.peers.Peers``)."""
        self.peers.pump(timeout_ms, self.version)
        self.telemetry.timeline(self.version)
        self.weights_out.poll()  # sync.type=nccl: actors joining the weight-sync group
        if self.peers.stop_reason and not self._stop:
            self._stop, self._stop_reason = True, self.peers.stop_reason
        self.grant()

    def _check_filtered(self) -> None:
        """Dynamic sampling: stop the run, in one line, once more episodes than the bound were dropped
        since the last step (no informative group comes)."""
        limit = self.cfg.buffer.filter_groups_max_batches * self.cfg.train.batch_tasks
        if self._keep is None or len(self.buffer.filtered) <= limit or self._stop:
            return
        self._stop = True
        self._stop_reason = (
            f"dynamic sampling (buffer.filter_groups) dropped {len(self.buffer.filtered)} episodes in a row whose "
            f"groups all had equal rewards, more than buffer.filter_groups_max_batches="
            f"{self.cfg.buffer.filter_groups_max_batches} x train.batch_tasks={self.cfg.train.batch_tasks}: no "
            f"informative group to train on (the tasks are all solved or all failed, or the reward is constant)"
        )

    def _filtered_metrics(self, batch_episodes: int) -> dict:
        """Dynamic sampling's metrics for a step, and its ``groups_filtered`` event."""
        if self._keep is None:
            return {}
        ids = self.buffer.take_filtered()
        if ids:
            self.log.event("groups_filtered", self.version, episode_ids=ids, count=len(ids))
        return {
            "dynamic_sampling/dropped": len(ids),
            "dynamic_sampling/dropped_share": len(ids) / max(len(ids) + batch_episodes, 1),
            "dynamic_sampling/dropped_total": self.buffer.filtered_total,
        }

    def grant(self) -> None:
        cfg = self.cfg
        if self.ledger is not None:  # tasks dealt to actors that are gone are dealt again
            self.ledger.sweep({a.identity for a in self.net.actors.values()}, self.version)
        if len(self.net.actors) < cfg.train.min_actors:
            return
        pool = self.staleness.credit_pool()
        free = pool - self.net.actors.in_flight - len(self.buffer)
        if free > 0:
            self.net.actors.grant_credits(
                free,
                min_version=max(self.net.subscribers.version, 0),
                work=self._credit_work if self.hooks else None,
                stranger_cap=cfg.wire.stranger_credits or max(1, pool // 2),
            )

    def _credit_work(self, actor, n: int) -> dict:
        """The hooks' fields for ``actor``'s credit message (experience replay's assignments)."""
        work: dict = {}
        for hook in self.hooks:  # (each for the credits the ones before it gave no task)
            work.update(hook.credit_work(actor, n - len(work.get("replay", ())), self.version))
        return work

    def train_on(self, episodes: list[Episode], wait_s: float) -> dict:
        t0 = time.time()
        self.clock.enter("training")
        staleness = [self.version - ep.policy_version for ep in episodes]
        for hook in self.hooks:  # e.g. replay tasks get their k stored trajectories
            hook.before_batch(episodes, self.version)
        has_rows = any(ep.trajectories for ep in episodes)  # a filter (Absolute Zero) may drop all
        keep_rows = any(h.needs_rows for h in self.hooks)
        if self.archive is not None:  # what this step trains, in its order (asyncrl replay)
            self.archive.write(self.version, episodes, keep_rows)
        batch = self.trainer.make_batch(episodes) if has_rows else None
        truncated = self.staleness.truncate(batch, self.version) if batch is not None else 0
        measure = self.lagged is not None and batch is not None and self.lagged.due()
        lagged = self.lagged.measure(batch, self.version) if measure else {}
        rows = [t for ep in episodes for t in ep.trajectories]  # the batch's rows, in order
        traced = self.trace.before(batch, self.version)  # (this step's policy on the traced rows, before the update)
        try:
            result = self.ranks.step(batch, keep_rows=keep_rows, version=self.version) if batch else None
        except StepAbandoned:  # a stop came in the middle of the step: its episodes go back for the checkpoint
            self.buffer.untake()
            if self.archive is not None:
                self.archive.discard(self.version)
            self._abandoned = len(episodes)
            return {}
        # (after the step: with a critic, the step fills the advantages in)
        advantages = {id(t): float(a) for t, a in zip(rows, batch.row_advantages.tolist())} if batch is not None else {}
        stats = result.stats if result is not None else {}
        if stats.get("skipped_nonfinite"):
            self.telemetry.nonfinite(self.version + 1, stats)
        hook_metrics: dict = {}
        for hook in self.hooks:
            hook_metrics.update(hook.after_step(episodes, result, self.version))
        owned = set().union(*(h.owned_stats for h in self.hooks))
        stats = {k: v for k, v in stats.items() if k not in owned}
        stats.update(merge_mismatch(stats, lagged))  # mismatch/*: this version's tokens and older ones'
        self.version += 1
        if traced is not None:  # what the loss saw on every token of a few rows (the UI's Tokens tab)
            self.log.event("token_trace", self.version, rows=self.trace.record(batch, traced, episodes))
        train_s = time.time() - t0
        if self.lagged is not None:
            self.lagged.note_step(train_s)
        if self.version % self.cfg.sync.every == 0:
            self.publish()
        rewards = [t.reward for ep in episodes for t in ep.trajectories if self.counts_for_reward(t)]
        reward_mean = float(np.mean(rewards)) if rewards else 0.0
        if batch is None:  # nothing to train on (every rollout failed, or a filter dropped all): not a trained step
            self.empty_steps += 1
        else:
            self.rewards_per_step.append(reward_mean)
        tokens = int(batch.response_mask.sum().item()) if batch is not None else 0
        metrics = {
            "version": self.version,
            "reward_mean": reward_mean,
            "staleness_max": max(staleness),
            "staleness_mean": float(np.mean(staleness)),
            "batch_trajectories": batch.batch_size if batch is not None else 0,
            "batch_tokens": tokens,
            "buffer_size": len(self.buffer),
            "in_flight": self.net.actors.in_flight,
            "episodes_acked": self.peers.ingested,
            "ingest_s": self.peers.ingest_s + self.net.decode_s,
            "dropped_stale": self.buffer.dropped_stale,
            "staleness/tokens_truncated": truncated,
            "bad_messages": self.bad_messages,
            "rejected_episodes": self.peers.rejected_episodes,
            "nonfinite_steps": self.telemetry.nonfinite_steps,
            "train_s": train_s,
            "wait_s": wait_s,
            **stats,
            **hook_metrics,
            **self._sync_metrics(),
            **self._filtered_metrics(len(episodes)),
            **(self.trainer.shaping_stats if batch is not None else {}),
        }
        metrics.update(self.evaluate())
        return self.telemetry.step(self.version, episodes, staleness, tokens, metrics, advantages)

    def _sync_metrics(self) -> dict:
        """Weight sync since the last step: publish -> applied per actor (its ``subscribe`` says when
        its engine took the version), and the oldest version an actor holds."""
        applied, self.net.subscribers.applied = self.net.subscribers.applied, []
        out = {}
        if applied:
            ms = [1000 * s for _, _, s in applied]
            out.update({"sync/applied_ms_mean": float(np.mean(ms)), "sync/applied_ms_max": float(np.max(ms))})
        out["sync/bytes_sent"] = self.net.subscribers.bytes_sent  # (cumulative: weights messages to every subscriber)
        held = [s.have for s in self.net.subscribers.values()]
        if held:
            out["sync/actor_version_min"] = min(held)
        return out

    def publish(self) -> None:
        with self.clock.during("publishing weights"):
            self._publish()

    def _publish(self) -> None:
        t0 = time.time()
        # a snapshot: queued weights frames are sent zero-copy, so they must not see the next update
        # (a transport that copies the tensors out before frames() returns needs none)
        # (model.lora: the adapter tensors only, by the plain model's module names; asyncrl.models.lora)
        snapshot = self.weights_out.needs_snapshot
        named = self.model.named_parameters()
        state = {
            k: (v.detach().to("cpu", copy=True).contiguous() if snapshot else v.detach())
            for k, v in (adapter_tensors(named) if is_lora(self.model) else dict(named)).items()
        }
        t_digest = time.time()
        digest = weights_digest(state) if self.cfg.sync.digest else None  # the version's receipt
        digest_s = time.time() - t_digest
        if digest is not None:
            self.peers.digests[self.version] = digest  # (replaces a lost timeline's digest of this number)
            for old in [v for v in self.peers.digests if v < self.version - _DIGESTS_KEPT]:
                del self.peers.digests[old]
        if self.lagged is not None:
            self.lagged.remember(self.version, state, copied=snapshot)
        self.net.subscribers.publish(self.weights_out.frames(state, self.version, digest), self.version)
        self.log.event(
            "weights_published",
            self.version,
            version=self.version,
            bytes=int(sum(v.numel() * v.element_size() for v in state.values())),
            encode_s=time.time() - t0,
            digest=digest,
            digest_s=round(digest_s, 6),
            subscribers=len(self.net.subscribers),
        )

    def evaluate(self, force: bool = False) -> dict:
        """Evaluate if due; the loop keeps answering actors and taking episodes meanwhile (no
        credits are granted and nothing is trained). A hung evaluation stops the run with one line."""
        try:
            with self.clock.during("evaluating"):
                result = self.evaluator.maybe_run(self.model, self.version, force=force, tick=self._tick)
        except EvaluationHung as e:
            self.log.event("eval_hung", self.version, error=str(e))
            if not self._stop:
                self._stop, self._stop_reason = True, str(e)
            return {}
        if result:
            self.log.event("eval", self.version, **result)
        return {f"eval/{k}": v for k, v in result.items() if isinstance(v, (int, float))}

    @property
    def clock(self):
        """Where the learner's time goes (:mod:`asyncrl.timeline`; its ``timeline`` events)."""
        return self.telemetry.clock

    def _tick(self) -> None:
        """The learner answering its actors (heartbeats, episodes; no credits) while it evaluates or trains
        a long step, at most every 0.2 s."""
        if time.monotonic() - self._last_tick >= 0.2:
            self._last_tick = time.monotonic()
            self.peers.pump(0, self.version)
            self.telemetry.timeline(self.version)

    def checkpoint(self) -> Path:
        with self.clock.during("checkpointing"):
            return self._checkpoint()

    def _checkpoint(self) -> Path:
        t0 = time.time()
        states, critic = self.ranks.checkpoint_states()  # (critic: estimator gae)

        def write_extra(directory: Path) -> None:
            for hook in self.hooks:
                hook.save(directory)
            if critic is not None:
                write_critic(directory, critic)

        path = save_checkpoint(
            self.run_dir,
            self.version,
            self.model,
            self.tokenizer,
            self.trainer.optimizer,
            self.buffer,
            {"rewards_per_step": self.rewards_per_step, "weights_digests": self.peers.digests},
            keep=self.cfg.checkpoint.keep,
            write_extra=write_extra,
            states=states,
        )
        self.buffer.open_wal(self.version)
        # WAL segments back to the oldest kept checkpoint stay, so a resume that finds the newest
        # checkpoint damaged can fall back to an older one without losing acknowledged episodes
        self.buffer.drop_wal_before(checkpoint_step(list_checkpoints(self.run_dir)[0]))
        self._checkpoint_s = time.time() - t0
        self.log.event("checkpoint", self.version, path=str(path), seconds=round(self._checkpoint_s, 3))
        for hook in self.hooks:
            hook.checkpoint_saved(path, self.version)
        return path


def _make_hooks(cfg: Config, staleness: StalenessPolicy, event) -> list[LearnerHook]:
    """The learner hooks the config asks for: experience replay when ``replay.enabled`` (the
    preflight has checked that the workflow takes per-task rollout counts)."""
    if not cfg.replay.enabled:
        return []
    manager = ExperiencePool(
        cfg.replay, n=cfg.sampling.n, total_steps=cfg.train.total_steps, staleness=staleness, seed=cfg.seed
    )
    return [ReplayHook(manager, cfg.replay.state_event_every, event)]


def _describe_heldout(cfg: Config) -> str:
    """One line saying what the held-out set is (``asyncrl.envs.tasks.describe_heldout``)."""
    from ..envs.tasks import describe_heldout, split_tasks

    train, heldout = split_tasks(cfg.tasks)
    return describe_heldout(cfg.tasks, heldout, train)
