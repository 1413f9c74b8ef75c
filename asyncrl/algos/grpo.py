"""GRPO: ``sampling.n`` rollouts per task, one Episode per task (Shao et al. 2024, DeepSeekMath)."""

from __future__ import annotations

import time

from ..config import ConfigError
from ..rollout.conversation import (
    episode_metrics,
    failure_record,
    run_conversations,
    scored_trajectories,
    start_conversations,
)
from ..rollout.workflow import RolloutContext, Workflow, register_workflow
from ..types import Episode, Task, new_id


@register_workflow("grpo")
class GRPOWorkflow(Workflow):
    """``sampling.n`` rollouts per task through the environment; one Episode per task.

    ``counts`` (optional, one per task) overrides the rollouts of a task: experience replay assigns
    ``n - k`` fresh rollouts to a replay task whose ``k`` stored trajectories the learner adds."""

    supports_replay = True
    per_task = True  # each task's group is its own episode

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.algo:
            raise ConfigError(
                f"algorithm grpo takes no algo.* settings, got {', '.join(f'algo.{k}' for k in cfg.algo)}; "
                f"algo.* configures absolute_zero and rlcr (GRPO is set by train.*, sampling.*)"
            )

    def rollout(self, tasks: list[Task], ctx: RolloutContext, counts: list[int] | None = None) -> list[Episode]:
        n = self.cfg.sampling.n
        counts = [n] * len(tasks) if counts is None else [int(c) for c in counts]
        if len(counts) != len(tasks) or any(c < 1 for c in counts):
            raise ValueError(
                f"counts must hold one positive rollout count per task; got {counts} for {len(tasks)} tasks"
            )
        episode_ids = [new_id() for _ in tasks]
        convs = []
        for task, eid, c in zip(tasks, episode_ids, counts):
            convs += start_conversations(ctx.tokenizer, ctx.env, [task], c, group_ids=[eid])
        version = ctx.engine.version
        run_conversations(
            ctx.engine, ctx.tokenizer, ctx.env, convs, self.cfg.sampling, self.cfg.env.max_turns, seed=ctx.seed
        )
        episodes = []
        offsets = [sum(counts[:i]) for i in range(len(counts) + 1)]
        for i, (task, eid) in enumerate(zip(tasks, episode_ids)):
            group = convs[offsets[i] : offsets[i + 1]]
            trajs, failures = scored_trajectories(group, ctx.env, version)
            episodes.append(
                Episode(
                    trajectories=trajs,
                    actor_id=ctx.actor_id,
                    task=task,
                    id=eid,
                    created_at=time.time(),
                    decision=failure_record(failures, version),
                    metrics=episode_metrics([t.reward for t in trajs], len(failures)),
                )
            )
        return episodes
