"""The records of one run from any source, and its DataFrames (cached per change)."""

from __future__ import annotations

import threading
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from ..rundir.layout import EVENTS, METRICS, config_snapshot
from ..rundir.runlog import EVENTS_SCHEMA
from .frames import (
    actors_frame,
    episodes_frame,
    evals_frame,
    events_frames,
    kind_frame,
    metrics_frame,
    trajectories_frame,
)
from .jsonl import TruncatedRecordWarning, _Tail, read_records


def _event_key(rec: dict) -> tuple:
    return rec.get("kind"), rec.get("t"), rec.get("step"), rec.get("episode_id"), rec.get("actor_id")


class RunStore:
    """Thread-safe collection of a run's records from any source (files, the live socket).

    Events are de-duplicated by ``(kind, t, step, episode_id, actor_id)`` so that the same record
    read from ``events.jsonl`` and received on the events socket counts once; metrics keep the last
    record per step. With ``max_events_per_kind`` only the latest events of each kind are kept;
    ``counts`` still counts them all. ``revision`` grows with every change (views cache on it).
    """

    def __init__(self, max_events_per_kind: int | None = None):
        self._lock = threading.RLock()
        self._events: dict[str, list[dict]] = defaultdict(list)
        self._seen: set[tuple] = set()
        self.counts: dict[str, int] = defaultdict(int)  # events received per kind (kept or not)
        self._metrics: dict[int, dict] = {}
        self.config: dict[str, Any] = {}
        self.revision = 0
        self.max_events_per_kind = max_events_per_kind
        self.warnings: list[str] = []
        self.last_update = 0.0
        self.run_dir: Path | None = None  # set by a RunReader: where the learner's pid file is
        self._cache: dict[str, tuple[int, Any]] = {}

    def add_events(self, records: Iterable[dict]) -> int:
        added = 0
        with self._lock:
            for rec in records:
                if not isinstance(rec, dict) or not isinstance(rec.get("kind"), str):
                    self._warn(f"an event without a 'kind' was skipped: {str(rec)[:120]}")
                    continue
                if rec.get("schema", EVENTS_SCHEMA) != EVENTS_SCHEMA:
                    self._warn(f"event schema {rec.get('schema')!r} differs from {EVENTS_SCHEMA}; fields may differ")
                if rec["kind"] == "metrics":  # the live stream's per-step metrics
                    added += self.add_metrics(
                        [{"step": rec.get("step"), "t": rec.get("t"), **(rec.get("metrics") or {})}]
                    )
                    continue
                key = _event_key(rec)
                if key in self._seen:
                    continue
                self._seen.add(key)
                self.counts[rec["kind"]] += 1
                lst = self._events[rec["kind"]]
                lst.append(rec)
                if self.max_events_per_kind and len(lst) > self.max_events_per_kind:
                    del lst[: len(lst) - self.max_events_per_kind]
                added += 1
            if added:
                self._touch()
        return added

    def add_metrics(self, records: Iterable[dict]) -> int:
        added = 0
        with self._lock:
            for rec in records:
                step = rec.get("step")
                if not isinstance(step, int):
                    self._warn(f"a metrics record without an integer 'step' was skipped: {str(rec)[:120]}")
                    continue
                if self._metrics.get(step) != rec:
                    self._metrics[step] = rec
                    added += 1
            if added:
                self._touch()
        return added

    def _touch(self) -> None:
        self.revision += 1
        self.last_update = time.time()

    def _warn(self, msg: str) -> None:
        if msg not in self.warnings:
            self.warnings.append(msg)
            warnings.warn(msg, TruncatedRecordWarning, stacklevel=3)

    def records(self, kind: str) -> list[dict]:
        with self._lock:
            return list(self._events.get(kind, ()))

    def kinds(self) -> list[str]:
        with self._lock:
            return sorted(k for k, v in self._events.items() if v)

    def metric_records(self) -> list[dict]:
        with self._lock:
            return [self._metrics[s] for s in sorted(self._metrics)]

    def cached(self, name: str, build):
        """``build()`` memoised until the store changes."""
        with self._lock:
            hit = self._cache.get(name)
            if hit is not None and hit[0] == self.revision:
                return hit[1]
            rev = self.revision
        value = build()
        with self._lock:
            self._cache[name] = (rev, value)
        return value

    # -- derived views ----------------------------------------------------------------------------
    @property
    def algorithm(self) -> str | None:
        """From the config snapshot, else from the episodes' decision records."""
        if self.config.get("algorithm"):
            return str(self.config["algorithm"])
        for ep in self.records("episode")[-5:]:
            d = ep.get("decision") or {}
            if d.get("algorithm"):
                return str(d["algorithm"])
        return None

    @property
    def version(self) -> int:
        """The learner's latest policy version seen anywhere (metrics, events)."""
        best = 0
        m = self.metric_records()
        if m:
            best = max(best, int(m[-1].get("version", m[-1]["step"]) or 0))
        with self._lock:
            for recs in self._events.values():
                if recs:
                    best = max(best, int(recs[-1].get("step") or 0))
            for rec in self._events.get("weights_published", [])[-1:]:
                best = max(best, int(rec.get("version") or 0))
        return best

    @property
    def metrics(self) -> pd.DataFrame:
        return self.cached("metrics", lambda: metrics_frame(self.metric_records()))

    def frame(self, kind: str) -> pd.DataFrame:
        return self.cached(f"kind:{kind}", lambda: kind_frame(self.records(kind)))

    @property
    def events(self) -> dict[str, pd.DataFrame]:
        return {k: self.frame(k) for k in self.kinds()}

    def episodes(self) -> pd.DataFrame:
        return self.cached("episodes", lambda: episodes_frame(self.records("episode")))

    def trajectories(self) -> pd.DataFrame:
        return self.cached("trajectories", lambda: trajectories_frame(self.records("episode")))

    def table(self, name: str) -> pd.DataFrame:
        """An algorithm's own table over the logged episodes (``Workflow.tables``: e.g. Absolute Zero's
        ``azr_questions``, RLCR's ``rlcr_nodes``), computed once per revision of the run."""
        from ..plugins import resolve_import
        from ..rollout.workflow import all_workflows

        paths = {table: path for wf in all_workflows().values() for table, path in wf.tables.items()}
        if name not in paths:
            raise KeyError(f"no algorithm declares a table {name!r}; tables: {', '.join(sorted(paths)) or 'none'}")
        build = resolve_import(paths[name], "table")
        return self.cached(f"table:{name}", lambda: build(self.records("episode")))

    def evals(self) -> pd.DataFrame:
        return self.cached("evals", lambda: evals_frame(self.records("eval")))

    def actors(self, now: float | None = None) -> pd.DataFrame:
        """The actors' latest status as they reported it (``analysis.actor_statuses``: as the UI
        shows it, in the run's words once the run is over)."""
        return actors_frame(self.records("actor_status"), self.version, now)


class RunReader:
    """Follows a run directory: each ``poll()`` adds what was appended to ``metrics.jsonl`` and
    ``events.jsonl`` since the last call to ``store`` (and reads ``config.yaml`` once it exists)."""

    def __init__(self, run_dir: str | Path, store: RunStore | None = None):
        self.dir = Path(run_dir)
        self.store = store if store is not None else RunStore()
        self.store.run_dir = self.dir
        self._metrics = _Tail(self.dir / METRICS)
        self._events = _Tail(self.dir / EVENTS)
        self._config_mtime = None

    def poll(self) -> int:
        self._read_config()
        metrics, p1 = self._metrics.read()
        events, p2 = self._events.read()
        for p in p1 + p2:
            self.store._warn(p)
        return self.store.add_metrics(metrics) + self.store.add_events(events)

    @property
    def partial_bytes(self) -> int:
        """Bytes of unfinished last lines held back at the last poll."""
        return self._metrics.partial + self._events.partial

    def _read_config(self) -> None:
        path = config_snapshot(self.dir)
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime == self._config_mtime:
            return
        import yaml

        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            return  # being written: next poll
        if isinstance(data, dict):
            self.store.config = data
            self._config_mtime = mtime
            self.store._touch()


class Run(RunStore):
    """A run directory read once (``load_run``); ``refresh()`` reads what was appended since."""

    def __init__(self, run_dir: str | Path):
        super().__init__()
        self.dir = Path(run_dir)
        if not self.dir.is_dir():
            raise FileNotFoundError(f"run directory {self.dir} does not exist")
        self._reader = RunReader(self.dir, self)
        self.refresh()

    def refresh(self) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            added = self._reader.poll()
        partial = self._reader.partial_bytes
        for w in caught:
            warnings.warn(str(w.message), w.category, stacklevel=2)
        if partial:
            warnings.warn(
                f"{self.dir}: skipped an unfinished last line ({partial} bytes; the run is still "
                f"writing it, or it was cut short)",
                TruncatedRecordWarning,
                stacklevel=2,
            )
        return added


def load_run(run_dir: str | Path) -> Run:
    """Read a (finished or live) run directory; see :class:`Run`."""
    return Run(run_dir)


def load_events(run_dir: str | Path) -> dict[str, pd.DataFrame]:
    """One DataFrame per event kind of ``run_dir/events.jsonl`` (columns: the record's fields)."""
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for rec in read_records(Path(run_dir) / EVENTS):
        if isinstance(rec.get("kind"), str):
            by_kind[rec["kind"]].append(rec)
        else:
            warnings.warn(
                f"an event without a 'kind' was skipped: {str(rec)[:120]}", TruncatedRecordWarning, stacklevel=2
            )
    return events_frames(by_kind)


def load_metrics(run_dir: str | Path) -> pd.DataFrame:
    """``run_dir/metrics.jsonl`` as a DataFrame indexed by step (last record per step)."""
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    return metrics_frame(read_records(Path(run_dir) / METRICS))
