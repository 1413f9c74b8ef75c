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
from ..config import ConfigError
from ..envs.base import Environment
from ..envs.guard import EnvFailure
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
        raise ConfigError(f"algorithm: unknown algorithm {name!r}; available: {', '.join(sorted(WORKFLOWS))}")
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

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.algo:
            raise ConfigError(f"algorithm grpo takes no algo.* settings, got {', '.join(f'algo.{k}' for k in cfg.algo)}; "
                              f"algo.* configures absolute_zero and rlcr (GRPO is set by train.*, sampling.*)")

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
            trajs, failures = scored_trajectories(group, ctx.env, version)
            episodes.append(Episode(trajectories=trajs, actor_id=ctx.actor_id, task=task, id=eid,
                                    created_at=time.time(), decision=failure_record(failures, version),
                                    metrics=episode_metrics([t.reward for t in trajs], len(failures))))
        return episodes


def scored_trajectories(convs: list, env, version: int) -> tuple[list, list[str]]:
    """Trajectories of the conversations the environment scored, and the failure messages of the
    others (a failed reset, step or evaluate: ``asyncrl.envs.guard``); failed ones are not trained on."""
    trajs, failures = [], []
    for c in convs:
        if c.failure is None:
            try:
                trajs.append(c.to_trajectory(version, env.evaluate(c.task, c.history)))
                continue
            except EnvFailure as e:
                c.failure = str(e)
        failures.append(c.failure)
    return trajs, failures


def failure_record(failures: list[str], version: int) -> dict:
    """The ``decision`` fields for an episode with failed conversations (none: ``{}``). An episode
    whose conversations all failed keeps its policy version here (it has no trajectories)."""
    if not failures:
        return {}
    return {"failures": failures[:8], "num_failures": len(failures), "policy_version": version}


def episode_metrics(rewards: list[float], failures: int) -> dict[str, float]:
    out = {"env/failures": float(failures)}
    if rewards:
        out["reward_mean"] = sum(rewards) / len(rewards)
    return out
