"""Environments, reward functions and task sources.

An environment drives one conversation for one task. It is stateless across tasks: the actor keeps
the history, so one instance serves a whole batch. A multi-turn environment returns new messages
from ``step`` (a tool result, a user reply) until it says ``done``; ``evaluate`` then scores the
whole transcript. Named scores are kept on the trajectory; ``reward`` is what the learner trains on.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from ..plugins import resolve_import
from ..types import Task
from .arithmetic import arithmetic_reward, arithmetic_tasks

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


REWARDS: dict[str, RewardFn] = {"arithmetic": arithmetic_reward, "exact_match": exact_match_reward}


def get_reward_fn(spec: str) -> RewardFn:
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec and "." not in spec:
        raise ValueError(f"env.reward: unknown reward {spec!r}; built-in: {', '.join(REWARDS)}, "
                         f"or an import path 'pkg.module:function'")
    return resolve_import(spec, "env.reward")


def scores_from(value: Any) -> dict[str, float]:
    """A reward function may return a float or a dict of named scores with a ``reward`` key."""
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"reward function returned {sorted(value)}; a dict must include 'reward'")
        return {k: float(v) for k, v in value.items()}
    return {"reward": float(value)}


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
ENVS: dict[str, "type | str"] = {"single_turn": SingleTurnEnv,
                                 "calculator": "asyncrl.envs.calculator:CalculatorEnv"}


def make_env(env_cfg) -> Environment:
    """Build the environment named by ``env.type`` (built-in name or import path)."""
    spec = env_cfg.type
    if spec in ENVS:
        cls = ENVS[spec]
        if isinstance(cls, str):
            cls = resolve_import(cls, "env.type")
    elif ":" in spec or "." in spec:
        cls = resolve_import(spec, "env.type")
    else:
        raise ValueError(f"env.type: unknown environment {spec!r}; built-in: {', '.join(ENVS)}, "
                         f"or an import path 'pkg.module:Class'")
    env = cls(reward=env_cfg.reward, max_turns=env_cfg.max_turns, **env_cfg.kwargs)
    for method in ("reset", "step", "evaluate"):
        if not callable(getattr(env, method, None)):
            raise TypeError(f"env.type {spec!r}: the environment has no {method}() method")
    return env


# ---- task sources ---------------------------------------------------------------------------

def _task_from_record(rec: dict[str, Any], idx: int, prompt_field: str, answer_field: str, src: str) -> Task:
    if prompt_field not in rec:
        raise ValueError(f"{src} record {idx}: no field {prompt_field!r} (tasks.prompt_field); "
                         f"fields present: {sorted(rec)}")
    prompt = rec[prompt_field]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif not (isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                               for m in prompt)):
        raise ValueError(f"{src} record {idx}: {prompt_field!r} must be a string or a list of "
                         f"{{role, content}} messages")
    meta = {k: v for k, v in rec.items() if k not in (prompt_field, answer_field, "id")}
    return Task(id=str(rec.get("id", f"{Path(src).stem}:{idx}")), prompt=prompt,
                answer=rec.get(answer_field), metadata=meta)


def load_task_file(path: str, prompt_field: str = "prompt", answer_field: str = "answer") -> list[Task]:
    """Tasks from a JSONL, JSON (list) or Parquet file."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tasks.path: {p} does not exist")
    if p.suffix == ".parquet":
        import pandas as pd

        records = pd.read_parquet(p).to_dict(orient="records")
    elif p.suffix == ".json":
        records = json.loads(p.read_text())
    else:
        records = []
        for i, line in enumerate(p.read_text().splitlines()):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{i + 1}: not valid JSON ({e.msg})") from None
    tasks = [_task_from_record(r, i, prompt_field, answer_field, str(p)) for i, r in enumerate(records)]
    if not tasks:
        raise ValueError(f"tasks.path: {p} holds no tasks")
    return tasks


def _cycle(tasks: list[Task], seed: int) -> Iterator[Task]:
    import random

    rng = random.Random(seed)
    order = list(range(len(tasks)))
    while True:
        rng.shuffle(order)
        for i in order:
            yield tasks[i]


def task_stream(tasks_cfg, seed: int) -> Iterator[Task]:
    """An endless task stream for training (each actor passes its own seed)."""
    kind = tasks_cfg.type
    if kind == "arithmetic":
        return arithmetic_tasks(tasks_cfg, seed)
    if kind == "file":
        if not tasks_cfg.path:
            raise ValueError("tasks.type is 'file' but tasks.path is not set")
        return _cycle(load_task_file(tasks_cfg.path, tasks_cfg.prompt_field, tasks_cfg.answer_field), seed)
    if ":" in kind or "." in kind:
        fn = resolve_import(kind, "tasks.type")
        items = list(fn(**tasks_cfg.kwargs))
        tasks = [t if isinstance(t, Task) else _task_from_record(t, i, tasks_cfg.prompt_field,
                                                                  tasks_cfg.answer_field, kind)
                 for i, t in enumerate(items)]
        return _cycle(tasks, seed)
    raise ValueError(f"tasks.type: unknown task source {kind!r}; expected 'arithmetic', 'file', or "
                     f"an import path 'pkg.module:function'")


def eval_tasks(tasks_cfg, seed: int) -> list[Task]:
    """A fixed held-out list (arithmetic: drawn with a separate seed)."""
    stream = task_stream(tasks_cfg, seed + 1_000_003)
    return [next(stream) for _ in range(tasks_cfg.eval_size)]
