"""Where each process waits (issue 67), from a run's log: the learner's ``timeline`` events and the
spans in the actors' ``actor_status`` events (:mod:`asyncrl.timeline`).

``timeline_spans(store)``: one row per span (``process``, ``state``, ``start``, ``end``, unix times);
``state_shares(spans, t_from, t_to)``: per process, the share of the window each state took (the
spans cut to the window)."""

from __future__ import annotations

import math

import pandas as pd

COLUMNS = ["process", "state", "start", "end"]


def _finite(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def timeline_spans(store) -> pd.DataFrame:
    rows = []
    for e in store.records("timeline"):
        for span in e.get("spans") or []:
            if len(span) == 3 and _finite(span[1], span[2]) and span[2] > span[1]:
                rows.append((str(e.get("process") or "learner"), str(span[0]), float(span[1]), float(span[2])))
    for s in store.records("actor_status"):
        for span in s.get("spans") or []:
            if len(span) == 3 and _finite(span[1], span[2]) and span[2] > span[1]:
                rows.append((str(s.get("actor_id") or "?"), str(span[0]), float(span[1]), float(span[2])))
    return pd.DataFrame(rows, columns=COLUMNS).sort_values(["process", "start"], ignore_index=True)


def window(spans: pd.DataFrame, minutes: float = 3.0) -> tuple[float, float]:
    """The last ``minutes`` of the spans: ``(t_from, t_to)`` ending at the latest span's end."""
    t_to = float(spans["end"].max()) if len(spans) else 0.0
    return max(t_to - 60.0 * minutes, float(spans["start"].min()) if len(spans) else 0.0), t_to


def state_shares(spans: pd.DataFrame, t_from: float, t_to: float) -> pd.DataFrame:
    """Rows per process, columns per state: the share of ``[t_from, t_to]`` each state took, over the
    time the process reported spans in it (a process that started late is not idle before it)."""
    if not len(spans):
        return pd.DataFrame()
    cut = spans.assign(start=spans["start"].clip(lower=t_from), end=spans["end"].clip(upper=t_to))
    cut = cut[cut["end"] > cut["start"]]
    if not len(cut):
        return pd.DataFrame()
    seconds = (cut["end"] - cut["start"]).groupby([cut["process"], cut["state"]]).sum().unstack(fill_value=0.0)
    return seconds.div(seconds.sum(axis=1), axis=0)
