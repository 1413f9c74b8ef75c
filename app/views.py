"""What each view of ``asyncrl ui`` shows, as HTML strings, matplotlib figures and DataFrames.

Pure functions of a :class:`asyncrl.analysis.RunStore` (no Gradio here), so that they can be tested
and reused. Every text that comes from a run is HTML-escaped.
"""

from __future__ import annotations

import html
import math
import time
from typing import Any

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from asyncrl.analysis import (NA, RunStore, calibration_summary, curves_frame, eval_series,  # noqa: E402
                               metric_columns, reliability_frame, run_state, staleness_counts)
from asyncrl.layout import config_snapshot  # noqa: E402

MAX_QUESTION_ROWS = 400
STATUS_FILTERS = ["all", "learnable", "not learnable", "invalid", "sampled"]

CSS = """
.arl-cards{display:flex;flex-wrap:wrap;gap:10px;margin:4px 0 10px}
.arl-card{border:1px solid #d0d7de;border-radius:8px;padding:8px 14px;min-width:120px;background:#f8fafc}
.arl-card .v{font-size:1.5em;font-weight:600}
.arl-card .k{font-size:.8em;color:#57606a}
.arl-note{padding:10px 14px;border-left:4px solid #0969da;background:#f0f6ff;margin:6px 0}
table.arl{border-collapse:collapse;font-size:.9em;margin:6px 0}
table.arl td,table.arl th{border:1px solid #d0d7de;padding:3px 7px;text-align:left;vertical-align:top}
table.arl th{background:#f6f8fa;white-space:nowrap;word-break:keep-all}
#azr-questions th,#azr-questions th *{word-break:keep-all!important;overflow-wrap:normal!important;hyphens:none!important}
.arl-state-running{color:#0969da}.arl-state-finished{color:#1a7f37}
.arl-state-interrupted{color:#9a6700}.arl-state-crashed,.arl-state-silent{color:#cf222e}
pre.arl-config{font-size:.85em;background:#f6f8fa;padding:8px;border-radius:6px;max-height:600px;overflow:auto}
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
        cells = "".join(f"<td>{r[c] if c in raw_cols else fmt(r[c]) if not isinstance(r[c], str) else esc(r[c])}</td>"
                        for c in df.columns)
        rows.append(f'<tr class="arl-row">{cells}</tr>')
    tid = f' id="{table_id}"' if table_id else ""
    return f'<table class="arl"{tid}><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _figure(n: int, cols: int = 3, height: float = 2.6) -> tuple[Figure, list]:
    rows = max(1, math.ceil(n / cols))
    fig = Figure(figsize=(4.2 * cols, height * rows), dpi=80, layout="constrained")
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n)]
    return fig, axes


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=9, color="#57606a", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


SPARSE_POINTS = 30  # a series with fewer points is drawn with markers


def _series(ax, x, y, label: str) -> None:
    """One connected line over the points that exist (a metric logged on some steps only is not
    broken by the steps without it); markers when the points are few."""
    ok = pd.notna(y)
    x, y = np.asarray(x, dtype=float)[np.asarray(ok)], np.asarray(y, dtype=float)[np.asarray(ok)]
    ax.plot(x, y, marker="o" if len(x) < SPARSE_POINTS else None, markersize=3, label=label)


def _curves(ax, m: pd.DataFrame, cols: list[str], title: str, extra: dict[str, pd.DataFrame] | None = None) -> None:
    """``cols`` of the metrics over steps, plus ``extra`` series (label -> frame of step, value)."""
    ax.set_title(title, fontsize=10)
    present = [c for c in cols if c in m.columns and pd.to_numeric(m[c], errors="coerce").notna().any()]
    extra = {k: v for k, v in (extra or {}).items() if len(v)}
    if not present and not extra:
        _empty(ax, "not logged in this run")
        return
    for c in present:
        _series(ax, m["step"], pd.to_numeric(m[c], errors="coerce"), c)
    for label, frame in extra.items():
        _series(ax, frame["step"], frame["value"], label)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    if len(present) + len(extra) > 1:
        ax.legend(fontsize=7)


# ------------------------------------------------------------------------------------- overview
def run_status(store: RunStore, live: dict | None = None) -> str:
    """running, finished, interrupted, crashed, waiting or silent (``asyncrl.analysis.run_state``)."""
    return run_state(store).state


def _episodes_card(store: RunStore) -> str:
    """Episode events received; when the UI keeps only the latest ones, says so (never a cap as a count)."""
    n, kept = store.counts.get("episode", 0), len(store.records("episode"))
    log = store.config.get("log") or {}
    mode, every = log.get("episode_events", "all"), log.get("episode_events_every", 1)
    text = f"{n:,}" + (f" <small>(latest {kept:,} kept)</small>" if kept < n else "")
    if mode == "none":
        return text + " <small>(log.episode_events=none)</small>"
    if every and every != 1:
        note = f"every {every}th" + (" without a decision" if mode == "sampled" else "")
        return text + f" <small>({note})</small>"
    return text


def overview_html(store: RunStore, live: dict | None = None) -> str:
    m = store.metrics
    last = m.iloc[-1] if len(m) else pd.Series(dtype=object)
    start = store.records("learner_start")
    total = start[-1].get("total_steps") if start else store.config.get("train", {}).get("total_steps")
    state = run_state(store)
    cards = [("policy version", f'<span id="policy-version">{store.version}</span>'),
             ("steps logged", f'<span id="steps">{len(m)}</span>' + (f" / {esc(total)}" if total else "")),
             ("episodes/s", fmt_rate(last.get("episodes_per_s"))), ("tokens/s", fmt_rate(last.get("tokens_per_s"))),
             ("samples/s", fmt_rate(last.get("samples_per_s"))), ("reward (last step)", fmt(last.get("reward_mean"))),
             ("episodes logged", _episodes_card(store)), ("algorithm", esc(store.algorithm or "?")),
             ("run", f'<span id="run-status" class="arl-state-{state.state}" title="{esc(state.reason)}">'
                     f'{state.state}</span>')]
    if "env/failures" in m and len(m):
        cards.append(("failed episodes (env)", fmt(int(pd.to_numeric(m["env/failures"], errors="coerce").fillna(0).sum()))))
    body = "".join(f'<div class="arl-card"><div class="k">{k}</div><div class="v">{v}</div></div>' for k, v in cards)
    extra = ""
    if live is not None:
        ago = f", last {time.time() - live['last']:.1f} s ago" if live.get("last") else ""
        extra = (f'<div class="k">live events from <code>{esc(live.get("address"))}</code>: '
                 f'{live.get("received", 0)} received{ago}{"; " + esc(live["error"]) if live.get("error") else ""}</div>')
    warn = "".join(note(f'<span class="arl-warning">Warning: {esc(w.get("message"))}</span>')
                   for w in store.records("warning")[-3:])  # e.g. algo.sandbox.isolation: none
    if store.warnings:
        warn += note("Skipped records: " + "<br>".join(esc(w) for w in store.warnings[-3:]))
    why = f'<div class="k" id="run-state-reason">run {state.state}: {esc(state.reason)}</div>'
    return f'<div class="arl-cards" id="overview-cards">{body}</div>{why}{extra}{warn}'


ACTOR_COLUMNS = {"actor_id": "actor", "status": "status", "weights_version": "weights version", "lag": "lag",
                 "batches": "batches", "weight_updates": "weight updates", "credits": "credits",
                 "unacked": "unacked", "capacity": "capacity", "generate_s": "generate (s)",
                 "last_status_s_ago": "last status (s ago)"}


def actors_html(store: RunStore) -> str:
    """The actors' latest status. Once the run is over (finished, interrupted, crashed) the lag
    behind the learner means nothing any more: it is left blank and the status says why."""
    df = store.actors()
    if df.empty:
        return note("No actor has reported its status yet.")
    state = run_state(store).state
    if state not in ("running", "waiting"):
        df["status"] = f"run {state}"
        df["lag"] = None
    return "<b>Actors</b>" + html_table(df.rename(columns=ACTOR_COLUMNS), "actors")


HELDOUT_LABEL = "held-out accuracy"


def overview_figure(store: RunStore) -> Figure:
    """The fixed panels. The held-out accuracy is a connected series over the evaluations' own
    versions (the one before training included), whatever the number of steps."""
    m = store.metrics
    fig, ax = _figure(12, cols=4)
    _curves(ax[0], m, ["reward_mean", "rlcr/answer_reward_mean", "rlcr/confidence_reward_mean"], "reward",
            extra={HELDOUT_LABEL: eval_series(store, "accuracy")})
    _curves(ax[1], m, ["loss", "pg_loss"], "loss")
    _curves(ax[2], m, ["approx_kl", "kl"], "KL")
    _curves(ax[3], m, ["clipfrac", "dual_clip_frac"], "clip fraction")
    _curves(ax[4], m, ["ratio_mean", "ratio_min", "ratio_max", "is_weight_mean"], "importance ratio")
    _curves(ax[5], m, ["entropy"], "entropy (per token)")
    _curves(ax[6], m, ["response_length_mean", "response_length_max"], "response length (tokens)")
    _curves(ax[7], m, ["groups/identical_reward_share"], "groups with identical rewards (share)")
    _curves(ax[8], m, ["episodes_per_s", "samples_per_s"], "throughput (per s)")
    _curves(ax[9], m, ["tokens_per_s"], "tokens/s")
    _curves(ax[10], m, ["train_s", "wait_s"], "learner time per step (s)")
    counts = staleness_counts(store.episodes())
    ax[11].set_title("staleness of trained episodes", fontsize=10)
    if counts.empty:
        _empty(ax[11], "no episodes yet")
    else:
        ax[11].bar(counts.index.astype(str), counts.values, color="#8250df")
        ax[11].set_xlabel("learner version - policy version", fontsize=8)
        ax[11].tick_params(labelsize=8)
    return fig


# ------------------------------------------------------------------------------------- metric explorer
DEFAULT_CURVES = ["reward_mean", "eval/accuracy"]


def metric_choices(stores: dict[str, RunStore]) -> list[str]:
    """Every numeric metric logged by any of ``stores`` (all columns of their metrics.jsonl)."""
    names: set[str] = set()
    for store in stores.values():
        names.update(metric_columns(store.metrics))
    return sorted(names)


def default_curves(choices: list[str]) -> list[str]:
    return [c for c in DEFAULT_CURVES if c in choices] or choices[:1]


def explorer_frame(stores: dict[str, RunStore], names: list[str], smoothing: float = 0.0) -> pd.DataFrame:
    """The picked metrics of every selected run as one long frame for an overlaid line plot."""
    return curves_frame(stores, list(names or []), float(smoothing or 0.0))


def config_html(store: RunStore) -> str:
    """The run's config snapshots (``config.yaml``, and ``config.resume-<N>.yaml`` per resumed
    segment), as written by the learner."""
    run_dir = store.run_dir
    snaps = []
    if run_dir is not None:
        first = config_snapshot(run_dir)
        if first.exists():
            snaps.append(("config.yaml (the run's first segment)", first))
        resumes = sorted(run_dir.glob("config.resume-*.yaml"),
                         key=lambda p: int(p.stem.rsplit("-", 1)[1]) if p.stem.rsplit("-", 1)[1].isdigit() else 0)
        snaps += [(f"{p.name} (the segment resumed at step {p.stem.rsplit('-', 1)[1]})", p) for p in resumes]
    if not snaps:
        return note("No config snapshot: this view has no run directory (live events only), or the learner has "
                    "not written <code>config.yaml</code> yet.")
    parts = []
    for title, path in snaps:
        try:
            text = path.read_text()
        except OSError as e:
            text = f"(cannot read: {e})"
        parts.append(f"<b>{esc(title)}</b><pre class=\"arl-config\">{esc(text)}</pre>")
    return f'<div id="config-view">{"".join(parts)}</div>'


# ------------------------------------------------------------------------------------- proposed tasks
def is_azr(store: RunStore) -> bool:
    return store.algorithm == "absolute_zero"


def azr_absent_note(store: RunStore) -> str:
    return note(f"This run does not use Absolute Zero (algorithm: <b>{esc(store.algorithm or 'unknown')}</b>), "
                "so it has no proposed tasks.")


def azr_groups_html(store: RunStore, limit: int = 30) -> str:
    g = store.azr_groups()
    if g.empty:
        return note("No Absolute Zero episodes logged yet.")
    g = g.tail(limit).iloc[::-1]
    view = pd.DataFrame({"step": g["step"], "seed prompt": g["seed_prompt"], "attempts": g["attempts"],
                         "reproposed": g["repropose_attempts"], "final status": g["final_status"],
                         "learnable": [f"{a}/{b}" for a, b in zip(g["num_learnable"], g["num_questions"])],
                         "invalid": g["num_invalid"], "sampled question": g["sampled_question"].fillna("-"),
                         "proposer reward (mean)": g["proposer_reward_mean"]})
    return f"<b>Question groups (latest {len(view)} prompts, newest first)</b>" + html_table(view, "azr-groups")


def _dims(q: pd.DataFrame) -> list[str]:
    return [c.split(":", 1)[1] for c in q.columns if c.startswith("ratio:")]


def _counted(window: str | None, dim: str) -> str:
    """What a dimension's ratio counts, from its window text ``'<0.5 in [0.3, 0.7]'``: e.g.
    ``completion<0.5`` (the share of responses whose completion score is below 0.5: the wrong ones)."""
    if not isinstance(window, str) or " in " not in window:
        return f"{dim} ratio"
    return f"{dim}{window.split(' in ', 1)[0]}"


def ratio_header(q: pd.DataFrame, dim: str) -> str:
    """Column header of a dimension's ratio: the share it counts and its pass window, e.g.
    ``share completion<0.5 (pass [0.3, 0.7])``."""
    windows = q[f"window:{dim}"].dropna()
    if windows.nunique() != 1:
        return f"{dim} share"
    w = windows.iloc[0]
    return f"share {_counted(w, dim)} (pass {w.split(' in ', 1)[1]})" if " in " in w else f"{dim} share"


def filter_questions(q: pd.DataFrame, status: str = "all", final_only: bool = True, search: str = "") -> pd.DataFrame:
    if status not in STATUS_FILTERS:
        raise ValueError(f"unknown status filter {status!r}; choose one of {STATUS_FILTERS}")
    if q.empty:
        return q
    if final_only:
        q = q[q["final"]]
    if status == "learnable":
        q = q[q["learnable"]]
    elif status == "not learnable":
        q = q[q["valid"] & ~q["learnable"]]
    elif status == "invalid":
        q = q[~q["valid"]]
    elif status == "sampled":
        q = q[q["sampled"]]
    if search:
        s = search.lower()
        hay = (q["question"].fillna("") + " " + q["proposal"].fillna("") + " " + q["seed_prompt"].fillna(""))
        q = q[hay.str.lower().str.contains(s, regex=False)]
    return q.iloc[::-1].head(MAX_QUESTION_ROWS)  # newest first


def questions_table(q: pd.DataFrame) -> tuple[pd.DataFrame, list[tuple]]:
    """Display table of filtered questions and the row keys ``(episode_id, attempt, index)``."""
    dims = _dims(q)
    cols = ["step", "seed prompt", "attempt", "q", "question", "answer", "valid"] + \
           [f"{d} ratio" for d in dims] + ["learnable", "sampled", "reproposed", "proposer reward", "solve rate"]
    if q.empty:
        return pd.DataFrame(columns=cols), []
    out = pd.DataFrame({
        "step": q["step"].astype(int), "seed prompt": q["seed_prompt"], "attempt": q["attempt"].astype(int),
        "q": q["index"].astype(int), "question": [x if v else f"(invalid) {p}" for x, v, p in
                                                  zip(q["question"], q["valid"], q["proposal"])],
        "answer": q["answer"].fillna(""), "valid": q["valid"].map({True: "yes", False: "no"})})
    for d in dims:
        windows = q[f"window:{d}"].dropna()
        name = ratio_header(q, d)
        out[name] = [f"{fmt(r, 2)} {'pass' if p else 'FAIL'}" + ("" if windows.nunique() == 1 else f" ({w})")
                     for r, p, w in zip(q[f"ratio:{d}"], q[f"passed:{d}"], q[f"window:{d}"])]
    out["learnable"] = q["learnable"].map({True: "LEARNABLE", False: "no"}).values
    out["sampled"] = q["sampled"].map({True: "sampled", False: ""}).values
    out["reproposed"] = q["repropose_attempts"].astype(int).values
    out["proposer reward"] = [fmt(x) for x in q["proposer_reward"]]
    out["solve rate"] = [fmt(x, 2) for x in q["solve_rate"]]
    keys = [(str(e), int(a), int(i)) for e, a, i in zip(q["episode_id"], q["attempt"], q["index"])]
    return out.reset_index(drop=True), keys


def question_detail_html(store: RunStore, key: tuple | None) -> str:
    if key is None:
        return note("Click a question in the table to see its solver responses and scores.")
    q = store.azr_questions()
    sel = q[(q["episode_id"] == key[0]) & (q["attempt"] == key[1]) & (q["index"] == key[2])]
    if sel.empty:
        return note("That question is no longer in the view.")
    r = sel.iloc[0]
    dims = _dims(q)
    head = (f"<b>Step {int(r['step'])}, prompt <code>{esc(r['seed_prompt'])}</code>, attempt {int(r['attempt'])}, "
            f"question {int(r['index'])}</b><br>proposal <code>{esc(r['proposal'])}</code> -> question "
            f"<code>{esc(r['question'])}</code> answer <code>{esc(r['answer'])}</code>; "
            f"{'<span class=arl-ok>learnable</span>' if r['learnable'] else '<span class=arl-bad>not learnable</span>'}"
            f"{', sampled for training' if r['sampled'] else ''}")
    if not r["valid"]:
        return f'<div id="question-detail">{head}<br>invalid: {esc(r["reason"])}</div>'
    dim_rows = pd.DataFrame({"dimension": dims, "share of responses": [r[f"ratio:{d}"] for d in dims],
                             "counts": [_counted(r[f"window:{d}"], d) for d in dims],
                             "window": [r[f"window:{d}"] for d in dims],
                             "passed": ["yes" if r[f"passed:{d}"] else "no" for d in dims]})
    resp = pd.DataFrame({"#": range(len(r["responses"])), "response": r["responses"],
                         "reward": list(r["rewards"]) + [None] * (len(r["responses"]) - len(r["rewards"]))})
    errors = f"<br>scoring errors: {esc('; '.join(r['score_errors']))}" if r["score_errors"] else ""
    return (f'<div id="question-detail">{head}{html_table(dim_rows)}<b>Solver responses</b>'
            f'{html_table(resp, "solver-responses")}{errors}</div>')


# ------------------------------------------------------------------------------------- confidence trees
def is_rlcr(store: RunStore) -> bool:
    return store.algorithm == "rlcr"


def rlcr_absent_note(store: RunStore) -> str:
    return note(f"This run does not use RLCR (algorithm: <b>{esc(store.algorithm or 'unknown')}</b>), "
                "so it has no confidence trees.")


def _mark(ok: bool, yes: str, no: str) -> str:
    return f'<span class="arl-ok">{yes}</span>' if ok else f'<span class="arl-bad">{no}</span>'


def trees_html(store: RunStore, limit: int = 10, search: str = "") -> str:
    eps = [e for e in store.records("episode") if (e.get("decision") or {}).get("kind") == "rlcr_tree"]
    if search:
        eps = [e for e in eps if search.lower() in str(e.get("prompt")).lower()]
    if not eps:
        return note("No confidence trees logged yet." if not search else "No tree matches the search.")
    out = [f"<b>Latest {min(limit, len(eps))} of {len(eps)} trees (newest first)</b>"]
    for n, e in enumerate(eps[::-1][:limit]):
        d = e["decision"]
        is_open = " open" if n == 0 else ""  # the newest tree unfolded
        answers = d.get("answers") or []
        acc = np.mean([a.get("acc_reward", 0) for a in answers]) if answers else float("nan")
        briers = [c.get("conf_reward", 0) for a in answers for c in a.get("confidences") or []]
        prompt = " ".join(str(m.get("content", "")) for m in (e.get("prompt") or []) if isinstance(m, dict))
        parts = [f'<details class="arl-tree rlcr-tree"{is_open}><summary>step {e.get("step")} · prompt '
                 f'<code>{esc(prompt)}</code> · gold <code>{esc(d.get("gold"))}</code> · accuracy {fmt(acc, 2)} · '
                 f'mean Brier reward {fmt(np.mean(briers) if briers else float("nan"), 3)}</summary>']
        for a in answers:
            parts.append(f'<details class="rlcr-answer"{is_open}><summary>answer {a.get("k")}: '
                         f'<code>{esc(a.get("answer"))}</code> '
                         f'{_mark(bool(a.get("acc_reward")), "correct", "wrong")} · acc reward {fmt(a.get("acc_reward"))}'
                         f' · advantage {fmt(a.get("advantage"))}'
                         f'{"" if a.get("format_ok") else " · format: " + esc(a.get("reason"))}</summary>'
                         f'<div class="arl-mono">{esc(a.get("text"))}</div><ul>')
            for c in a.get("confidences") or []:
                conf = c.get("confidence")
                parts.append(f'<li class="rlcr-confidence">confidence {c.get("h")}: <b>{fmt(conf, 2)}</b> · Brier '
                             f'reward {fmt(c.get("conf_reward"))} · advantage {fmt(c.get("advantage"))}'
                             f'{"" if c.get("format_ok") else " · " + esc(c.get("reason"))}'
                             f' <span class="arl-mono">{esc(c.get("text"))}</span></li>')
            parts.append("</ul></details>")
        parts.append("</details>")
        out.append("".join(parts))
    return "".join(out)


def calibration_figure(store: RunStore) -> Figure:
    ev = store.evals()
    fig, ax = _figure(2, cols=2, height=3.2)
    with_bins = ev[ev["reliability"].notna()] if "reliability" in ev else ev.iloc[0:0]
    if with_bins.empty:
        _empty(ax[0], "no evaluation with reliability bins yet")
        _empty(ax[1], "no evaluation yet")
        return fig
    last = with_bins.iloc[-1]
    bins = reliability_frame(last.to_dict())
    centers = (bins["lo"] + bins["hi"]) / 2
    filled = bins["count"] > 0
    ax[0].bar(centers[filled], bins["accuracy"][filled].astype(float), width=bins["hi"][0] - bins["lo"][0],
              edgecolor="black", color="#54aeff", label="accuracy")
    ax[0].plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    ax[0].set_xlim(0, 1)
    ax[0].set_ylim(0, 1)
    ax[0].set_xlabel("stated confidence", fontsize=8)
    ax[0].set_ylabel("accuracy", fontsize=8)
    cs = calibration_summary(last.to_dict())
    ece, brier = (NA if cs[k] is None else fmt(cs[k]) for k in ("ece", "brier"))
    ax[0].set_title(f"reliability, eval at version {last.get('version', last['step'])}: ECE {ece}, "
                    f"Brier {brier}\n({cs['parsed']} of {cs['size']} confidences parsed; "
                    f"unparsed count as 0)", fontsize=9)
    for x, n in zip(centers[filled], bins["count"][filled]):
        ax[0].text(x, 0.02, str(int(n)), ha="center", fontsize=7)
    ax[0].legend(fontsize=7)
    x = with_bins["version"] if "version" in with_bins else with_bins["step"]
    summaries = [calibration_summary(r) for r in with_bins.to_dict("records")]
    for col in ("ece", "brier", "accuracy"):
        y = [np.nan if c[col] is None else float(c[col]) for c in summaries]
        ax[1].plot(x, y, marker="o", label=col)
    parsed = [c["parsed"] / c["size"] if c["size"] else np.nan for c in summaries]
    ax[1].plot(x, parsed, marker="x", linestyle=":", color="gray", label="share of confidences parsed")
    ax[1].set_title("calibration over evaluations (ECE, Brier: n/a with none parsed)", fontsize=9)
    ax[1].set_xlabel("policy version", fontsize=8)
    ax[1].legend(fontsize=7)
    return fig


# ------------------------------------------------------------------------------------- replay buffer
REPLAY_METRICS = ["replay/pool_tasks", "replay/skip_tasks", "replay/pool_trajectories", "replay/replayed_share",
                  "replay/active"]


def has_replay(store: RunStore) -> bool:
    m = store.metrics
    return bool(store.records("replay_state")) or any(c in m.columns for c in REPLAY_METRICS)


def replay_html(store: RunStore) -> str:
    parts = []
    if not has_replay(store):
        parts.append(note("This run has no experience replay (no <code>replay/*</code> metrics and no "
                          "<code>replay_state</code> events); below: the learner's buffer only."))
    states = store.records("replay_state")
    m = store.metrics
    cards = [("buffer size (episodes)", fmt(m["buffer_size"].iloc[-1]) if "buffer_size" in m and len(m) else "-")]
    if states:
        s = states[-1]
        cards += [("pool tasks", fmt(s.get("pool_tasks"))), ("skip set tasks", fmt(s.get("skip_tasks"))),
                  ("pool trajectories", fmt(s.get("pool_trajectories")))]
    elif len(m):
        for c, label in (("replay/pool_tasks", "pool tasks"), ("replay/skip_tasks", "skip set tasks"),
                         ("replay/pool_trajectories", "pool trajectories")):
            if c in m:
                cards.append((label, fmt(m[c].iloc[-1])))
    if "replay/replayed_share" in m and len(m):
        cards.append(("replayed share (last batch)", fmt(m["replay/replayed_share"].iloc[-1], 3)))
    tr = store.trajectories()
    if not tr.empty:
        recent = tr[tr["step"] > tr["step"].max() - 10]
        cards.append(("replayed share (last 10 steps' logged trajectories)", fmt(recent["is_replay"].mean(), 3)))
    parts.append('<div class="arl-cards" id="replay-cards">' + "".join(
        f'<div class="arl-card"><div class="k">{k}</div><div class="v">{v}</div></div>' for k, v in cards) + "</div>")
    return "".join(parts)


def replay_figure(store: RunStore) -> Figure:
    m = store.metrics
    fig, ax = _figure(5, cols=3, height=3.4)
    _curves(ax[0], m, ["buffer_size", "in_flight"], "buffer size / in flight (episodes)")
    eps = store.episodes()
    ax[1].set_title("trained episodes by policy version (last 20 steps)", fontsize=10)
    if eps.empty:
        _empty(ax[1], "no episodes yet")
    else:
        recent = eps[eps["step"] > eps["step"].max() - 20]
        counts = recent["policy_version"].value_counts().sort_index()
        ax[1].bar(counts.index.astype(str), counts.values, color="#2da44e")
        ax[1].set_xlabel("policy version", fontsize=8)
        ax[1].tick_params(labelsize=7)
    _curves(ax[2], m, ["replay/pool_tasks", "replay/skip_tasks", "replay/pool_trajectories"], "replay pool / skip set")
    states = store.records("replay_state")
    ax[3].set_title("replay buckets (latest): tasks by success count", fontsize=10)
    if states and states[-1].get("buckets"):
        b = {str(k): v for k, v in states[-1]["buckets"].items()}  # int keys when received live
        keys = sorted(b, key=lambda k: (len(k), k))
        ax[3].bar(keys, [b[k] for k in keys], color="#bf8700")
        ax[3].set_xlabel("successes", fontsize=8)
    else:
        _empty(ax[3], "no replay_state events")
    _curves(ax[4], m, ["replay/replayed_share"], "replayed share of each batch")
    return fig


# ------------------------------------------------------------------------------------- samples
def sample_choices(store: RunStore) -> list[tuple[str, int]]:
    out = []
    for i, s in enumerate(store.records("sample")):
        out.append((f"step {s.get('step')} · {s.get('sample_type')} · reward {fmt(s.get('reward'))} · "
                    f"{s.get('num_tokens')} tokens", i))
    return out[::-1]


def _lp(x: Any) -> str:
    return "-" if x is None else f"{float(x):.3f}"


def sample_html(store: RunStore, index: int | None) -> str:
    samples = store.records("sample")
    if not samples:
        return note("This run has no per-token samples (<code>sample</code> events): the learner writes one "
                    "every <code>log.sample_every</code> steps (0 turns them off).")
    s = samples[-1] if index is None or not 0 <= int(index) < len(samples) else samples[int(index)]
    toks = s.get("tokens") or []
    lm, em = s.get("loss_mask") or [], s.get("exp_mask") or []
    bl, cl = s.get("behavior_logprobs") or [], s.get("current_logprobs") or []
    spans, rows = [], []
    for i, tok in enumerate(toks):
        loss, exp = (lm[i] if i < len(lm) else 0), (em[i] if i < len(em) else 0)
        b, c = (bl[i] if i < len(bl) else None), (cl[i] if i < len(cl) else None)
        color = "#ffd8b5" if exp else ("#aceebb" if loss else "#eaeef2")
        title = f"#{i + s.get('offset', 0)} loss_mask={loss} exp_mask={exp} behaviour={_lp(b if loss else None)} current={_lp(c)}"
        shown = tok.replace("\n", "\u21b5\n") if tok else "\u2205"
        spans.append(f'<span class="arl-tok" style="background:{color}" title="{esc(title)}">{esc(shown)}</span>')
        if loss or exp:
            diff = None if (b is None or c is None) else c - b
            rows.append({"pos": i + s.get("offset", 0), "token": tok, "loss_mask": loss, "exp_mask": exp,
                         "behaviour logp": _lp(b), "current logp": _lp(c), "current - behaviour": _lp(diff)})
    head = (f"<b>Step {s.get('step')}: {esc(s.get('sample_type'))} trajectory of episode "
            f"<code>{esc(s.get('episode_id'))}</code></b> · behaviour policy version {s.get('policy_version')} · "
            f"reward {fmt(s.get('reward'))} · {s.get('num_tokens')} tokens"
            f"{' (showing the last ' + str(len(toks)) + ')' if s.get('truncated') else ''}"
            f"{' · replayed' if s.get('is_replay') else ''}")
    legend = ('<div style="margin:6px 0">'
              '<span class="arl-tok" style="background:#eaeef2">context (loss mask 0)</span> '
              '<span class="arl-tok" style="background:#aceebb">learned (loss mask 1)</span> '
              '<span class="arl-tok" style="background:#ffd8b5">replayed (exp mask 1)</span> '
              '· hover a token for its log-probs</div>')
    table = html_table(pd.DataFrame(rows), "sample-tokens") if rows else ""
    return f'<div id="sample-view">{head}{legend}<div style="line-height:1.9">{"".join(spans)}</div>{table}</div>'
