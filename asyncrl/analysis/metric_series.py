"""Every metric its own chart: the metrics of one or more runs grouped by what they are about, each
series with three x axes (step, wall time since the run started, samples trained on), ready for the
UI's interactive small multiples (``app/svg_charts.js``) and for the trackers' tag names.

Pure functions of :class:`RunStore` objects; no UI code here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ..config import flat_keys
from ..metric_names import GROUP_ORDER, metric_group, metric_span, metric_unit
from .curves import eval_series, metric_columns

if TYPE_CHECKING:
    from .store import RunStore

NOT_CHARTED = {"eval/version", "eval/step"}  # the x axis itself
MAX_POINTS = 2000  # a longer series is thinned evenly (its first and last points kept)
COLORS = ("#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#e16f24", "#1b7c83", "#bf3989", "#57606a", "#6639ba")


def _group_key(group: str) -> tuple:
    return (GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER), group)


def run_axes(store: "RunStore") -> pd.DataFrame:
    """Per logged step: ``step``, ``time`` (seconds since the run's learner started; the first
    ``learner_start`` event, else the first metric line) and ``samples`` (trajectories trained on
    so far, from ``batch_trajectories``). Step 0 (time 0, 0 samples) is included."""
    m = store.metrics
    if m.empty or "step" not in m:
        return pd.DataFrame({"step": [0.0], "time": [0.0], "samples": [0.0]})
    step = pd.to_numeric(m["step"], errors="coerce").astype(float)
    t = pd.to_numeric(m["t"], errors="coerce").astype(float) if "t" in m else pd.Series(np.nan, index=m.index)
    starts = [r.get("t") for r in store.records("learner_start") if isinstance(r.get("t"), (int, float))]
    t0 = float(starts[0]) if starts else (float(t.dropna().iloc[0]) - 1e-9 if t.notna().any() else np.nan)
    samples = (
        pd.to_numeric(m["batch_trajectories"], errors="coerce").fillna(0).cumsum()
        if "batch_trajectories" in m
        else pd.Series(np.nan, index=m.index)
    )
    out = pd.DataFrame({"step": step, "time": (t - t0).clip(lower=0), "samples": samples.astype(float)})
    out = pd.concat([pd.DataFrame({"step": [0.0], "time": [0.0], "samples": [0.0]}), out], ignore_index=True)
    return out.dropna(subset=["step"]).drop_duplicates("step", keep="last").sort_values("step").reset_index(drop=True)


def _series(store: "RunStore", name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of one metric, finite values only (``eval/*`` from the eval events, the
    one before training included, so the held-out series is connected whatever the run's length)."""
    m = store.metrics
    if name.startswith("eval/"):
        s = eval_series(store, name[len("eval/") :])
        if not s.empty:
            return s["step"].to_numpy(float), s["value"].to_numpy(float)
    if name not in m or "step" not in m:
        return np.array([]), np.array([])
    x = pd.to_numeric(m["step"], errors="coerce").to_numpy(float)
    y = pd.to_numeric(m[name], errors="coerce").to_numpy(float)
    keep = np.isfinite(x) & np.isfinite(y)
    return x[keep], y[keep]


def _thin(idx: np.ndarray) -> np.ndarray:
    if len(idx) <= MAX_POINTS:
        return idx
    keep = np.unique(np.linspace(0, len(idx) - 1, MAX_POINTS).round().astype(int))
    return idx[keep]


def _num(v: float) -> float | None:
    return None if not np.isfinite(v) else float(f"{v:.6g}")


def _nums(a: np.ndarray) -> list[float | None]:
    """Six significant digits (the JSON stays small), None for NaN/inf."""
    return [_num(v) for v in np.asarray(a, dtype=float).tolist()]


def _constant(values: list[np.ndarray]) -> float | None:
    vals = np.concatenate(values) if values else np.array([])
    return float(vals[0]) if len(vals) and np.all(vals == vals[0]) else None


def chart_data(
    runs: dict[str, "RunStore"], pinned: list[str] | tuple[str, ...] = (), group_of: dict[str, str] | None = None
) -> dict:
    """Every numeric metric of every run in ``runs`` as one chart each, grouped by
    :func:`metric_group` or ``group_of`` (e.g. an algorithm's own reward metrics into ``reward``;
    ``pinned`` metrics first, in a group of their own).

    Returns ``{"runs": [{"name", "color"}], "groups": [{"name", "charts": [{"metric", "span" (per step,
    cumulative, per evaluation), "unit" (the y axis's label), "series":
    [{"run", "step", "time", "samples", "y"}]}], "flat": [{"metric", "why"}]}]}``: a metric whose
    value never changed in any run is not drawn but listed in ``flat`` with its value; a metric
    with no value at all is left out."""
    names: set[str] = set()
    for store in runs.values():
        names.update(metric_columns(store.metrics))
        if not store.evals().empty:
            names.update(
                f"eval/{c}"
                for c in store.evals().columns  # accuracy beside pass@j and avg@k
                if c in ("accuracy", "reward_mean") or c.startswith(("pass@", "avg@"))
            )
    axes = {}
    for run, store in runs.items():  # x -> wall time and samples, by interpolation over the logged steps
        ax = run_axes(store)
        axes[run] = (
            ax["step"].to_numpy(float),
            ax["time"].to_numpy(float) if ax["time"].notna().any() else None,
            ax["samples"].to_numpy(float) if ax["samples"].notna().all() else None,
        )
    run_list = [{"name": run, "color": COLORS[i % len(COLORS)]} for i, run in enumerate(runs)]
    names -= NOT_CHARTED
    pinned = [p for p in pinned if p in names]
    by_group: dict[str, dict] = {}
    for name in [*pinned, *sorted(n for n in names if n not in pinned)]:
        group = "pinned" if name in pinned else (group_of or {}).get(name) or metric_group(name)
        found = []
        for i, (run, store) in enumerate(runs.items()):
            x, y = _series(store, name)
            if len(x):
                idx = _thin(np.arange(len(x)))
                found.append((i, run, x[idx], y[idx]))
        if not found:
            continue
        g = by_group.setdefault(group, {"name": group, "charts": [], "flat": []})
        values = [y for *_, y in found]
        const = _constant(values) if name not in pinned else None
        if const is not None and sum(len(v) for v in values) > 1:
            steps = max(len(v) for v in values)
            g["flat"].append(
                {
                    "metric": name,
                    "why": f"{_num(const)} at every logged step ({steps} steps)"
                    + (f", in all {len(found)} runs" if len(found) > 1 else ""),
                }
            )
            continue
        series = []
        for i, run, x, y in found:
            steps, time_, samples = axes[run]
            t = np.interp(x, steps, np.nan_to_num(time_)) if time_ is not None else np.full(len(x), np.nan)
            n = np.interp(x, steps, samples) if samples is not None else np.full(len(x), np.nan)
            series.append({"run": i, "step": _nums(x), "time": _nums(t), "samples": _nums(n), "y": _nums(y)})
        g["charts"].append({"metric": name, "span": metric_span(name), "unit": metric_unit(name), "series": series})
    groups = sorted(by_group.values(), key=lambda g: (g["name"] != "pinned", _group_key(g["name"])))
    return {"runs": run_list, "groups": groups}


SUMMARY_METRICS = ("reward_mean", "eval/accuracy", "entropy", "staleness_mean", "samples_per_s", "tokens_per_s")


def _json_in(store, name: str) -> dict | None:
    """A JSON file of the run's directory (``replay.json`` of asyncrl replay, ``provenance.json``)."""
    run_dir = getattr(store, "run_dir", None)
    path = Path(run_dir) / name if run_dir is not None else None
    if path is None or not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def runs_table(runs: dict[str, "RunStore"]) -> pd.DataFrame:
    """One row per run: its state, steps, wall time and samples, the last value of the
    :data:`SUMMARY_METRICS` (the held-out accuracy: the last evaluation's), the best held-out accuracy,
    then the config keys
    whose values differ between the runs (``name`` and ``run_root`` left out)."""
    from .state import run_state

    rows, configs = [], {}
    for run, store in runs.items():
        ax = run_axes(store)
        row = {
            "run": run,
            "algorithm": store.algorithm or "?",
            "state": run_state(store).state,
            "steps": len(store.metrics),
            "wall time (s)": _num(float(ax["time"].iloc[-1])) if len(ax) else None,
            "samples": _num(float(ax["samples"].iloc[-1])) if len(ax) else None,
        }
        for name in SUMMARY_METRICS:
            _, y = _series(store, name)
            row[name] = _num(float(y[-1])) if len(y) else None
        _, acc = _series(store, "eval/accuracy")
        row["eval/accuracy best"] = _num(float(np.max(acc))) if len(acc) else None
        prov = _json_in(store, "provenance.json") or {}
        if prov:  # what the run was made with (asyncrl.rundir.provenance)
            commit = prov.get("commit")
            row["commit"] = f"{commit[:10]}{' (dirty)' if prov.get('dirty') else ''}" if commit else "-"
            for pkg in ("torch", "transformers"):
                row[pkg] = (prov.get("packages") or {}).get(pkg, "-")
        replay = _json_in(store, "replay.json")
        if replay is not None:  # asyncrl replay: which run it trained again, and how
            row["replay of"] = f"{Path(replay['source']).name} ({replay['label']})"
        evals = store.evals()
        for c in [c for c in evals.columns if c.startswith(("pass@", "avg@"))]:  # eval.k: beside the greedy accuracy
            _, y = _series(store, f"eval/{c}")
            row[f"eval/{c}"] = _num(float(y[-1])) if len(y) else None
        rows.append(row)
        configs[run] = {k: v for k, v in flat_keys(store.config or {}).items() if k not in ("name", "run_root")}
    df = pd.DataFrame(rows)
    if len(runs) > 1:
        keys = sorted(set().union(*(c.keys() for c in configs.values())))
        differ = [k for k in keys if len({repr(c.get(k)) for c in configs.values()}) > 1]
        for k in differ:  # "-": the key is not in that run's config
            df[k] = pd.Series([configs[r].get(k, "-") for r in runs], dtype=object)
    return df
