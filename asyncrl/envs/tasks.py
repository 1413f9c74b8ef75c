"""Task sources: where prompts come from, validated before anything starts, with a real hold-out.

Sources (``tasks.type``, the registry :data:`TASK_SOURCES`): ``arithmetic`` (generated), ``file``
(JSONL, JSON list or Parquet at ``tasks.path``), ``hf_dataset`` (a split's data files of a Hugging
Face dataset in the local cache or a directory), ``reasoning_gym``, ``verifiers``, or an import path
``pkg.module:function`` returning Tasks or records (dicts).

Every record is checked when it is read, and the first bad one is a :class:`ConfigError` naming the
file and line (record for JSON/Parquet) and what was expected: bytes that are not UTF-8, JSON that
does not parse, a record larger than ``tasks.max_record_bytes``, a missing or malformed prompt
field, a missing answer field (``tasks.require_answer``: the built-in rewards need it; a task
without one would be rewarded 0 on every step).

The held-out set is never trained on:
- ``tasks.eval_path``: a file of its own (the whole training file is trained on);
- otherwise, for files and import paths, ``tasks.holdout_fraction`` of the tasks (at most
  ``tasks.eval_size``) are carved out with ``tasks.holdout_seed`` and removed from training;
- ``arithmetic``: ``tasks.eval_size`` distinct problems (at most ``tasks.holdout_fraction`` of all
  possible ones) drawn with their own seed, removed from the training stream.
:func:`describe_heldout` says which in one line (the learner logs it and prints it in its summary).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from ..config import ConfigError
from ..plugins import local_hub_snapshot
from ..registry import Registry
from ..types import Task
from .arithmetic import arithmetic_tasks

_EVAL_SEED_OFFSET = 1_000_003  # the arithmetic held-out draw: holdout_seed + this


# ---- reading and validating -------------------------------------------------------------------


def _task_from_record(rec: Any, where: str, cfg, src: str, idx: int) -> Task:
    """A Task from one record; ConfigError naming ``where`` (``file:line``) when it is malformed."""
    if not isinstance(rec, dict):
        raise ConfigError(
            f"{where}: a task record must be a JSON object with {cfg.prompt_field!r}, got {type(rec).__name__}"
        )
    if cfg.prompt_field not in rec:
        raise ConfigError(
            f"{where}: no field {cfg.prompt_field!r} (tasks.prompt_field); fields present: {sorted(rec)[:20]}"
        )
    prompt = rec[cfg.prompt_field]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif not (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    ):
        raise ConfigError(
            f"{where}: {cfg.prompt_field!r} must be a string or a non-empty list of "
            f"{{role, content}} messages with string values"
        )
    if cfg.require_answer and rec.get(cfg.answer_field) is None:
        raise ConfigError(
            f"{where}: no {cfg.answer_field!r} (tasks.answer_field), which the reward needs; "
            f"add it, or set tasks.require_answer=false if your reward does not use it"
        )
    meta = {k: v for k, v in rec.items() if k not in (cfg.prompt_field, cfg.answer_field, "id")}
    return Task(
        id=str(rec.get("id", f"{Path(src).stem}:{idx}")), prompt=prompt, answer=rec.get(cfg.answer_field), metadata=meta
    )


def _jsonl_records(p: Path, max_bytes: int) -> Iterator[tuple[str, Any]]:
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{p}:{lineno}"
            if len(raw) > max_bytes:
                raise ConfigError(
                    f"{where}: record of {len(raw):,} bytes, more than tasks.max_record_bytes ({max_bytes:,})"
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                    f"expected a UTF-8 encoded JSON object per line"
                ) from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"{where}: not valid JSON ({e.msg} at column {e.colno}); expected one JSON object per line"
                ) from None


def _whole_file_records(p: Path, max_bytes: int) -> Iterator[tuple[str, Any]]:
    if p.suffix == ".parquet":
        import pandas as pd

        try:
            records = pd.read_parquet(p).to_dict(orient="records")
        except Exception as e:  # noqa: BLE001 - pyarrow raises many types for a bad file
            raise ConfigError(f"{p}: cannot read it as Parquet ({type(e).__name__}: {e})") from None
    else:
        try:
            records = json.loads(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 (byte offset {e.start}); expected a UTF-8 JSON list") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(records, list):
            raise ConfigError(f"{p}: a .json task file must hold a list of records, got {type(records).__name__}")
    for i, rec in enumerate(records):
        where = f"{p} record {i}"
        size = len(json.dumps(rec, default=str).encode())
        if size > max_bytes:
            raise ConfigError(f"{where}: {size:,} bytes, more than tasks.max_record_bytes ({max_bytes:,})")
        yield where, rec


def load_task_file(path: str, cfg) -> list[Task]:
    """Validated tasks from a JSONL, JSON (list) or Parquet file (``cfg``: the TasksConfig)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"tasks file {p} does not exist" if not p.exists() else f"tasks file {p} is not a file")
    reader = _jsonl_records if p.suffix not in (".json", ".parquet") else _whole_file_records
    wheres, tasks = [], []
    for i, (where, rec) in enumerate(reader(p, cfg.max_record_bytes)):
        wheres.append(where)
        tasks.append(_task_from_record(rec, where, cfg, str(p), i))
    if not tasks:
        raise ConfigError(f"tasks file {p} holds no tasks")
    empty = [where for where, t in zip(wheres, tasks) if not "".join(m["content"] for m in t.prompt).strip()]
    if empty:
        print(
            f"[asyncrl] warning: {len(empty)} empty prompt(s) in {p} (the model sees only the chat template): "
            f"{', '.join(empty[:5])}{' ...' if len(empty) > 5 else ''}",
            file=sys.stderr,
            flush=True,
        )
    return tasks


def _file_tasks(cfg) -> list[Task]:
    if not cfg.path:
        raise ConfigError("tasks.type is 'file' but tasks.path is not set")
    return load_task_file(cfg.path, cfg)


DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


def _hf_dataset_tasks(cfg) -> list[Task]:
    """``tasks.type: hf_dataset``: the files of split ``tasks.kwargs.split`` (default ``train``) of a
    Hugging Face dataset: ``tasks.path`` a dataset id in the local Hugging Face cache (offline, as
    ``hf download --repo-type dataset`` leaves it) or a local directory of data files. A split's files
    are the Parquet, JSONL or JSON files whose name starts with it (``data/train-00000-of-00001.parquet``,
    ``train.jsonl``), read as ``tasks.type: file`` reads one."""
    if not cfg.path:
        raise ConfigError("tasks.type is 'hf_dataset' but tasks.path (a dataset id or directory) is not set")
    split = str(cfg.kwargs.get("split", "train"))
    root = Path(cfg.path).expanduser()
    if not root.is_dir():
        snapshot, cache = local_hub_snapshot(cfg.path, repo_type="dataset")
        if snapshot is None:
            raise ConfigError(
                f"tasks.path {cfg.path!r} is not a local directory and not a dataset in the local Hugging "
                f"Face cache ({cache}); nothing is downloaded at run time: get it where there is network "
                f"with `hf download --repo-type dataset {cfg.path}`, or give a local directory"
            )
        root = Path(snapshot)
    data = sorted(p for p in root.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())
    files = [p for p in data if p.name.startswith(f"{split}-") or p.stem == split or p.name.startswith(f"{split}.")]
    if not files:
        shown = ", ".join(str(p.relative_to(root)) for p in data[:8]) or "none"
        raise ConfigError(
            f"tasks.path {cfg.path!r}: no data file of split {split!r} (tasks.kwargs.split); data files there: {shown}"
        )
    return [t for f in files for t in load_task_file(str(f), cfg)]


# ``tasks.type``: a source is ``fn(tasks_cfg) -> all its tasks``, or None for a generated (endless) stream;
# a source with a library behind it is imported when named
TASK_SOURCES: Registry[Callable[..., "list[Task] | None"] | str] = Registry(
    "task source",
    {
        "arithmetic": lambda cfg: None,
        "file": _file_tasks,
        "hf_dataset": _hf_dataset_tasks,
        "reasoning_gym": "asyncrl.envs.rgym:reasoning_gym_tasks",
        "verifiers": "asyncrl.envs.verifiers_env:verifiers_source",
    },
)


def source_tasks(cfg) -> list[Task] | None:
    """All tasks of a finite source (a built-in name or an import path), validated; None for ``arithmetic``."""
    kind = cfg.type
    if kind in TASK_SOURCES:
        return TASK_SOURCES.resolve(kind, "tasks.type")(cfg)
    fn = TASK_SOURCES.resolve(kind, "tasks.type", what="function")
    items = list(fn(**cfg.kwargs))
    tasks = [
        t if isinstance(t, Task) else _task_from_record(t, f"{kind} item {i}", cfg, kind, i)
        for i, t in enumerate(items)
    ]
    if not tasks:
        raise ConfigError(f"tasks.type {kind}: the function returned no tasks")
    return tasks


# ---- the split --------------------------------------------------------------------------------


def split_tasks(cfg) -> tuple[list[Task] | None, list[Task]]:
    """``(training tasks, held-out tasks)``; training is None for ``arithmetic`` (a generated
    stream that :func:`task_stream` filters). Deterministic for a config (``tasks.holdout_seed``)."""
    if cfg.type == "reasoning_gym" and not cfg.eval_path:
        from .rgym import reasoning_gym_split

        return reasoning_gym_split(cfg)
    tasks = source_tasks(cfg)
    if cfg.eval_path:
        heldout = load_task_file(cfg.eval_path, cfg)[: cfg.eval_size]
        return tasks, heldout
    if tasks is None:
        space = (cfg.max_operand - cfg.min_operand + 1) ** 2 * len(set(cfg.ops))
        n, held = min(cfg.eval_size, int(space * cfg.holdout_fraction)), {}
        for t in arithmetic_tasks(cfg, cfg.holdout_seed + _EVAL_SEED_OFFSET):
            if len(held) >= n:
                break
            held.setdefault(t.id, t)
        return None, list(held.values())
    n = min(cfg.eval_size, int(len(tasks) * cfg.holdout_fraction))
    order = list(range(len(tasks)))
    random.Random(cfg.holdout_seed).shuffle(order)
    held = set(order[:n])
    return [t for i, t in enumerate(tasks) if i not in held], [tasks[i] for i in sorted(held)]


def describe_heldout(cfg, heldout: list[Task], train: list[Task] | None) -> str:
    """One line saying what the held-out set is and that it is not trained on."""
    if not heldout:
        return "no held-out set (tasks.eval_size or tasks.holdout_fraction is 0): no evaluation"
    if cfg.eval_path:
        return f"held-out: {len(heldout)} tasks from {cfg.eval_path} (tasks.eval_path)"
    if cfg.type == "reasoning_gym":
        return (
            f"held-out: {len(heldout)} reasoning-gym tasks drawn with seed {cfg.holdout_seed + 1_000_003}; "
            f"training tasks with the same question removed"
        )
    if train is None:
        return (
            f"held-out: {len(heldout)} distinct arithmetic problems drawn with seed "
            f"{cfg.holdout_seed + _EVAL_SEED_OFFSET}, removed from the training stream"
        )
    total = len(train) + len(heldout)
    return (
        f"held-out: {len(heldout)} of {total} tasks carved from {cfg.path or cfg.type} (tasks.holdout_fraction="
        f"{cfg.holdout_fraction:g}, tasks.holdout_seed={cfg.holdout_seed}), not trained on"
    )


def task_stream(cfg, seed: int) -> Iterator[Task]:
    """An endless training stream (each actor passes its own ``seed``) without the held-out tasks."""
    train, heldout = split_tasks(cfg)
    if train is None:
        held = {t.id for t in heldout}
        return (t for t in arithmetic_tasks(cfg, seed) if t.id not in held)
    return _cycle(train, seed)


def eval_tasks(cfg) -> list[Task]:
    """The held-out tasks (see the module doc)."""
    return split_tasks(cfg)[1]


def _cycle(tasks: list[Task], seed: int) -> Iterator[Task]:
    rng = random.Random(seed)
    order = list(range(len(tasks)))
    while True:
        rng.shuffle(order)
        for i in order:
            yield tasks[i]
