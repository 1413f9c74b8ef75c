"""The UI's toolkit: HTML and figure helpers every view uses, and :class:`AlgorithmView`, the tab an
algorithm adds to ``asyncrl ui`` from its own package (its workflow's ``views``, e.g.
``asyncrl.algos.rlcr.ui:ConfidenceTreesView``). Every text that comes from a run is HTML-escaped.
"""

from __future__ import annotations

import html
import math
from typing import Any, Callable

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from asyncrl.analysis import NA, RunStore  # noqa: E402

CSS = """
.arl-cards{display:flex;flex-wrap:wrap;gap:10px;margin:4px 0 10px}
.arl-card{border:1px solid #d0d7de;border-radius:8px;padding:8px 14px;min-width:120px;background:#f8fafc}
.arl-card .v{font-size:1.5em;font-weight:600}
.arl-card .k{font-size:.8em;color:#57606a}
.arl-note{padding:10px 14px;border-left:4px solid #0969da;background:#f0f6ff;margin:6px 0}
.arl-scroll{max-width:100%;overflow-x:auto}
table.arl{border-collapse:collapse;font-size:.9em;margin:6px 0}
table.arl td,table.arl th{border:1px solid #d0d7de;padding:3px 7px;text-align:left;vertical-align:top}
table.arl th{background:#f6f8fa;white-space:nowrap;word-break:keep-all}
.arl-state-running{color:#0969da}.arl-state-finished{color:#1a7f37}
.arl-state-interrupted{color:#9a6700}.arl-state-crashed,.arl-state-silent{color:#cf222e}
pre.arl-config{font-size:.85em;background:#f6f8fa;padding:8px;border-radius:6px;max-height:600px;overflow:auto}
pre#config-diff{white-space:pre-wrap}
details.arl-tree{border:1px solid #d0d7de;border-radius:6px;margin:5px 0;padding:4px 8px}
details.arl-tree details{margin-left:18px;border-left:2px solid #d0d7de;padding-left:8px}
.arl-ok{color:#1a7f37;font-weight:600}.arl-bad{color:#cf222e;font-weight:600}
.arl-tok{font-family:monospace;white-space:pre;border-radius:2px;padding:0 1px;margin:0 0 2px;display:inline-block}
.arl-mono{font-family:monospace;white-space:pre-wrap}
"""


def esc(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def note(text: str) -> str:
    return f'<div class="arl-note">{text}</div>'


def fmt(x: Any, digits: int = 3) -> str:
    """A number for a table cell: ``-`` when absent (None), ``n/a`` when NaN (a figure over zero
    samples), else ``digits`` decimals without trailing zeros."""
    if x is None:
        return "-"
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    try:
        f = float(x)
    except (TypeError, ValueError):
        return esc(x)
    if math.isnan(f):
        return NA
    return f"{f:.{digits}g}" if abs(f) < 1e-3 and f != 0 else f"{f:.{digits}f}".rstrip("0").rstrip(".") or "0"


def fmt_rate(x: Any) -> str:
    """A rate for a card: three significant figures at most, thousands separated (``1,234``, ``56.7``)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    f = float(x)
    if abs(f) >= 100:
        return f"{f:,.0f}"
    return f"{f:.3g}"


def html_table(df: pd.DataFrame, table_id: str | None = None, raw_cols: tuple[str, ...] = ()) -> str:
    """A small HTML table (cells escaped except ``raw_cols``, which hold HTML made here)."""
    head = "".join(f"<th>{esc(c)}</th>" for c in df.columns)
    rows = []
    for _, r in df.iterrows():
        cells = "".join(
            f"<td>{r[c] if c in raw_cols else fmt(r[c]) if not isinstance(r[c], str) else esc(r[c])}</td>"
            for c in df.columns
        )
        rows.append(f'<tr class="arl-row">{cells}</tr>')
    tid = f' id="{table_id}"' if table_id else ""
    # (a wide table scrolls, the page does not)
    return (
        f'<div class="arl-scroll"><table class="arl"{tid}><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


def figure(n: int, cols: int = 3, height: float = 2.6) -> tuple[Figure, list]:
    rows = max(1, math.ceil(n / cols))
    fig = Figure(figsize=(4.2 * cols, height * rows), dpi=80, layout="constrained")
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n)]
    return fig, axes


def empty_axes(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=9, color="#57606a", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


SPARSE_POINTS = 30  # a series with fewer points is drawn with markers


def series(ax, x, y, label: str) -> None:
    """One connected line over the points that exist (a metric logged on some steps only is not
    broken by the steps without it); markers when the points are few."""
    ok = pd.notna(y)
    x, y = np.asarray(x, dtype=float)[np.asarray(ok)], np.asarray(y, dtype=float)[np.asarray(ok)]
    ax.plot(x, y, marker="o" if len(x) < SPARSE_POINTS else None, markersize=3, label=label)


def curves(ax, m: pd.DataFrame, cols: list[str], title: str, extra: dict[str, pd.DataFrame] | None = None) -> None:
    """``cols`` of the metrics over steps, plus ``extra`` series (label -> frame of step, value)."""
    ax.set_title(title, fontsize=10)
    present = [c for c in cols if c in m.columns and pd.to_numeric(m[c], errors="coerce").notna().any()]
    extra = {k: v for k, v in (extra or {}).items() if len(v)}
    if not present and not extra:
        empty_axes(ax, "not logged in this run")
        return
    for c in present:
        series(ax, m["step"], pd.to_numeric(m[c], errors="coerce"), c)
    for label, frame in extra.items():
        series(ax, frame["step"], frame["value"], label)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    if len(present) + len(extra) > 1:
        ax.legend(fontsize=7)


class AlgorithmView:
    """One tab of ``asyncrl ui`` that an algorithm adds (named in its workflow's ``views``).

    A subclass sets ``id`` (the tab's id, also ``?view=<id>``), ``title``, ``algorithm`` (the runs
    it shows), ``algorithm_title`` and ``missing`` (for the note on other runs) and ``css``, and
    implements :meth:`build`, :meth:`render` and, for events of its own, :meth:`wire`. The app puts
    a note and a column around the tab: on a run of another algorithm the note says so and the
    column is hidden."""

    id: str = ""
    title: str = ""
    algorithm: str = ""
    algorithm_title: str = ""
    missing: str = "none of this view's records"
    css: str = ""

    def __init__(self):
        self.inputs: list = []  # its filters: a change re-renders the tab
        self.outputs: list = []  # what render() fills, in order

    def build(self, gr, empty: RunStore) -> None:
        """Make the tab's components (inside the app's Blocks, tab and column); fill ``inputs`` and
        ``outputs``."""
        raise NotImplementedError

    def render(self, store: RunStore, *inputs) -> list:
        """The values of ``outputs`` for ``store`` with the filters' values ``inputs``."""
        raise NotImplementedError

    def wire(self, gr, main_store: Callable[[Any], RunStore], runs) -> None:
        """Attach the tab's own events (``main_store(runs value)`` is the run shown)."""

    def applies(self, store: RunStore) -> bool:
        return store.algorithm == self.algorithm

    def absent_note(self, store: RunStore) -> str:
        return note(
            f"This run does not use {self.algorithm_title} (algorithm: "
            f"<b>{esc(store.algorithm or 'unknown')}</b>), so it has {self.missing}."
        )
