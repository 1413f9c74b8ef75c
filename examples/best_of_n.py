"""A new algorithm in one file: best-of-n, trained online (reward-ranked fine-tuning, RAFT: Dong et
al. 2023, "RAFT: Reward rAnked FineTuning for Generative Foundation Model Alignment").

Per task the policy samples ``sampling.n`` responses through the environment; the ``algo.keep``
best by reward, among those scoring at least ``algo.min_reward``, are trained on with advantage
``algo.advantage``, and the rest are not sent to the learner at all. The update raises the
likelihood of the best samples: rejection-sampling fine-tuning, done asynchronously.

What it takes (docs/design/architecture.md, "Adding an algorithm"): this file and a config,
``examples/best_of_n.yaml``. From the repository's root (import paths resolve from the working
directory)::

    .venv/bin/asyncrl run -c examples/best_of_n.yaml

- a :class:`~asyncrl.rollout.Workflow` subclass whose ``rollout`` turns tasks into Episodes with the
  shared conversation loop (:mod:`asyncrl.rollout.conversation`), on the actor;
- its own ``algo:`` section, validated when the config loads (a pydantic model, ``extra="forbid"``);
- advantages of its own, set on ``Trajectory.advantage`` (the learner's estimator then leaves them
  as they are: :func:`asyncrl.objectives.advantages.trajectory_advantages`).

``algorithm: examples.best_of_n:BestOfNWorkflow`` loads it by import path. It is also registered as
``best_of_n``: the name the registry finds by itself when the file lives in ``asyncrl/algos/``.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.config import ConfigError, validate_section
from asyncrl.rollout.conversation import (
    episode_metrics,
    failure_record,
    run_conversations,
    scored_trajectories,
    start_conversations,
)
from asyncrl.rollout.workflow import RolloutContext, Workflow, register_workflow
from asyncrl.types import Episode, Task, Trajectory, new_id


class BestOfNConfig(BaseModel):
    """The ``algo:`` section for best-of-n."""

    model_config = ConfigDict(extra="forbid")

    keep: int = Field(1, ge=1, description="Responses kept per task (the best by reward), at most sampling.n.")
    min_reward: float = Field(1.0, description="A response is kept only if its reward is at least this.")
    advantage: float = Field(1.0, gt=0, description="The advantage every kept response is trained with.")


@register_workflow("best_of_n")
class BestOfNWorkflow(Workflow):
    """``sampling.n`` rollouts per task; one Episode per task holding only its kept responses."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.algo: BestOfNConfig = validate_section(BestOfNConfig, cfg.algo, "algo")
        if self.algo.keep > cfg.sampling.n:
            raise ConfigError(
                f"algo.keep ({self.algo.keep}) exceeds sampling.n ({cfg.sampling.n}): "
                f"at most every sampled response can be kept"
            )

    def rollout(self, tasks: list[Task], ctx: RolloutContext, counts: list[int] | None = None) -> list[Episode]:
        n = self.cfg.sampling.n
        version = ctx.engine.version
        episode_ids = [new_id() for _ in tasks]
        convs = start_conversations(ctx.tokenizer, ctx.env, tasks, n, group_ids=episode_ids)
        run_conversations(
            ctx.engine, ctx.tokenizer, ctx.env, convs, self.cfg.sampling, self.cfg.env.max_turns, seed=ctx.seed
        )  # one batched engine call per turn
        return [
            self._episode(task, eid, convs[i * n : (i + 1) * n], version, ctx)
            for i, (task, eid) in enumerate(zip(tasks, episode_ids))
        ]

    def _episode(self, task: Task, eid: str, group: list, version: int, ctx: RolloutContext) -> Episode:
        """The Episode of one task: its kept responses, and a decision record of all ``n``."""
        trajs, failures = scored_trajectories(group, ctx.env, version)
        kept = self.select(trajs)
        rewards = [t.reward for t in trajs]
        decision = {
            "kind": "best_of_n",
            "rewards": rewards,
            "kept": kept,
            "policy_version": version,
            **failure_record(failures, version),
        }
        # the learner's reward_mean covers the trained (kept) rows only: the samples' mean is ours
        metrics = {
            **episode_metrics(rewards, len(failures)),
            "best_of_n/kept": float(len(kept)),
            "best_of_n/best_reward": max(rewards, default=0.0),
            "best_of_n/sample_reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        }
        return Episode(
            trajectories=[trajs[i] for i in kept],
            actor_id=ctx.actor_id,
            task=task,
            id=eid,
            created_at=time.time(),
            decision=decision,
            metrics=metrics,
        )

    def select(self, trajs: list[Trajectory]) -> list[int]:
        """Indices (ascending) of the ``keep`` best responses with ``reward >= min_reward`` (ties:
        the earlier sample); each gets ``advantage``."""
        ranked = sorted(range(len(trajs)), key=lambda i: -trajs[i].reward)
        kept = sorted(i for i in ranked[: self.algo.keep] if trajs[i].reward >= self.algo.min_reward)
        for i in kept:
            trajs[i].advantage = self.algo.advantage
        return kept
