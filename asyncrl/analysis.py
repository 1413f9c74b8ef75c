"""Reading a run directory into pandas: metrics, events per kind, and the algorithms' tables.

Works on finished runs and on runs still being written (the learner flushes one JSON line at a
time; see docs/events.md). A line without its newline yet (a live writer's tail) is not read; a
complete line that is not a JSON object (a record cut short by a crash) is skipped. Both are
reported with a :class:`TruncatedRecordWarning`, never an exception.

One-shot::

    from asyncrl.analysis import load_run
    run = load_run("runs/absolute_zero")
    run.metrics                 # one row per optimizer step, indexed by step
    run.events["episode"]       # one DataFrame per event kind
    run.azr_questions()         # Absolute Zero: one row per proposed question
    run.rlcr_nodes()            # RLCR: one row per confidence (answer columns repeated)

Following a live run: keep a :class:`RunReader` and call ``poll()``; it reads only what was
appended since the last call and leaves an unfinished last line for the next one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from .runlog import EVENTS_SCHEMA

__all__ = ["TruncatedRecordWarning", "RunStore", "RunReader", "Run", "load_run", "load_events",
           "load_metrics", "read_records", "metrics_frame", "events_frames", "episodes_frame",
           "trajectories_frame", "azr_groups_frame", "azr_questions_frame", "rlcr_nodes_frame",
           "evals_frame", "reliability_frame", "actors_frame", "staleness_counts", "demo_run",
           "TINY_MODEL_OVERRIDES", "RunState", "run_state", "is_run_dir", "list_runs", "metric_columns",
           "smooth", "curves_frame", "eval_series", "calibration_summary", "NA"]


class TruncatedRecordWarning(UserWarning):
    """A line of a run file was skipped: unfinished (live tail) or not a JSON object (cut short)."""


# ------------------------------------------------------------------------------------- reading
def _parse_lines(data: bytes, path: Path, first_line: int) -> tuple[list[dict], list[str]]:
    """Records of complete lines in ``data``; problems as messages (not raised)."""
    records, problems = [], []
    for i, raw in enumerate(data.split(b"\n")[:-1]):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            problems.append(f"{path}: line {first_line + i} is not valid JSON ({e.msg if hasattr(e, 'msg') else e}); "
                            f"skipped (a record cut short?)")
            continue
        if not isinstance(rec, dict):
            problems.append(f"{path}: line {first_line + i} is a JSON {type(rec).__name__}, not an object; skipped")
            continue
        records.append(rec)
    return records, problems


class _Tail:
    """Incremental reader of one JSON-lines file: complete lines only, from a byte offset."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0
        self.line = 1
        self.partial = 0  # bytes of an unfinished last line seen at the last read

    def read(self) -> tuple[list[dict], list[str]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return [], []
        if size < self.offset:  # the file was replaced (a new run under the same name)
            self.offset, self.line = 0, 1
        if size == self.offset:
            self.partial = 0
            return [], []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n") + 1  # complete lines only
        self.partial = len(data) - end
        records, problems = _parse_lines(data[:end], self.path, self.line)
        self.offset += end
        self.line += data[:end].count(b"\n")
        return records, problems


def read_records(path: str | Path) -> list[dict]:
    """All complete JSON-object lines of ``path`` ([] if it does not exist). Warns
    (:class:`TruncatedRecordWarning`) for a corrupt line and for an unfinished last line."""
    tail = _Tail(Path(path))
    records, problems = tail.read()
    for p in problems:
        warnings.warn(p, TruncatedRecordWarning, stacklevel=2)
    if tail.partial:
        warnings.warn(f"{path}: skipped an unfinished last line ({tail.partial} bytes; the run is "
                      f"still writing it, or it was cut short)", TruncatedRecordWarning, stacklevel=2)
    return records


# ------------------------------------------------------------------------------------- the store
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
                    added += self.add_metrics([{"step": rec.get("step"), "t": rec.get("t"),
                                                **(rec.get("metrics") or {})}])
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
            if d.get("kind") == "rlcr_tree":
                return "rlcr"
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
        return self.cached(f"kind:{kind}", lambda: _kind_frame(self.records(kind)))

    @property
    def events(self) -> dict[str, pd.DataFrame]:
        return {k: self.frame(k) for k in self.kinds()}

    def episodes(self) -> pd.DataFrame:
        return self.cached("episodes", lambda: episodes_frame(self.records("episode")))

    def trajectories(self) -> pd.DataFrame:
        return self.cached("trajectories", lambda: trajectories_frame(self.records("episode")))

    def azr_groups(self) -> pd.DataFrame:
        return self.cached("azr_groups", lambda: azr_groups_frame(self.records("episode")))

    def azr_questions(self) -> pd.DataFrame:
        return self.cached("azr_questions", lambda: azr_questions_frame(self.records("episode")))

    def rlcr_nodes(self) -> pd.DataFrame:
        return self.cached("rlcr_nodes", lambda: rlcr_nodes_frame(self.records("episode")))

    def evals(self) -> pd.DataFrame:
        return self.cached("evals", lambda: evals_frame(self.records("eval")))

    def actors(self, now: float | None = None) -> pd.DataFrame:
        return actors_frame(self.records("actor_status"), self.version, now)


class RunReader:
    """Follows a run directory: each ``poll()`` adds what was appended to ``metrics.jsonl`` and
    ``events.jsonl`` since the last call to ``store`` (and reads ``config.yaml`` once it exists)."""

    def __init__(self, run_dir: str | Path, store: RunStore | None = None):
        self.dir = Path(run_dir)
        self.store = store if store is not None else RunStore()
        self.store.run_dir = self.dir
        self._metrics = _Tail(self.dir / "metrics.jsonl")
        self._events = _Tail(self.dir / "events.jsonl")
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
        path = self.dir / "config.yaml"
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
            warnings.warn(f"{self.dir}: skipped an unfinished last line ({partial} bytes; the run is still "
                          f"writing it, or it was cut short)", TruncatedRecordWarning, stacklevel=2)
        return added


def load_run(run_dir: str | Path) -> Run:
    """Read a (finished or live) run directory; see :class:`Run`."""
    return Run(run_dir)


def load_events(run_dir: str | Path) -> dict[str, pd.DataFrame]:
    """One DataFrame per event kind of ``run_dir/events.jsonl`` (columns: the record's fields)."""
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for rec in read_records(Path(run_dir) / "events.jsonl"):
        if isinstance(rec.get("kind"), str):
            by_kind[rec["kind"]].append(rec)
        else:
            warnings.warn(f"an event without a 'kind' was skipped: {str(rec)[:120]}", TruncatedRecordWarning)
    return events_frames(by_kind)


def load_metrics(run_dir: str | Path) -> pd.DataFrame:
    """``run_dir/metrics.jsonl`` as a DataFrame indexed by step (last record per step)."""
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    return metrics_frame(read_records(Path(run_dir) / "metrics.jsonl"))


# ------------------------------------------------------------------------------------- frames
def metrics_frame(records: list[dict]) -> pd.DataFrame:
    if not records:
        return pd.DataFrame(columns=["step", "t", "version"]).set_index("step")
    df = pd.DataFrame.from_records(records)
    df = df.drop_duplicates("step", keep="last").sort_values("step").set_index("step", drop=False)
    df.index.name = None
    return df


def _kind_frame(records: list[dict]) -> pd.DataFrame:
    if not records:
        return pd.DataFrame(columns=["schema", "kind", "t", "step"])
    return pd.DataFrame.from_records(records)


def events_frames(by_kind: dict[str, list[dict]]) -> dict[str, pd.DataFrame]:
    return {k: _kind_frame(v) for k, v in sorted(by_kind.items())}


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
    return "" if prompt is None else str(prompt)


def episodes_frame(episodes: list[dict]) -> pd.DataFrame:
    """One row per logged episode."""
    rows = []
    for e in episodes:
        trajs = e.get("trajectories") or []
        learn = [t for t in trajs if t.get("sample_type") != "proposer"]
        d = e.get("decision") or {}
        rows.append({"step": e.get("step"), "t": e.get("t"), "episode_id": e.get("episode_id"),
                     "actor_id": e.get("actor_id"), "task_id": e.get("task_id"),
                     "prompt": _prompt_text(e.get("prompt")), "policy_version": e.get("policy_version"),
                     "staleness": e.get("staleness"), "num_trajectories": len(trajs),
                     "num_replay": sum(bool(t.get("is_replay")) for t in trajs),
                     "reward_mean": float(np.mean([t.get("reward") or 0.0 for t in learn])) if learn else np.nan,
                     "algorithm": d.get("algorithm") or ("rlcr" if d.get("kind") == "rlcr_tree" else None),
                     **{f"m:{k}": v for k, v in (e.get("metrics") or {}).items()}})
    return pd.DataFrame(rows, columns=None if rows else ["step", "episode_id", "policy_version", "staleness"])


def trajectories_frame(episodes: list[dict]) -> pd.DataFrame:
    """One row per trajectory of the logged episodes."""
    rows = []
    for e in episodes:
        for t in e.get("trajectories") or []:
            rows.append({"step": e.get("step"), "episode_id": e.get("episode_id"),
                         "episode_policy_version": e.get("policy_version"), **{k: v for k, v in t.items()}})
    return pd.DataFrame(rows, columns=None if rows else ["step", "episode_id", "id", "sample_type", "reward",
                                                          "policy_version", "is_replay"])


def _azr(e: dict) -> dict | None:
    d = e.get("decision") or {}
    return d if d.get("algorithm") == "absolute_zero" else None


def azr_groups_frame(episodes: list[dict]) -> pd.DataFrame:
    """Absolute Zero: one row per seed prompt (episode): its final question group."""
    rows = []
    for e in episodes:
        d = _azr(e)
        if d is None:
            continue
        final = (d.get("attempts") or [{}])[-1]
        qs = final.get("questions") or []
        sampled = d.get("sampled_index", -1)
        rows.append({"step": e.get("step"), "episode_id": e.get("episode_id"),
                     "seed_prompt": d.get("seed_prompt"), "policy_version": d.get("policy_version"),
                     "attempts": len(d.get("attempts") or []), "repropose_attempts": d.get("repropose_attempts", 0),
                     "final_status": d.get("final_status"), "kept": bool(d.get("kept")),
                     "num_questions": len(qs), "num_learnable": sum(bool(q.get("learnable")) for q in qs),
                     "num_invalid": sum(not q.get("valid") for q in qs),
                     "sampled_index": sampled,
                     "sampled_question": qs[sampled].get("question") if 0 <= sampled < len(qs) else None,
                     "proposer_reward_mean": float(np.mean(d["proposer_rewards"])) if d.get("proposer_rewards") else np.nan})
    return pd.DataFrame(rows, columns=None if rows else ["step", "episode_id", "seed_prompt", "final_status", "kept"])


def azr_questions_frame(episodes: list[dict]) -> pd.DataFrame:
    """Absolute Zero: one row per proposed question of every attempt, with per-dimension
    ``ratio:<dim>`` / ``passed:<dim>`` and the dimension's window ``window:<dim>``.

    ``final`` marks the attempt that counted; ``sampled`` the question whose responses were
    trained; ``proposer_reward`` is set on the final attempt's questions; ``difficulty`` is
    ``1 - solve_rate`` (NaN for an invalid question)."""
    rows = []
    for e in episodes:
        d = _azr(e)
        if d is None:
            continue
        dims = {x["name"]: x for x in d.get("dimensions") or []}
        attempts = d.get("attempts") or []
        rewards = d.get("proposer_rewards") or []
        for a in attempts:
            final = a is attempts[-1]
            for q in a.get("questions") or []:
                idx = q.get("index", 0)
                row = {"step": e.get("step"), "episode_id": e.get("episode_id"), "seed_prompt": d.get("seed_prompt"),
                       "attempt": a.get("attempt"), "final": final, "group_status": a.get("status"),
                       "repropose_attempts": d.get("repropose_attempts", 0), "index": idx,
                       "proposal": q.get("proposal"), "valid": bool(q.get("valid")), "reason": q.get("reason"),
                       "question": q.get("question"), "answer": q.get("answer"),
                       "learnable": bool(q.get("learnable")),
                       "sampled": final and idx == a.get("sampled_index", -1) and idx >= 0,
                       "proposer_reward": rewards[idx] if final and idx < len(rewards) else np.nan,
                       "solve_rate": q.get("solve_rate") if q.get("solve_rate") is not None else np.nan,
                       "num_responses": len(q.get("responses") or []),
                       "responses": list(q.get("responses") or []), "rewards": list(q.get("rewards") or []),
                       "score_errors": list(q.get("score_errors") or [])}
                row["difficulty"] = 1.0 - row["solve_rate"] if row["valid"] else np.nan
                for name, dim in dims.items():
                    row[f"ratio:{name}"] = (q.get("ratios") or {}).get(name, np.nan)
                    row[f"passed:{name}"] = (q.get("passed") or {}).get(name)
                    row[f"window:{name}"] = (f"{'>' if dim.get('direction') == 'above' else '<'}"
                                             f"{dim.get('threshold')} in [{dim.get('min_ratio')}, {dim.get('max_ratio')}]")
                rows.append(row)
    return pd.DataFrame(rows, columns=None if rows else ["step", "episode_id", "seed_prompt", "attempt", "final",
                                                          "index", "question", "valid", "learnable", "sampled"])


def rlcr_nodes_frame(episodes: list[dict]) -> pd.DataFrame:
    """RLCR: one row per confidence node (prompt -> answer k -> confidence h); an answer without
    confidences gets one row with ``h`` NaN. ``correct`` is the answer's ``acc_reward``; ``brier_reward``
    the confidence's reward ``1 - (correct - confidence)^2``."""
    rows = []
    for e in episodes:
        d = e.get("decision") or {}
        if d.get("kind") != "rlcr_tree":
            continue
        base = {"step": e.get("step"), "episode_id": e.get("episode_id"), "prompt": _prompt_text(e.get("prompt")),
                "gold": d.get("gold"), "policy_version": e.get("policy_version")}
        for a in d.get("answers") or []:
            ans = {**base, "k": a.get("k"), "answer_text": a.get("text"), "answer": a.get("answer"),
                   "answer_format_ok": bool(a.get("format_ok")), "correct": a.get("acc_reward"),
                   "answer_advantage": a.get("advantage")}
            confs = a.get("confidences") or []
            if not confs:
                rows.append({**ans, "h": np.nan})
            for c in confs:
                rows.append({**ans, "h": c.get("h"), "confidence_text": c.get("text"),
                             "confidence": c.get("confidence") if c.get("confidence") is not None else np.nan,
                             "confidence_format_ok": bool(c.get("format_ok")), "brier_reward": c.get("conf_reward"),
                             "confidence_advantage": c.get("advantage")})
    return pd.DataFrame(rows, columns=None if rows else ["step", "episode_id", "prompt", "k", "correct", "h",
                                                          "confidence", "brier_reward"])


def evals_frame(evals: list[dict]) -> pd.DataFrame:
    if not evals:
        return pd.DataFrame(columns=["step", "version", "accuracy"])
    df = pd.DataFrame.from_records(evals)
    return df.sort_values("step", kind="stable").reset_index(drop=True)


def reliability_frame(eval_record: dict) -> pd.DataFrame:
    """The reliability bins of one ``eval`` record (RLCR): lo, hi, count, confidence, accuracy."""
    bins = eval_record.get("reliability")
    if not bins:
        raise ValueError("this eval record has no 'reliability' bins (not an RLCR run?)")
    return pd.DataFrame(bins)


def actors_frame(statuses: list[dict], learner_version: int, now: float | None = None) -> pd.DataFrame:
    """Latest status per actor: weights version in use, lag behind the learner, age of the status."""
    now = time.time() if now is None else now
    latest: dict[str, dict] = {}
    for s in statuses:
        latest[str(s.get("actor_id"))] = s
    rows = []
    for actor_id, s in sorted(latest.items()):
        version = s.get("version")
        age = now - float(s.get("t") or now)
        state = "stopping" if s.get("stopping") else ("silent" if age > 30 else "active")
        rows.append({"actor_id": actor_id, "status": state, "weights_version": version,
                     "lag": learner_version - version if isinstance(version, int) else None,
                     "batches": s.get("batches"), "weight_updates": s.get("weight_updates"),
                     "credits": s.get("credits"), "unacked": s.get("unacked"), "capacity": s.get("capacity"),
                     "generate_s": s.get("generate_s"), "last_status_s_ago": round(age, 1)})
    return pd.DataFrame(rows, columns=None if rows else ["actor_id", "status", "weights_version", "lag"])


def staleness_counts(episodes: pd.DataFrame) -> pd.Series:
    """Episodes by staleness (learner version at training minus the episode's policy version)."""
    if episodes.empty or "staleness" not in episodes:
        return pd.Series(dtype="int64")
    return episodes["staleness"].dropna().astype(int).value_counts().sort_index()


# ------------------------------------------------------------------------------------- run state
NA = "n/a"  # how a figure over zero samples is shown (never 0)
SILENT_AFTER_S = 120.0  # a live-only view with no news for this long: state "silent"
PID_FILE = "learner.pid"  # written by the learner's run lock (asyncrl.rundir) while it lives


@dataclass
class RunState:
    """``state``: waiting (no learner yet), running, finished, interrupted (stopped by a signal or
    a failed actor before ``total_steps``), crashed (no ``learner_stop`` event and the learner is
    gone), or silent (a live-only view that has heard nothing for a while). ``reason``: one line."""

    state: str
    reason: str


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _learner_pid(run_dir: Path | None) -> int | None:
    if run_dir is None:
        return None
    try:
        text = (Path(run_dir) / PID_FILE).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def run_state(store: "RunStore", now: float | None = None) -> RunState:
    """The run's state from its records and, for a run directory, the learner's pid file.

    The latest ``learner_start`` decides which segment is looked at (a resumed run has a
    ``learner_stop`` of its earlier segment). Without a stop event: the pid file's process alive
    means running; a pid file naming a dead process (killed) or no pid file (the learner exited
    without its orderly stop, e.g. on an exception) means crashed."""
    now = time.time() if now is None else now
    starts, stops = store.records("learner_start"), store.records("learner_stop")
    last_start = max((float(r.get("t") or 0) for r in starts), default=None)
    stop = stops[-1] if stops else None
    if stop is not None and (last_start is None or float(stop.get("t") or 0) >= last_start):
        steps = (stop.get("summary") or {}).get("steps_trained")
        trained = f"{steps} step(s) trained" if steps is not None else f"stopped at step {stop.get('step')}"
        if stop.get("interrupted"):
            return RunState("interrupted", f"the learner was stopped before total_steps ({trained})")
        return RunState("finished", f"the learner finished at step {stop.get('step')} ({trained})")
    if store.run_dir is None:  # only the live events socket
        if not store.revision:
            return RunState("waiting", "no event received yet")
        age = now - store.last_update
        if age > SILENT_AFTER_S:
            return RunState("silent", f"no event for {age:.0f} s and no learner_stop event")
        return RunState("running", f"last event {age:.0f} s ago")
    pid = _learner_pid(store.run_dir)
    if pid is not None and _pid_alive(pid):
        return RunState("running" if starts else "waiting",
                        f"learner pid {pid} is alive" + ("" if starts else " (starting: loading the model)"))
    if not starts and not store.metric_records():
        return RunState("waiting", "no learner has started in this directory yet")
    if pid is not None:
        return RunState("crashed", f"no learner_stop event and the learner (pid {pid}) is gone (killed?)")
    return RunState("crashed", "no learner_stop event and no learner holds the run (it exited without "
                               "stopping cleanly; see its output)")


# ------------------------------------------------------------------------------------- runs and curves
RUN_MARKERS = ("metrics.jsonl", "events.jsonl", "config.yaml", "addresses.json", PID_FILE)


def is_run_dir(path: str | Path) -> bool:
    """A directory holding any file a learner writes (``RUN_MARKERS``)."""
    path = Path(path)
    return path.is_dir() and any((path / m).exists() for m in RUN_MARKERS)


def list_runs(root: str | Path) -> list[Path]:
    """The run directories directly under ``root`` (a folder of runs such as ``runs/``), by name."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    return sorted((p for p in root.iterdir() if is_run_dir(p)), key=lambda p: p.name)


_NOT_CURVES = {"step", "t", "version"}


def metric_columns(metrics: pd.DataFrame) -> list[str]:
    """Every numeric column of a metrics frame that holds a value (``step``, ``t``, ``version`` left
    out), sorted by name."""
    out = []
    for c in metrics.columns:
        if c in _NOT_CURVES:
            continue
        col = metrics[c]
        if pd.api.types.is_bool_dtype(col) or (col.dtype == object and col.map(lambda v: isinstance(v, bool)).any()):
            continue  # flags (e.g. eval/greedy) are not curves
        col = pd.to_numeric(col, errors="coerce") if col.dtype == object else col
        if pd.api.types.is_numeric_dtype(col) and col.notna().any():
            out.append(str(c))
    return sorted(out)


def smooth(values: pd.Series, weight: float) -> pd.Series:
    """Exponential moving average with debiasing (TensorBoard's smoothing): ``weight`` in [0, 1),
    0 leaves the values as they are; NaN values are skipped, not spread."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    v = pd.to_numeric(values, errors="coerce").astype(float)
    if weight == 0:
        return v
    out, last, n = [], 0.0, 0
    for x in v:
        if np.isnan(x):
            out.append(np.nan)
            continue
        last, n = last * weight + (1 - weight) * x, n + 1
        out.append(last / (1 - weight ** n))
    return pd.Series(out, index=v.index)


def eval_series(store: "RunStore", name: str = "accuracy") -> pd.DataFrame:
    """One held-out figure over its own evaluations: ``step`` (the policy version evaluated) and
    ``value``, one row per ``eval`` event that has it (the evaluation at version 0 included)."""
    ev = store.evals()
    if ev.empty or name not in ev:
        return pd.DataFrame(columns=["step", "value"])
    x = ev["version"] if "version" in ev else ev["step"]
    out = pd.DataFrame({"step": pd.to_numeric(x, errors="coerce"), "value": pd.to_numeric(ev[name], errors="coerce")})
    return out.dropna().drop_duplicates("step", keep="last").sort_values("step").reset_index(drop=True)


def curves_frame(runs: dict[str, "RunStore"], names: list[str], smoothing: float = 0.0) -> pd.DataFrame:
    """Long frame (``step``, ``value``, ``series``, ``run``, ``metric``) of the metrics ``names`` of
    each run, for overlaid curves: a metric logged only on some steps (``eval/*``) is a connected
    series over its own steps, never broken by the steps without it."""
    parts = []
    for run, store in runs.items():
        m = store.metrics
        for name in names:
            s = eval_series(store, name[len("eval/"):]) if name.startswith("eval/") else None
            if s is None or s.empty:  # eval/* from the eval events: the evaluation before training too
                if name not in m:
                    continue
                s = pd.DataFrame({"step": m["step"].astype(float), "value": pd.to_numeric(m[name], errors="coerce")})
            s = s.dropna().astype({"step": float, "value": float})
            if s.empty:
                continue
            s["value"] = smooth(s["value"], smoothing).values
            label = name if len(runs) == 1 else f"{run} · {name}"
            parts.append(s.assign(series=label, run=run, metric=name))
    if not parts:
        return pd.DataFrame(columns=["step", "value", "series", "run", "metric"])
    return pd.concat(parts, ignore_index=True)


def calibration_summary(eval_record: dict) -> dict:
    """An RLCR ``eval`` record's calibration figures with how many confidences they rest on:
    ``parsed`` of ``size``; with no confidence parsed, ECE, Brier and AUROC are ``None`` (n/a: an
    unparsed confidence is scored as 0, so over zero parsed ones the figures would say nothing)."""
    size = int(eval_record.get("size") or 0)
    fail = eval_record.get("confidence_parse_fail")
    parsed = int(round(size * (1 - float(fail)))) if fail is not None and size else (size if fail is None else 0)
    out = {"size": size, "parsed": parsed, "accuracy": eval_record.get("accuracy")}
    for k in ("ece", "brier", "auroc", "confidence_mean"):
        v = eval_record.get(k)
        out[k] = None if parsed == 0 or v is None or (isinstance(v, float) and np.isnan(v)) else float(v)
    return out


# ------------------------------------------------------------------------------------- demo runs
TINY_MODEL_OVERRIDES = ["model.embedded.hidden_size=32", "model.embedded.num_layers=1",
                        "model.embedded.num_heads=2", "model.embedded.intermediate_size=64",
                        "model.embedded.warmup_steps=20", "model.embedded.warmup_batch_size=16",
                        "model.embedded.warmup_lr=3e-3"]

# quick=True: a very small model and batches, a few steps: the shape of every view in seconds (tests)
_QUICK = {
    "grpo": ("configs/quickstart.yaml", ["train.batch_tasks=4", "actor.tasks_per_batch=4", "sampling.n=4",
                                         "eval.size=8", "eval.every=2"]),
    "absolute_zero": ("configs/absolute_zero.yaml", [
        "model.embedded.warmstart_formats=[arithmetic]", "train.batch_tasks=4", "actor.tasks_per_batch=4",
        "train.lr=1e-3", "eval.size=8", "eval.every=2", "algo.mode=joint", "algo.proposer_update=group",
        "algo.questions_per_prompt=8", "algo.rollout_n=3", "algo.max_repropose_attempts=5",
        "algo.arithmetic.min_operators=0", "algo.learnability.safety.min_ratio=0",
        "algo.learnability.completion.min_ratio=0", "algo.learnability.completion.max_ratio=1"]),
    "rlcr": ("configs/rlcr.yaml", [
        "model.embedded.warmup_steps=5", "model.embedded.warmup_batch_size=8", "actor.tasks_per_batch=2",
        "train.batch_tasks=2", "eval.size=8", "eval.every=2", "algo.num_generations_answer=2",
        "algo.num_generations_confidence=2", "algo.answer_max_new_tokens=24",
        "algo.confidence_max_new_tokens=16"]),
}
# the notebooks' default demos: settings that learn within minutes on two CPU cores (overrides, steps)
_LEARNING = {
    "grpo": (["eval.every=50", "eval.size=100", "log.sample_every=10"], 200),
    "absolute_zero": (["eval.every=10", "eval.size=100", "log.sample_every=5"], 40),
    "rlcr": (["model.embedded.warmup_steps=300", "model.embedded.warmup_batch_size=32", "actor.tasks_per_batch=4",
              "train.batch_tasks=4", "eval.size=100", "eval.every=10", "algo.num_generations_answer=4",
              "algo.num_generations_confidence=2", "train.lr=3e-4", "log.sample_every=5"], 40),
}


def demo_run(algorithm: str = "grpo", run_root: str | Path = "runs", name: str | None = None, steps: int | None = None,
             extra_overrides: list[str] | None = None, project_root: str | Path | None = None,
             reuse: bool = True, timeout: float = 3600, quick: bool = False) -> Path:
    """A real run of ``algorithm`` (grpo, absolute_zero, rlcr) with the embedded model (``asyncrl
    run`` in a subprocess); returns its run directory. By default the settings learn within minutes
    on two CPU cores (the embedded model is built once and cached); ``quick`` uses a very small
    model and a few steps instead (seconds: every view has data, nothing is learned). With
    ``reuse``, a finished run already there (a ``learner_stop`` event) is returned as is."""
    if algorithm not in _QUICK:
        raise ValueError(f"no demo run for algorithm {algorithm!r}; choose one of {sorted(_QUICK)}")
    root = Path(project_root) if project_root else Path(__file__).resolve().parents[1]
    config, quick_overrides = _QUICK[algorithm]
    if quick:
        overrides, steps = [*TINY_MODEL_OVERRIDES, *quick_overrides], steps or 4
    else:
        overrides, default_steps = _LEARNING[algorithm]
        steps = steps or default_steps
    if not (root / config).exists():
        raise FileNotFoundError(f"{root / config} not found: pass project_root= (the asyncrl checkout)")
    name = name or f"demo-{algorithm}"
    run_dir = Path(run_root).resolve() / name
    args = [*overrides, f"run_root={Path(run_root).resolve()}", f"name={name}",
            f"train.total_steps={steps}", "log.progress=false", "checkpoint.every=0", "checkpoint.resume=false",
            "actor.heartbeat_s=0.5",
            *(["log.sample_every=1"] if quick else []), *(extra_overrides or [])]
    marker = run_dir / ".asyncrl-demo"
    made_with = json.dumps({"made by": "asyncrl.analysis.demo_run", "config": config, "overrides": args})
    if reuse and _read_text(marker) == made_with and any(
            r.get("kind") == "learner_stop" for r in _quiet_records(run_dir / "events.jsonl")):
        return run_dir  # finished, with these very settings
    if run_dir.exists():
        if not marker.exists():
            raise FileExistsError(f"{run_dir} exists and is not a demo run; choose another name or run_root")
        shutil.rmtree(run_dir)  # unfinished, made with other settings, or not to be reused: start afresh
    run_dir.mkdir(parents=True)
    marker.write_text(made_with)
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "run", "-c", str(root / config), *args],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: killed whole below
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # timed out or interrupted: the launcher and its children
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the demo run failed (exit {proc.returncode}):\n{out[-2000:]}\n{err[-2000:]}")
    return run_dir


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _quiet_records(path: Path) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return read_records(path)
