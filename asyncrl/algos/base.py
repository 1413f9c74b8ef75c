"""Rollout workflows: what an actor does with a batch of tasks.

A workflow turns tasks into Episodes (one per unit of work). GRPO is the plain one: ``n`` rollouts per
task, one Episode per task. Algorithms (Absolute Zero, RLCR) register their own workflows here and
put their decision records on the Episode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ..actor.rollout import run_conversations, start_conversations
from ..envs.base import Environment
from ..types import Episode, Task, new_id


@dataclass
class RolloutContext:
    engine: Any
    tokenizer: Any
    env: Environment
    cfg: Any  # the top-level Config
    actor_id: str
    seed: int


WORKFLOWS: dict[str, Callable[[Any], "Workflow"]] = {}


def register_workflow(name: str):
    def deco(cls):
        WORKFLOWS[name] = cls
        return cls
    return deco


def get_workflow(name: str, cfg) -> "Workflow":
    if name not in WORKFLOWS:
        _load_builtin_algorithms()
    if name not in WORKFLOWS:
        raise ValueError(f"algorithm: unknown workflow {name!r}; available: {', '.join(sorted(WORKFLOWS))}")
    return WORKFLOWS[name](cfg)


def _load_builtin_algorithms() -> None:
    import importlib

    for mod in ("absolute_zero", "rlcr"):
        try:
            importlib.import_module(f"asyncrl.algos.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"asyncrl.algos.{mod}":
                raise


class Workflow:
    def __init__(self, cfg):
        self.cfg = cfg

    def rollout(self, tasks: list[Task], ctx: RolloutContext) -> list[Episode]:
        raise NotImplementedError


@register_workflow("grpo")
class GRPOWorkflow(Workflow):
    """``sampling.n`` rollouts per task through the environment; one Episode per task.

    ``counts`` (optional, one per task) overrides the rollouts of a task: experience replay assigns
    ``n - k`` fresh rollouts to a replay task whose ``k`` stored trajectories the learner adds."""

    supports_replay = True

    def rollout(self, tasks: list[Task], ctx: RolloutContext, counts: list[int] | None = None) -> list[Episode]:
        n = self.cfg.sampling.n
        counts = [n] * len(tasks) if counts is None else [int(c) for c in counts]
        if len(counts) != len(tasks) or any(c < 1 for c in counts):
            raise ValueError(f"counts must hold one positive rollout count per task; got {counts} for "
                             f"{len(tasks)} tasks")
        episode_ids = [new_id() for _ in tasks]
        convs = []
        for task, eid, c in zip(tasks, episode_ids, counts):
            convs += start_conversations(ctx.tokenizer, ctx.env, [task], c, group_ids=[eid])
        version = ctx.engine.version
        run_conversations(ctx.engine, ctx.tokenizer, ctx.env, convs, self.cfg.sampling,
                          self.cfg.env.max_turns, seed=ctx.seed)
        episodes = []
        offsets = [sum(counts[:i]) for i in range(len(counts) + 1)]
        for i, (task, eid) in enumerate(zip(tasks, episode_ids)):
            group = convs[offsets[i]:offsets[i + 1]]
            trajs = [c.to_trajectory(version, ctx.env.evaluate(task, c.history)) for c in group]
            rewards = [t.reward for t in trajs]
            episodes.append(Episode(trajectories=trajs, actor_id=ctx.actor_id, task=task, id=eid,
                                    created_at=time.time(),
                                    metrics={"reward_mean": sum(rewards) / len(rewards)}))
        return episodes
