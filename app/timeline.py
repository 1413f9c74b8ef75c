"""The Timeline tab of ``asyncrl ui`` (issue 67): where each process waits. One lane per process (the
learner, then each actor) over the last minutes of the run, coloured by state (generating, waiting
for credits, waiting for weights, applying weights, training, waiting for episodes, checkpointing,
...), and the share of that window each state took, per process. From the learner's ``timeline``
events and the spans the actors send in their heartbeats (:mod:`asyncrl.timeline`)."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from asyncrl.analysis import RunStore
from asyncrl.analysis.timeline import state_shares, timeline_spans, window
from asyncrl.timeline import ACTOR_STATES, LEARNER_STATES

from .kit import empty_axes, html_table, note

WINDOW_MIN = 3.0  # the lanes show the last 3 minutes of spans
COLOURS = {
    "generating": "#2da44e",
    "environment": "#54aeff",
    "applying weights": "#8250df",
    "waiting for weights": "#bf8700",
    "waiting for credits": "#cf222e",
    "waiting for the learner": "#6e7781",
    "training": "#0969da",
    "publishing weights": "#8250df",
    "evaluating": "#1b7c83",
    "checkpointing": "#953800",
    "waiting for episodes": "#cf222e",
    "starting": "#d0d7de",
    "stopping": "#d0d7de",
}
ORDER = ("starting", *LEARNER_STATES, *ACTOR_STATES, "stopping")


def _spans(store: RunStore) -> pd.DataFrame:
    return store.cached("timeline_spans", lambda: timeline_spans(store))


def has_timeline(store: RunStore) -> bool:
    return bool(store.records("timeline")) or any(s.get("spans") for s in store.records("actor_status"))


def _processes(spans: pd.DataFrame) -> list[str]:
    names = sorted(set(spans["process"]))
    return (["learner"] if "learner" in names else []) + [n for n in names if n != "learner"]


def timeline_figure(store: RunStore) -> Figure:
    spans = _spans(store)
    fig = Figure(figsize=(13, 1.6 + 0.5 * (len(set(spans["process"])) if len(spans) else 1)), dpi=80)
    ax = fig.add_subplot(1, 1, 1)
    if not len(spans):
        empty_axes(ax, "no timeline yet: the learner writes one every 2 s, the actors send theirs in each heartbeat")
        return fig
    t_from, t_to = window(spans, WINDOW_MIN)
    procs = _processes(spans)
    seen: list[str] = []
    for lane, proc in enumerate(procs):
        mine = spans[(spans["process"] == proc) & (spans["end"] > t_from)]
        for state, group in mine.groupby("state"):
            bars = [
                (max(a, t_from) - t_to, min(b, t_to) - max(a, t_from)) for a, b in zip(group["start"], group["end"])
            ]
            ax.broken_barh(bars, (lane - 0.4, 0.8), color=COLOURS.get(state, "#afb8c1"))
            seen += [] if state in seen else [state]
    ax.set_yticks(range(len(procs)), procs, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(t_from - t_to, 0)
    ax.set_xlabel("seconds before the last span", fontsize=9)
    ax.set_title(f"where each process spent the last {(t_to - t_from) / 60:.1f} min", fontsize=10)
    named = [s for s in ORDER if s in seen] + [s for s in seen if s not in ORDER]
    handles = [Patch(color=COLOURS.get(s, "#afb8c1"), label=s) for s in named]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    fig.set_layout_engine("constrained")
    return fig


def timeline_html(store: RunStore) -> str:
    spans = _spans(store)
    if not len(spans):
        return note(
            "No timeline in this run yet: the learner writes a <code>timeline</code> event every 2 s and the "
            "actors send their spans in each heartbeat (runs made before this was added have none)."
        )
    t_from, t_to = window(spans, WINDOW_MIN)
    shares = state_shares(spans, t_from, t_to)
    cols = [s for s in ORDER if s in shares.columns] + [s for s in shares.columns if s not in ORDER]
    table = shares.reindex(index=_processes(spans), columns=cols).fillna(0.0)
    table = (table * 100).round(1).astype(str) + "%"
    table.insert(0, "process", table.index)
    return (
        f'<div id="timeline-view">The share of the last {(t_to - t_from) / 60:.1f} min each process spent in each '
        f"state (the spans the lanes above draw)."
        f"{html_table(table.reset_index(drop=True), 'timeline-table')}</div>"
    )
