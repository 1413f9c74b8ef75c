"""``tasks.type=reasoning_gym``: procedural tasks from reasoning-gym, scored by each dataset's own
``score_answer``.

``tasks.kwargs``:

- ``datasets``: a dataset name, a list of names, or a mapping ``name -> weight`` or
  ``name -> {weight: w, <the dataset's config>}`` (e.g. ``{basic_arithmetic: {weight: 2, max_terms: 3}}``);
- ``size``: training tasks (default 10,000); ``seed``: their seed (default 0).

The held-out set is ``tasks.eval_size`` tasks drawn with their own seed (``tasks.holdout_seed`` +
1,000,003); any training task whose question is also a held-out question is removed from training,
so the two never overlap. The reward (``env.reward=reasoning_gym``, the default with this source)
is ``score_answer(answer, entry)`` of the task's own dataset, on the text inside the last
``<answer>...</answer>`` of the reply (the whole reply when there is none).
"""

from __future__ import annotations

import re
from typing import Any

from ..config import ConfigError
from ..types import Task

DEFAULT_SIZE = 10_000
_EVAL_SEED_OFFSET = 1_000_003
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def _require():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(
            "tasks.type=reasoning_gym needs the reasoning-gym package: pip install 'asyncrl[envs]'"
        ) from None
    return reasoning_gym


def _specs(datasets: Any) -> list[tuple[str, float, dict]]:
    """``(name, weight, config)`` per dataset from the ``datasets`` setting (module doc)."""
    if isinstance(datasets, str):
        datasets = [datasets]
    if isinstance(datasets, list):
        datasets = {name: 1.0 for name in datasets}
    if not isinstance(datasets, dict) or not datasets:
        raise ConfigError(
            "tasks.kwargs.datasets: expected a dataset name, a list of names or a mapping name -> "
            f"weight (or name -> {{weight, config...}}), got {datasets!r}"
        )
    out = []
    for name, spec in datasets.items():
        if isinstance(spec, (int, float)) and not isinstance(spec, bool):
            weight, config = float(spec), {}
        elif isinstance(spec, dict):
            config = dict(spec)
            weight = float(config.pop("weight", 1.0))
        else:
            raise ConfigError(f"tasks.kwargs.datasets.{name}: expected a weight or a mapping, got {spec!r}")
        if weight <= 0:
            raise ConfigError(f"tasks.kwargs.datasets.{name}: the weight must be positive, got {weight}")
        out.append((str(name), weight, config))
    return out


def _draw(rg, specs, size: int, seed: int) -> list[dict]:
    from reasoning_gym.composite import DatasetSpec

    names = sorted(getattr(rg.factory, "DATASETS", {}))
    for name, _, config in specs:
        if names and name not in names:
            raise ConfigError(
                f"tasks.kwargs.datasets: reasoning-gym has no dataset {name!r} (it has {len(names)}, "
                f"e.g. {', '.join(names[:8])})"
            )
        try:
            rg.create_dataset(name, size=1, seed=0, **config)
        except (TypeError, ValueError, AssertionError) as e:
            raise ConfigError(f"tasks.kwargs.datasets.{name}: reasoning-gym refused its config {config}: {e}") from None
    if len(specs) == 1:
        name, _, config = specs[0]
        ds = rg.create_dataset(name, size=size, seed=seed, **config)
    else:
        ds = rg.create_dataset("composite", size=size, seed=seed, datasets=[DatasetSpec(n, w, c) for n, w, c in specs])
    return [ds[i] for i in range(size)]


def _task(entry: dict, split: str, i: int) -> Task:
    meta = entry.get("metadata") or {}
    name = meta.get("source_dataset", "reasoning_gym")
    return Task(
        id=f"rg:{name}:{split}:{i}",
        prompt=[{"role": "user", "content": str(entry["question"])}],
        answer=entry.get("answer"),
        metadata={"dataset": name, "entry": _plain(entry)},
    )


def _plain(value: Any) -> Any:
    """JSON/msgpack-safe copy (tuples to lists, other objects to strings)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def reasoning_gym_split(cfg) -> tuple[list[Task], list[Task]]:
    """``(training tasks, held-out tasks)`` for ``tasks.type=reasoning_gym`` (module doc)."""
    rg = _require()
    kw = dict(cfg.kwargs)
    unknown = sorted(set(kw) - {"datasets", "size", "seed"})
    if unknown:
        raise ConfigError(
            f"tasks.kwargs: unknown key(s) {unknown} for tasks.type=reasoning_gym; expected datasets, size, seed"
        )
    if "datasets" not in kw:
        raise ConfigError("tasks.type=reasoning_gym needs tasks.kwargs.datasets (e.g. {basic_arithmetic: 1})")
    specs = _specs(kw["datasets"])
    size, seed = int(kw.get("size", DEFAULT_SIZE)), int(kw.get("seed", 0))
    if size < 1:
        raise ConfigError(f"tasks.kwargs.size must be >= 1, got {size}")
    heldout = (
        [
            _task(e, "eval", i)
            for i, e in enumerate(_draw(rg, specs, cfg.eval_size, cfg.holdout_seed + _EVAL_SEED_OFFSET))
        ]
        if cfg.eval_size
        else []
    )
    held_questions = {t.prompt[0]["content"] for t in heldout}
    train = [
        t
        for t in (_task(e, "train", i) for i, e in enumerate(_draw(rg, specs, size, seed)))
        if t.prompt[0]["content"] not in held_questions
    ]
    if not train:
        raise ConfigError(
            "tasks.type=reasoning_gym: every training task is also a held-out task; raise tasks.kwargs.size"
        )
    return train, heldout


def reasoning_gym_tasks(cfg) -> list[Task]:
    """``tasks.type=reasoning_gym``: the training tasks (the held-out ones are :func:`reasoning_gym_split`'s)."""
    return reasoning_gym_split(cfg)[0]


def extract_answer(response: str) -> str:
    found = _ANSWER.findall(response)
    return (found[-1] if found else response).strip()


def reasoning_gym_reward(task: Task, response: str) -> float:
    """The task's dataset's own ``score_answer`` on the reply's answer (module doc)."""
    rg = _require()
    entry = (task.metadata or {}).get("entry")
    if not isinstance(entry, dict):
        raise ValueError(
            f"task {task.id} has no reasoning-gym entry in its metadata (env.reward=reasoning_gym needs "
            f"tasks.type=reasoning_gym)"
        )
    score = rg.get_score_answer_fn(task.metadata["dataset"])(extract_answer(response), entry)
    return float(score)
