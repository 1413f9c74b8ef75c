"""Environments, reward functions and task sources.

An environment drives one conversation for one task. It is stateless across tasks: the actor keeps
the history, so one instance serves a whole batch. A multi-turn environment returns new messages
from ``step`` (a tool result, a user reply) until it says ``done``; ``evaluate`` then scores the
whole transcript. Named scores are kept on the trajectory; ``reward`` is what the learner trains on.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..config import ConfigError
from ..registry import Registry
from ..types import Task
from .arithmetic import arithmetic_reward
from .guard import GuardedEnv, validate_scores

Message = dict[str, str]
RewardFn = Callable[[Task, str], "float | dict[str, float]"]


@dataclass
class StepResult:
    """What the environment answers to one assistant turn."""

    messages: list[Message] = field(default_factory=list)  # appended before the next assistant turn
    done: bool = True


class Environment(Protocol):
    def reset(self, task: Task) -> list[Message]:
        """The opening messages (usually ``task.prompt``)."""

    def step(self, task: Task, history: list[Message], response: str) -> StepResult:
        """React to the assistant's latest ``response`` (already appended to ``history``)."""

    def evaluate(self, task: Task, history: list[Message]) -> dict[str, float]:
        """Named scores for the finished conversation; must include ``reward``."""


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD-style normalisation)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match_reward(task: Task, response: str) -> float:
    golds = task.answer if isinstance(task.answer, list) else [task.answer]
    return float(any(normalize_answer(response) == normalize_answer(str(g)) for g in golds))


REWARDS: Registry[RewardFn] = Registry(
    "reward",
    {
        "arithmetic": arithmetic_reward,
        "exact_match": exact_match_reward,
        "last_number": "asyncrl.envs.answer_checks:last_number_reward",
        "reasoning_gym": "asyncrl.envs.rgym:reasoning_gym_reward",
    },
)


def get_reward_fn(spec: str) -> RewardFn:
    return REWARDS.resolve(spec, "env.reward", what="function")


def scores_from(value: Any) -> dict[str, float]:
    """A reward function may return a finite float or a dict of finite named scores with a ``reward``
    key; anything else (a string, NaN, a dict without ``reward``) raises ScoresError saying what."""
    return validate_scores(value)


class SingleTurnEnv:
    """One assistant reply, scored by a reward function."""

    def __init__(self, reward: str = "arithmetic", **_: Any):
        self.reward_fn = get_reward_fn(reward)

    def reset(self, task: Task) -> list[Message]:
        return [dict(m) for m in task.prompt]

    def step(self, task: Task, history: list[Message], response: str) -> StepResult:
        return StepResult(done=True)

    def evaluate(self, task: Task, history: list[Message]) -> dict[str, float]:
        last = next((m["content"] for m in reversed(history) if m["role"] == "assistant"), "")
        return scores_from(self.reward_fn(task, last))


# built-in environments: a class, or an import path loaded on first use
ENVS: Registry["type | str"] = Registry(
    "environment",
    {
        "single_turn": SingleTurnEnv,
        "calculator": "asyncrl.envs.calculator:CalculatorEnv",
        "agent": "asyncrl.envs.agent:AgentEnv",
        "verifiers": "asyncrl.envs.verifiers_env:VerifiersEnv",
    },
)


def make_env(env_cfg, stop_on_failures: bool = True) -> "GuardedEnv":
    """Build the environment named by ``env.type`` (built-in name or import path), guarded
    (``asyncrl.envs.guard``): its calls time out, and a failing call raises EnvFailure. With
    ``stop_on_failures`` too many failures raise TooManyFailures (``env.max_failure_rate``)."""
    spec = env_cfg.type
    cls = ENVS.resolve(spec, "env.type", what="Class")
    try:
        extra = {"agent": env_cfg.agent} if env_cfg.agent else {}
        env = cls(reward=env_cfg.reward, max_turns=env_cfg.max_turns, **extra, **env_cfg.kwargs)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's class rejected its arguments
        raise ConfigError(
            f"env.type {spec!r}: constructing it with reward={env_cfg.reward!r}, max_turns="
            f"{env_cfg.max_turns} and env.kwargs {sorted(env_cfg.kwargs)} raised "
            f"{type(e).__name__}: {e}"
        ) from None
    for method in ("reset", "step", "evaluate"):
        if not callable(getattr(env, method, None)):
            raise ConfigError(f"env.type {spec!r}: the environment has no {method}() method")
    name = f"env.reward {env_cfg.reward}" if spec == "single_turn" else f"env.type {spec} (env.reward {env_cfg.reward})"
    return GuardedEnv(env, name, env_cfg.call_timeout_s, env_cfg.max_failure_rate if stop_on_failures else None)
