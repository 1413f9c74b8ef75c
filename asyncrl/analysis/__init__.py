"""Reading a run directory into pandas: metrics, events per kind, and the algorithms' tables.

Works on finished runs and on runs still being written (the learner flushes one JSON line at a
time; see docs/design/events.md). A line without its newline yet (a live writer's tail) is not read; a
complete line that is not a JSON object (a record cut short by a crash) is skipped. Both are
reported with a :class:`TruncatedRecordWarning`, never an exception.

One-shot::

    from asyncrl.analysis import load_run
    run = load_run("runs/absolute_zero")
    run.metrics                 # one row per optimizer step, indexed by step
    run.events["episode"]       # one DataFrame per event kind
    run.table("azr_questions")         # Absolute Zero: one row per proposed question
    run.table("rlcr_nodes")            # RLCR: one row per confidence (answer columns repeated)

Following a live run: keep a :class:`RunReader` and call ``poll()``; it reads only what was
appended since the last call and leaves an unfinished last line for the next one.

The package's modules: :mod:`.records` (reading JSON-lines files that may still be written),
:mod:`.store` (:class:`RunStore`, :class:`RunReader`, :func:`load_run`), :mod:`.frames` (records to
DataFrames), :mod:`.curves` (metrics as curves, overlays), :mod:`.charts` (every metric its own chart, grouped; runs compared), :mod:`.state` (run state, run folders).
The algorithms' own tables live with them (``asyncrl.algos.absolute_zero.analysis``, ``asyncrl.algos.rlcr.analysis``); demo runs for the
notebooks are :func:`asyncrl.analysis.demo_runs.demo_run`.
"""

from __future__ import annotations

from ..metric_names import metric_group, tag
from .curves import curves_frame, eval_series, metric_columns, smooth
from .frames import (
    actors_frame,
    calibration_summary,
    episodes_frame,
    evals_frame,
    events_frames,
    metrics_frame,
    reliability_frame,
    staleness_counts,
    trajectories_frame,
)
from .jsonl import TruncatedRecordWarning, read_records
from .metric_series import chart_data, run_axes, runs_table
from .state import NA, RunState, actor_statuses, is_run_dir, list_runs, run_state
from .store import Run, RunReader, RunStore, load_events, load_metrics, load_run

__all__ = [
    "TruncatedRecordWarning",
    "RunStore",
    "RunReader",
    "Run",
    "load_run",
    "load_events",
    "load_metrics",
    "read_records",
    "metrics_frame",
    "events_frames",
    "episodes_frame",
    "trajectories_frame",
    "evals_frame",
    "reliability_frame",
    "actors_frame",
    "staleness_counts",
    "RunState",
    "run_state",
    "is_run_dir",
    "list_runs",
    "metric_columns",
    "smooth",
    "curves_frame",
    "eval_series",
    "calibration_summary",
    "NA",
    "chart_data",
    "actor_statuses",
    "metric_group",
    "run_axes",
    "runs_table",
    "tag",
]
