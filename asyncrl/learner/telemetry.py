"""What the learner says about each step: ``metrics.jsonl`` lines (with rates over the last 50
steps, per-batch figures and the episodes' own metrics), the live ``metrics`` event, ``episode``
events, ``sample`` events (one trajectory token by token) and reports of non-finite steps."""

from __future__ import annotations

import time
from collections import defaultdict, deque

import numpy as np
import torch

from ..rundir.runlog import EVENTS_SCHEMA
from ..timeline import StateClock
from ..types import PER_TOKEN, WIDE, Episode, prompt_text
from .training.batch import collate, compute_logprobs
from .training.batch_stats import batch_metrics


class Telemetry:
    def __init__(self, cfg, log, publish_event, model, tokenizer):
        self.cfg, self.log, self.publish_event = cfg, log, publish_event
        self.model, self.tokenizer = model, tokenizer
        self.nonfinite_steps = 0  # steps with a NaN/inf loss or gradient, not applied
        self._episode_counter = 0
        self._recent: deque = deque(maxlen=50)  # (time, episodes, trajectories, tokens) per step
        self._advantages: dict[int, float] = {}
        self.clock, self._timeline_at = StateClock("starting"), 0.0  # where the learner's time goes

    def timeline(self, version: int, force: bool = False) -> None:
        """The learner's spans since the last ``timeline`` event (at most one every 2 s)."""
        now = time.monotonic()
        if force or now - self._timeline_at >= 2.0:
            self._timeline_at = now
            spans, states = self.clock.take()
            if spans:
                self.log.event("timeline", version, process="learner", spans=spans, states=states)

    def step(
        self,
        version: int,
        episodes: list[Episode],
        staleness: list[int],
        tokens: int,
        metrics: dict,
        advantages: dict[int, float] | None = None,
    ) -> dict:
        """Complete the step's ``metrics`` (rates, batch and episode figures), write them, send them
        to live viewers and log the step's episode and sample events. ``advantages``: ``id(trajectory)
        -> the advantage it was trained with``, written in place of the trajectory's own field (which
        only an algorithm that sets its own advantages fills). Returns the metrics."""
        self._advantages = advantages or {}
        self._recent.append((time.time(), len(episodes), sum(len(ep.trajectories) for ep in episodes), tokens))
        metrics = {**metrics, **self._rates(), **batch_metrics(episodes), **_mean_episode_metrics(episodes)}
        self.log.metric(version, metrics)
        # live viewers without the run dir (asyncrl ui --connect) get the step's metrics too
        self.publish_event(
            {"schema": EVENTS_SCHEMA, "kind": "metrics", "t": time.time(), "step": version, "metrics": metrics}
        )
        self._log_episodes(version, episodes, staleness)
        self._log_sample(version, episodes)
        if self.log.trackers:
            self._tracker_extras(version, episodes, staleness)
        return metrics

    def _tracker_extras(self, version: int, episodes: list[Episode], staleness: list[int]) -> None:
        """For the trackers only: histograms of the step's advantages, rewards, lengths and
        staleness, and its completions as a table (TRL's completions table)."""
        trajs = [t for ep in episodes for t in ep.trajectories]
        adv = [self._advantages[id(t)] for t in trajs if id(t) in self._advantages]
        hist = {
            "train/advantages": adv,
            "train/rewards": [float(t.reward) for t in trajs],
            "train/response_tokens": [float(t.num_generated) for t in trajs],
            "staleness/episodes": [float(s) for s in staleness],
        }
        rows = [
            [
                version,
                prompt_text(ep.task.prompt) if ep.task else "",
                t.text,
                float(t.reward),
                self._advantages.get(id(t)),
                int(t.num_generated),
                int(t.policy_version),
            ]
            for ep in episodes
            for t in ep.trajectories
        ][: self.cfg.log.tracker_table_rows]
        self.log.extras(
            version,
            hist,
            {
                "completions": (
                    ["step", "prompt", "completion", "reward", "advantage", "tokens", "policy version"],
                    rows,
                )
            },
        )

    def nonfinite(self, version: int, stats: dict) -> None:
        """A step whose loss or gradient was NaN/inf was not applied (``PolicyTrainer.step``)."""
        self.nonfinite_steps += 1
        print(
            f"[learner] step {version}: loss {stats.get('loss')} / grad norm {stats.get('grad_norm')} not "
            f"finite; the update was skipped ({self.nonfinite_steps} so far)",
            flush=True,
        )
        self.log.event(
            "nonfinite_step",
            version,
            loss=stats.get("loss"),
            grad_norm=stats.get("grad_norm"),
            skipped_share=stats["skipped_nonfinite"],
            total=self.nonfinite_steps,
        )

    def _rates(self) -> dict:
        if len(self._recent) < 2:
            return {}
        span = self._recent[-1][0] - self._recent[0][0]
        if span <= 0:
            return {}
        items = list(self._recent)[1:]
        return {
            "episodes_per_s": sum(i[1] for i in items) / span,
            "samples_per_s": sum(i[2] for i in items) / span,
            "tokens_per_s": sum(i[3] for i in items) / span,
        }

    def _log_episodes(self, version: int, episodes: list[Episode], staleness: list[int]) -> None:
        mode, every = self.cfg.log.episode_events, self.cfg.log.episode_events_every
        if mode == "none":
            return
        for ep, st in zip(episodes, staleness):
            if mode == "sampled" and not ep.decision:
                self._episode_counter += 1
                if (self._episode_counter - 1) % every:  # the 1st, (k+1)-th, ... plain episode
                    continue
            self.log.event(
                "episode",
                version,
                episode_id=ep.id,
                actor_id=ep.actor_id,
                task_id=ep.task.id if ep.task else None,
                prompt=ep.task.prompt if ep.task else None,
                policy_version=ep.policy_version,
                staleness=st,
                decision=ep.decision,
                metrics=ep.metrics,
                trajectories=[self._summary(t) for t in ep.trajectories],
            )

    def _summary(self, traj) -> dict:
        return {**traj.summary(), "advantage": self._advantage(traj)}

    def _advantage(self, traj) -> float | None:
        """The advantage ``traj`` was trained with this step, else its own field."""
        a = self._advantages.get(id(traj))
        return traj.advantage if a is None else round(a, 6)

    def _log_sample(self, version: int, episodes: list[Episode]) -> None:
        """Every ``log.sample_every`` steps: one trained trajectory token by token (``sample`` event)."""
        every = self.cfg.log.sample_every
        if not every or version % every:
            return
        rows = [(ep, t) for ep in episodes for t in ep.trajectories if t.num_generated > 0]
        if not rows:
            return
        ep, traj = rows[(version // every) % len(rows)]
        record = sample_record(
            self.model, self.tokenizer, traj, self.cfg.sampling.temperature, self.cfg.log.sample_max_tokens
        )
        record["advantage"] = self._advantage(traj)
        self.log.event("sample", version, episode_id=ep.id, **record)


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
    start = max(0, n - max_tokens)
    arrays = {name: getattr(traj, name) for name, _, _ in PER_TOKEN if name not in WIDE}  # (routing: not logged)
    arrays["exp_mask"] = traj.off_policy_mask if traj.off_policy_mask is not None else np.zeros(n, np.uint8)
    per_token = {
        name: ([round(float(x), 4) for x in arr[start:]] if arr.dtype.kind == "f" else [int(x) for x in arr[start:]])
        for name, arr in arrays.items()
        if arr is not None
    }
    return {
        "trajectory_id": traj.id,
        **traj.summary(),
        "offset": start,
        "truncated": start > 0,
        "tokens": tokenizer.batch_decode([[i] for i in per_token["token_ids"]], skip_special_tokens=False),
        **per_token,
        "current_logprobs": current[start:],
    }


def _mean_episode_metrics(episodes: list[Episode]) -> dict:
    sums: dict[str, list[float]] = defaultdict(list)
    for ep in episodes:
        for k, v in ep.metrics.items():
            if isinstance(v, (int, float)):
                sums[k].append(float(v))
    return {k: float(np.mean(v)) for k, v in sums.items() if k != "reward_mean"}
