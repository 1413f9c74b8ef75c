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
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from ..config import Config
from ..envs.guard import request_stop as request_env_stop
from ..models.loading import load_policy
from ..rollout.workflow import workflow_class
from ..sync import make_publisher
from ..rundir import RunLock, StartPlan, discard_metrics_after, plan_start, prepare, write_snapshot
from ..runlog import EVENTS_SCHEMA, RunLog, check_trackers, open_trackers
from ..types import Episode
from ..wire.sockets import check_bind_host
from .batch import collate, compute_logprobs
from .batch_stats import batch_metrics
from .buffer import ReplayBuffer
from .checkpoint import (checkpoint_step, clean_partial, list_checkpoints, load_checkpoint, quarantine,
                         save_checkpoint)
from .evaluate import Evaluator
from .net import LearnerNet, Limits
from .peers import Peers
from .progress import Progress, summary_table
from .hooks import LearnerHook
from .replay import ExperienceManager, ReplayHook
from .core_algos import LossConfig
from .trainer import PolicyTrainer


class Learner:
    def __init__(self, cfg: Config, overwrite: bool = False):
        """Claim the run directory (``asyncrl.rundir``: refused before anything is written if it is
        locked or holds a run that ``cfg.checkpoint.resume`` does not continue; ``overwrite`` deletes
        the old run first), build the model, then resume from the plan's checkpoint and WAL."""
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cfg.train.threads)
        self.run_dir = cfg.run_dir
        check_trackers(cfg.log.trackers)  # a missing tracker library: one line, before the model builds
        check_bind_host(cfg.wire.host, cfg.wire.curve_dir)  # a public address without keys: one line, first
        self._start_events: list[tuple[str, dict]] = []  # found before the event log opens
        self.plan = self._claim_run_dir(overwrite)
        self.model, self.tokenizer, self.model_dir = load_policy(
            cfg.model, cfg.seed, cfg.train.device, cfg.tasks.prompt_format,
            warmstart_formats=workflow_class(cfg.algorithm).warmstart_formats)
        self.trainer = PolicyTrainer(self.model, self.tokenizer, cfg.train, cfg.sampling.temperature,
                                     loss_cfg=LossConfig.from_config(cfg.train, cfg.replay),
                                     use_recorded_logprobs=cfg.replay.exp_is_correct)
        self.buffer = ReplayBuffer(self.run_dir / "buffer", cfg.buffer.capacity)
        self.version = 0
        self.bad_messages = 0
        self.nonfinite_steps = 0  # steps with a NaN/inf loss or gradient, not applied
        self.weights_out = make_publisher(cfg.sync, self.run_dir)
        self.net = LearnerNet(cfg.wire, self._on_bad_message, previous=self._previous_addresses(),
                              limits=Limits.from_config(cfg.wire, getattr(self.model.config,
                                                                          "max_position_embeddings", None)))
        self.log = RunLog(self.run_dir, on_event=self.net.publish_event,
                          trackers=open_trackers(cfg.log.trackers, self.run_dir, cfg.name, cfg.log.project,
                                                 cfg.model_dump(mode="json")))
        self.peers = Peers(cfg, self.net, self.buffer, lambda kind, **f: self.log.event(kind, self.version, **f),
                           vocab_size=self.model.get_input_embeddings().num_embeddings)
        self.hooks: list[LearnerHook] = _make_hooks(cfg, self.log.event)
        self.evaluator = Evaluator(cfg, self.tokenizer)
        self.heldout = _describe_heldout(cfg)
        for warning in self.evaluator.workflow.warnings:  # e.g. algo.sandbox.isolation: none
            self.log.event("warning", self.version, source=cfg.algorithm, message=warning)
        self.rewards_per_step: list[float] = []
        self._stop = False
        self._stop_reason: str | None = None  # set by a stop the user asked for in the config
        self._episode_counter = 0
        self._recent = deque(maxlen=50)  # (time, episodes, tokens) per step for rates
        self._resume()
        self.buffer.open_wal(self.version)
        (self.run_dir / "addresses.json").write_text(json.dumps(self.net.addresses, indent=1))

    # -- lifecycle ------------------------------------------------------------------------------
    def _claim_run_dir(self, overwrite: bool) -> StartPlan:
        """Check (read-only), lock the run dir for this process's life, decide again under the lock,
        then set the directory up for the plan: damaged checkpoints moved aside, metrics of
        rolled-back steps moved out of ``metrics.jsonl``, this segment's config snapshot."""
        prepare(self.cfg, overwrite=overwrite)
        self.run_lock = RunLock(self.run_dir)
        self.run_lock.acquire()
        plan = plan_start(self.cfg)
        if plan.mode == "fresh" and self.cfg.checkpoint.resume:
            print(f"[learner] nothing to resume in {self.run_dir}: starting a fresh run", flush=True)
        for path, problem in plan.damaged:
            moved = quarantine(path)
            self._start_note("checkpoint_damaged", f"checkpoint {path.name} is damaged: {problem}; moved to "
                             f"{moved.name}", path=str(path), problem=problem, moved_to=str(moved))
        clean_partial(self.run_dir)
        if plan.mode == "resume":
            discarded = discard_metrics_after(self.run_dir, plan.step)
            if discarded:
                self._start_note("metrics_discarded", f"{discarded} metrics line(s) after step {plan.step} "
                                 f"moved to metrics.discarded.jsonl", count=discarded, after_step=plan.step)
        snapshot = write_snapshot(self.cfg, plan)
        if plan.changes:
            keys = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in plan.changes)
            self._start_note("config_changed", f"config changed since {plan.previous_config.name}: {keys}",
                             previous=plan.previous_config.name, snapshot=snapshot.name,
                             changes=[{"key": k, "old": old, "new": new} for k, old, new in plan.changes])
        return plan

    def _start_note(self, kind: str, line: str, **fields) -> None:
        """Print a start-up finding now; log it as an event once the event log is open."""
        print(f"[learner] {line}", flush=True)
        self._start_events.append((kind, fields))

    def _previous_addresses(self) -> dict | None:
        path = self.run_dir / "addresses.json"
        if not (self.plan.mode == "resume" and path.exists()):
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            return None

    def _resume(self) -> None:
        """Load the plan's checkpoint (if any) and rebuild the buffer from it and the WAL."""
        ckpt = self.plan.checkpoint
        state = load_checkpoint(ckpt, self.model, self.trainer.optimizer) if ckpt is not None else {}
        self.version = int(state.get("version", self.plan.step))
        for hook in self.hooks if ckpt is not None else ():
            hook.load(ckpt, self.version)
        self.rewards_per_step = list(state.get("rewards_per_step", []))
        report = self.buffer.restore(ckpt / "buffer.bin" if ckpt is not None else None, set(state.get("seen", [])))
        for scan in report.truncated:
            self._start_note("wal_truncated", f"{scan.path}: cut {scan.bytes_cut} byte(s) at offset "
                             f"{scan.good_bytes} after {scan.records} good record(s): {scan.problem}",
                             file=str(scan.path), offset=scan.good_bytes, bytes_cut=scan.bytes_cut,
                             records_kept=scan.records, reason=scan.problem)
        for kind, fields in self._start_events:
            self.log.event(kind, self.version, **fields)
        if self.plan.mode == "resume":
            where = f"checkpoint {ckpt}" if ckpt is not None else "no checkpoint (no step was trained)"
            print(f"[learner] resumed from step {self.version} ({where}; {len(self.buffer)} episode(s) buffered, "
                  f"{report.recovered} recovered from the WAL)", flush=True)
            self.log.event("resume", self.version, checkpoint=str(ckpt) if ckpt is not None else None,
                           buffered=len(self.buffer), recovered_from_wal=report.recovered,
                           undecodable_wal_records=report.undecodable)

    def _on_bad_message(self, channel: str, error: Exception) -> None:
        """A peer's message that was refused (``asyncrl.learner.peers``: counted, reported at a limited rate)."""
        self.bad_messages += 1
        if hasattr(self, "peers"):
            self.peers.bad_message(channel, error)

    def request_stop(self, *_args) -> None:
        """Stop after the current step; guarded environment calls in flight (evaluation) give up."""
        self._stop = True
        request_env_stop()

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
        raise SystemExit(f"asyncrl learn: stopped at step {self.version}: {reason}. Actors keep their "
                         f"unacknowledged episodes; fix it and start the learner again to resume")

    def _run(self) -> dict:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        cfg = self.cfg
        self.publish()
        self.log.event("learner_start", self.version, addresses=self.net.addresses, pid=os.getpid(),
                       model_dir=str(self.model_dir), total_steps=cfg.train.total_steps, heldout=self.heldout)
        start_version = self.version
        self.evaluate()
        progress = Progress(cfg.train.total_steps, self.version, enabled=cfg.log.progress)
        t_wait = 0.0
        while self.version < cfg.train.total_steps and not self._stop:
            t0 = time.time()
            self.pump(timeout_ms=50)
            episodes = self.buffer.take(cfg.train.batch_tasks, self.version, cfg.buffer.max_staleness)
            if episodes is None:
                t_wait += time.time() - t0
                continue
            stats = self.train_on(episodes, wait_s=t_wait)
            t_wait = 0.0
            progress.update(self.version, stats)
            self.pump(timeout_ms=0)
            if cfg.checkpoint.every and self.version % cfg.checkpoint.every == 0:
                self.checkpoint()
        progress.close()
        if not self._stop:  # a stop request ends promptly: no final evaluation, just the checkpoint
            self.evaluate(force=True)
        self.checkpoint()
        self.net.stop_actors()
        time.sleep(0.2)  # let the stop messages leave before the sockets close
        stopped = self._stop_reason or (f"stopped by a stop signal at step {self.version}" if self._stop else None)
        summary = summary_table(self.rewards_per_step, self.evaluator.history,
                                trained_steps=self.version - start_version, total_steps=cfg.train.total_steps,
                                stopped=stopped, heldout=self.heldout)
        self.log.event("learner_stop", self.version, interrupted=self._stop, reason=stopped, summary=summary)
        self.net.close()
        self.log.close()
        return summary

    def pump(self, timeout_ms: int) -> None:
        """Ingest arrivals (validated, made durable, acknowledged), answer actors, expire leases,
        grant credits (``asyncrl.learner.peers.Peers``)."""
        self.peers.pump(timeout_ms, self.version)
        if self.peers.stop_reason and not self._stop:
            self._stop, self._stop_reason = True, self.peers.stop_reason
        self.grant()

    def grant(self) -> None:
        cfg = self.cfg
        if len(self.net.actors) < cfg.train.min_actors:
            return
        limit = (cfg.buffer.max_staleness + 1) * cfg.train.batch_tasks
        free = min(limit, cfg.buffer.capacity) - self.net.in_flight - len(self.buffer)
        if free > 0:
            self.net.grant_credits(free, min_version=max(self.net.weights_version, 0),
                                   work=self._credit_work if self.hooks else None)

    def _credit_work(self, actor, n: int) -> dict:
        """The hooks' fields for ``actor``'s credit message (experience replay's assignments)."""
        work: dict = {}
        for hook in self.hooks:
            work.update(hook.credit_work(actor, n, self.version))
        return work

    def train_on(self, episodes: list[Episode], wait_s: float) -> dict:
        t0 = time.time()
        staleness = [self.version - ep.policy_version for ep in episodes]
        for hook in self.hooks:  # e.g. replay tasks get their k stored trajectories
            hook.before_batch(episodes, self.version)
        has_rows = any(ep.trajectories for ep in episodes)  # a filter (Absolute Zero) may drop all
        batch = self.trainer.make_batch(episodes) if has_rows else None
        result = self.trainer.step(batch, keep_rows=any(h.needs_rows for h in self.hooks)) if batch else None
        stats = result.stats if result is not None else {}
        if stats.get("skipped_nonfinite"):
            self._report_nonfinite(stats)
        hook_metrics: dict = {}
        for hook in self.hooks:
            hook_metrics.update(hook.after_step(episodes, result, self.version))
        owned = set().union(*(h.owned_stats for h in self.hooks))
        stats = {k: v for k, v in stats.items() if k not in owned}
        self.version += 1
        train_s = time.time() - t0
        if self.version % self.cfg.sync.every == 0:
            self.publish()
        rewards = [t.reward for ep in episodes for t in ep.trajectories
                   if t.sample_type != "proposer" and not t.is_replay]  # fresh rollouts only
        reward_mean = float(np.mean(rewards)) if rewards else 0.0
        self.rewards_per_step.append(reward_mean)
        tokens = int(batch.response_mask.sum().item()) if batch is not None else 0
        self._recent.append((time.time(), len(episodes), sum(len(ep.trajectories) for ep in episodes), tokens))
        metrics = {"version": self.version, "reward_mean": reward_mean,
                   "staleness_max": max(staleness), "staleness_mean": float(np.mean(staleness)),
                   "batch_trajectories": batch.batch_size if batch is not None else 0, "batch_tokens": tokens,
                   "buffer_size": len(self.buffer), "in_flight": self.net.in_flight,
                   "dropped_stale": self.buffer.dropped_stale, "bad_messages": self.bad_messages,
                   "rejected_episodes": self.peers.rejected_episodes,
                   "nonfinite_steps": self.nonfinite_steps,
                   "train_s": train_s, "wait_s": wait_s, **self._rates(), **stats, **hook_metrics,
                   **batch_metrics(episodes), **_mean_episode_metrics(episodes)}
        metrics.update(self.evaluate())
        self.log.metric(self.version, metrics)
        # live viewers without the run dir (asyncrl ui --connect) get the step's metrics too
        self.net.publish_event({"schema": EVENTS_SCHEMA, "kind": "metrics", "t": time.time(),
                                "step": self.version, "metrics": metrics})
        self._log_episodes(episodes, staleness)
        self._log_sample(episodes)
        return metrics

    def _report_nonfinite(self, stats: dict) -> None:
        """A step whose loss or gradient was NaN/inf was not applied (``PolicyTrainer.step``)."""
        self.nonfinite_steps += 1
        print(f"[learner] step {self.version + 1}: loss {stats.get('loss')} / grad norm {stats.get('grad_norm')} "
              f"not finite; the update was skipped ({self.nonfinite_steps} so far)", flush=True)
        self.log.event("nonfinite_step", self.version + 1, loss=stats.get("loss"), grad_norm=stats.get("grad_norm"),
                       skipped_share=stats["skipped_nonfinite"], total=self.nonfinite_steps)

    def _log_sample(self, episodes: list[Episode]) -> None:
        """Every ``log.sample_every`` steps: one trained trajectory token by token (``sample`` event)."""
        every = self.cfg.log.sample_every
        if not every or self.version % every:
            return
        rows = [(ep, t) for ep in episodes for t in ep.trajectories if t.num_generated > 0]
        if not rows:
            return
        ep, traj = rows[(self.version // every) % len(rows)]
        record = sample_record(self.model, self.tokenizer, traj, self.cfg.sampling.temperature,
                               self.cfg.log.sample_max_tokens)
        self.log.event("sample", self.version, episode_id=ep.id, **record)

    def _rates(self) -> dict:
        if len(self._recent) < 2:
            return {}
        span = self._recent[-1][0] - self._recent[0][0]
        if span <= 0:
            return {}
        items = list(self._recent)[1:]
        return {"episodes_per_s": sum(i[1] for i in items) / span,
                "samples_per_s": sum(i[2] for i in items) / span,
                "tokens_per_s": sum(i[3] for i in items) / span}

    def _log_episodes(self, episodes: list[Episode], staleness: list[int]) -> None:
        for ep, st in zip(episodes, staleness):
            self._episode_counter += 1
            if self._episode_counter % self.cfg.log.episode_events_every:
                continue
            self.log.event("episode", self.version, episode_id=ep.id, actor_id=ep.actor_id,
                           task_id=ep.task.id if ep.task else None,
                           prompt=ep.task.prompt if ep.task else None, policy_version=ep.policy_version,
                           staleness=st, decision=ep.decision, metrics=ep.metrics,
                           trajectories=[{"id": t.id, "text": t.text, "reward": t.reward, "scores": t.scores,
                                          "sample_type": t.sample_type, "group_id": t.group_id,
                                          "policy_version": t.policy_version, "is_replay": t.is_replay,
                                          "num_tokens": int(len(t.token_ids)),
                                          "num_generated": t.num_generated}
                                         for t in ep.trajectories])

    def publish(self) -> None:
        t0 = time.time()
        # a snapshot: queued weights frames are sent zero-copy, so they must not see the next update
        state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.model.named_parameters()}
        self.net.publish_weights(self.weights_out.frames(state, self.version), self.version)
        self.log.event("weights_published", self.version, version=self.version,
                       bytes=int(sum(v.numel() * v.element_size() for v in state.values())),
                       encode_s=time.time() - t0, subscribers=len(self.net.subscribers))

    def evaluate(self, force: bool = False) -> dict:
        result = self.evaluator.maybe_run(self.model, self.version, force=force)
        if result:
            self.log.event("eval", self.version, **result)
        return {f"eval/{k}": v for k, v in result.items() if isinstance(v, (int, float))}

    def _save_hooks(self, directory: Path) -> None:
        for hook in self.hooks:
            hook.save(directory)

    def checkpoint(self) -> Path:
        path = save_checkpoint(self.run_dir, self.version, self.model, self.tokenizer, self.trainer.optimizer,
                               self.buffer, {"rewards_per_step": self.rewards_per_step},
                               keep=self.cfg.checkpoint.keep,
                               write_extra=self._save_hooks)
        self.buffer.open_wal(self.version)
        # WAL segments back to the oldest kept checkpoint stay, so a resume that finds the newest
        # checkpoint damaged can fall back to an older one without losing acknowledged episodes
        self.buffer.drop_wal_before(checkpoint_step(list_checkpoints(self.run_dir)[0]))
        self.log.event("checkpoint", self.version, path=str(path))
        for hook in self.hooks:
            hook.checkpoint_saved(path, self.version)
        return path


def sample_record(model, tokenizer, traj, temperature: float, max_tokens: int) -> dict:
    """One trajectory per token for the ``sample`` event: token strings, ``loss_mask``, ``exp_mask``,
    ``behavior_logprobs`` and ``current_logprobs`` (the model's now, after this step's update), all
    aligned to the tokens; position 0 has no current log-prob (None). Only the last ``max_tokens``
    tokens are kept (``offset`` is the index of the first one kept)."""
    n = len(traj.token_ids)
    batch = collate([traj], torch.zeros(1), tokenizer.pad_token_id or 0, device=next(model.parameters()).device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logp, _ = compute_logprobs(model, batch, temperature)
    model.train(was_training)
    current = [None] + [round(float(x), 4) for x in logp[0, : n - 1].cpu()]
    exp = traj.off_policy_mask if traj.off_policy_mask is not None else np.zeros(n)
    start = max(0, n - max_tokens)
    ids = [int(i) for i in traj.token_ids[start:]]
    return {"trajectory_id": traj.id, "sample_type": traj.sample_type, "group_id": traj.group_id,
            "policy_version": traj.policy_version, "reward": traj.reward, "advantage": traj.advantage,
            "is_replay": traj.is_replay, "text": traj.text, "num_tokens": n, "offset": start,
            "truncated": start > 0,
            "tokens": tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False),
            "token_ids": ids, "loss_mask": [int(x) for x in traj.loss_mask[start:]],
            "exp_mask": [int(x) for x in np.asarray(exp)[start:]],
            "behavior_logprobs": [round(float(x), 4) for x in traj.behavior_logprobs[start:]],
            "current_logprobs": current[start:]}


def _make_hooks(cfg: Config, event) -> list[LearnerHook]:
    """The learner hooks the config asks for: experience replay when ``replay.enabled`` (the
    preflight has checked that the workflow takes per-task rollout counts)."""
    if not cfg.replay.enabled:
        return []
    manager = ExperienceManager(cfg.replay, n=cfg.sampling.n, total_steps=cfg.train.total_steps, seed=cfg.seed,
                                max_staleness=cfg.buffer.max_staleness)
    return [ReplayHook(manager, cfg.replay.state_event_every, event)]


def _describe_heldout(cfg: Config) -> str:
    """One line saying what the held-out set is (``asyncrl.envs.tasks.describe_heldout``)."""
    from ..envs.tasks import describe_heldout, split_tasks

    train, heldout = split_tasks(cfg.tasks)
    return describe_heldout(cfg.tasks, heldout, train)


def _mean_episode_metrics(episodes: list[Episode]) -> dict:
    sums: dict[str, list[float]] = defaultdict(list)
    for ep in episodes:
        for k, v in ep.metrics.items():
            if isinstance(v, (int, float)):
                sums[k].append(float(v))
    return {k: float(np.mean(v)) for k, v in sums.items() if k != "reward_mean"}
