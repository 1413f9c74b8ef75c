"""Workflows: what an actor does with a batch of tasks, and the registry that names them.

A workflow turns tasks into Episodes (one per unit of work) with an engine, a tokenizer and an
environment (the :class:`RolloutContext`). GRPO is the plain one (``asyncrl.algos.grpo``): ``n``
rollouts per task, one Episode per task. An algorithm is a module in ``asyncrl/algos/`` that
registers its workflow class with :func:`register_workflow`; the registry finds it by scanning that
package the first time a name is unknown, so adding an algorithm touches only ``algos/`` (plus its
config and docs). ``algorithm: pkg.module:Class`` names a workflow outside the package.

What a workflow declares (class attributes, never probed):

- ``supports_replay``: it honours per-task rollout counts (experience replay assigns ``n - k``);
- ``per_task``: each task's episode depends on that task alone, so an actor with
  ``actor.weight_update: inflight`` may roll out every task of a batch on its own and send its episode
  as soon as its group is done (a batch then never waits for its slowest task);
- ``warmstart_formats``: supervised formats it adds to the embedded model's warm start
  (``model.embedded.warmstart_formats`` names them; ``asyncrl.models.tiny``);
- ``evaluate``: its own held-out evaluation, or None for the standard accuracy;
- ``warnings``: lines every process prints at start (e.g. an unsafe sandbox setting);
- ``counts_for_reward``: which trained trajectories the learner's ``reward_mean`` averages (fresh
  answers: not a proposer's or a confidence's row, not a replayed one);
- ``reward_metrics``: its own reward metrics, charted with ``reward_mean`` in the UI's reward section;
- ``tables``: its analysis tables over a run's logged episodes, ``name -> "pkg.module:function"``
  (``RunStore.table(name)``; imported when asked for, so actors never load pandas);
- ``algo_config``: the pydantic class that validates its ``algo:`` section (``asyncrl config`` shows it);
- ``views``: its tabs in ``asyncrl ui``, import paths of :class:`app.kit.AlgorithmView` subclasses
  (loaded by the UI only).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from ..config import ConfigError
from ..plugins import resolve_import
from ..registry import Registry
from ..types import Episode, Task, Trajectory

if TYPE_CHECKING:
    from ..config import Config, SamplingConfig
    from ..engine.base import Engine
    from ..envs.base import Environment

WarmstartFormat = Callable[[Any], "tuple[list[dict[str, str]], str]"]  # rng -> (messages, completion)


@dataclass
class RolloutContext:
    """What a workflow generates with, on one actor."""

    engine: "Engine"
    tokenizer: Any  # a Hugging Face tokenizer
    env: "Environment"
    cfg: "Config"
    actor_id: str
    seed: int


class Workflow:
    supports_replay: ClassVar[bool] = False
    per_task: ClassVar[bool] = False
    warmstart_formats: ClassVar[dict[str, WarmstartFormat]] = {}
    reward_metrics: ClassVar[tuple[str, ...]] = ()
    tables: ClassVar[dict[str, str]] = {}
    views: ClassVar[tuple[str, ...]] = ()
    algo_config: ClassVar[type | None] = None  # the pydantic class of its ``algo:`` section, if it has one

    @staticmethod
    def counts_for_reward(traj: Trajectory) -> bool:
        """Whether ``traj`` is a fresh answer that ``reward_mean`` averages."""
        return not traj.is_replay

    def __init__(self, cfg: "Config"):
        self.cfg = cfg
        self.warnings: list[str] = []

    def rollout(self, tasks: list[Task], ctx: RolloutContext, counts: list[int] | None = None) -> list[Episode]:
        """Episodes for ``tasks``; ``counts`` (only when ``supports_replay``) overrides the rollouts
        per task."""
        raise NotImplementedError

    def evaluate(
        self,
        engine: "Engine",
        tokenizer,
        env: "Environment",
        tasks: list[Task],
        sampling: "SamplingConfig",
        cfg: "Config",
    ) -> dict | None:
        """The workflow's own held-out figures (numbers become ``eval/<name>`` metrics), or None
        for the standard held-out accuracy (``asyncrl.learner.evaluate``)."""
        return None


WORKFLOWS: Registry[type[Workflow]] = Registry("algorithm")


def register_workflow(name: str):
    """Class decorator: make the workflow available as ``algorithm: name``."""
    return WORKFLOWS.register(name)


def workflow_class(name: str) -> type[Workflow]:
    """The workflow class for ``algorithm: name`` (a registered name or ``pkg.module:Class``)."""
    if ":" in name:
        cls = resolve_import(name, "algorithm")
        if not (isinstance(cls, type) and issubclass(cls, Workflow)):
            raise ConfigError(f"algorithm: {name!r} is not a Workflow subclass (asyncrl.rollout.Workflow)")
        return cls
    if name not in WORKFLOWS:
        _import_algorithms()
    if name not in WORKFLOWS:
        raise ConfigError(
            f"algorithm: unknown algorithm {name!r}; available: {', '.join(sorted(WORKFLOWS))}, or "
            f"an import path 'pkg.module:Class'"
        )
    return WORKFLOWS[name]


def get_workflow(name: str, cfg: "Config") -> Workflow:
    """A workflow instance for ``cfg`` (it validates its own ``algo.*`` section)."""
    return workflow_class(name)(cfg)


def all_workflows() -> dict[str, type[Workflow]]:
    """Every registered workflow by name, those of ``asyncrl.algos`` included."""
    _import_algorithms()
    return dict(WORKFLOWS)


def _import_algorithms() -> None:
    """Import every module of ``asyncrl.algos`` (each registers its workflow on import)."""
    package = importlib.import_module("asyncrl.algos")
    for info in pkgutil.iter_modules(package.__path__, prefix="asyncrl.algos."):
        importlib.import_module(info.name)
