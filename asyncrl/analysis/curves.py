"""Curves: which metrics are curves, smoothing, held-out series from eval events, and the long frame
the UI and the notebooks overlay across runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from .store import RunStore


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
        out.append(last / (1 - weight**n))
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
            s = eval_series(store, name[len("eval/") :]) if name.startswith("eval/") else None
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
