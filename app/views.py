"""What the generic views of ``asyncrl ui`` show (overview, charts, runs table, replay buffer, samples,
config), as HTML strings, matplotlib figures and DataFrames; the algorithms' own tabs are theirs
(:func:`algorithm_views`, :class:`app.kit.AlgorithmView`).

Pure functions of a :class:`asyncrl.analysis.RunStore` (no Gradio here), so that they can be tested
and reused. Every text that comes from a run is HTML-escaped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from asyncrl.analysis import RunStore, actor_statuses, chart_data, run_state, runs_table, staleness_counts
from asyncrl.analysis.advice import advise
from asyncrl.analysis.ledger import ledger_rows
from asyncrl.analysis.metric_series import SUMMARY_METRICS
from asyncrl.config import ConfigError
from asyncrl.rollout.workflow import all_workflows, workflow_class
from asyncrl.rundir.layout import LEDGER, config_snapshot

from .kit import CSS, AlgorithmView, curves, empty_axes, esc, figure, fmt, fmt_rate, html_table, note  # noqa: F401


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
    cards = [
        ("policy version", f'<span id="policy-version">{store.version}</span>'),
        ("steps logged", f'<span id="steps">{len(m)}</span>' + (f" / {esc(total)}" if total else "")),
        ("episodes/s", fmt_rate(last.get("episodes_per_s"))),
        ("tokens/s", fmt_rate(last.get("tokens_per_s"))),
        ("samples/s", fmt_rate(last.get("samples_per_s"))),
        ("reward (last step)", fmt(last.get("reward_mean"))),
        ("episodes logged", _episodes_card(store)),
        ("algorithm", esc(store.algorithm or "?")),
        (
            "run",
            f'<span id="run-status" class="arl-state-{state.state}" title="{esc(state.reason)}">{state.state}</span>',
        ),
    ]
    if "env/failures" in m and len(m):
        cards.append(
            ("failed episodes (env)", fmt(int(pd.to_numeric(m["env/failures"], errors="coerce").fillna(0).sum())))
        )
    body = "".join(f'<div class="arl-card"><div class="k">{k}</div><div class="v">{v}</div></div>' for k, v in cards)
    extra = ""
    if live is not None:
        ago = f", last {time.time() - live['last']:.1f} s ago" if live.get("last") else ""
        extra = (
            f'<div class="k">live events from <code>{esc(live.get("address"))}</code>: '
            f"{live.get('received', 0)} received{ago}{'; ' + esc(live['error']) if live.get('error') else ''}</div>"
        )
    warn = "".join(
        note(f'<span class="arl-warning">Warning: {esc(w.get("message"))}</span>')
        for w in store.records("warning")[-3:]
    )  # e.g. algo.sandbox.isolation: none
    if store.warnings:
        warn += note("Skipped records: " + "<br>".join(esc(w) for w in store.warnings[-3:]))
    why = f'<div class="k" id="run-state-reason">run {state.state}: {esc(state.reason)}</div>'
    return f'<div class="arl-cards" id="overview-cards">{body}</div>{why}{extra}{warn}{advice_html(store)}'


def advice_html(store: RunStore) -> str:
    """What to change, from the measured rates (``asyncrl.analysis.advice``): the verdict and its numbers."""
    a = advise(store.metrics.to_dict("records"), store.records("actor_status"), store.config)
    if a.verdict == "too early":
        return ""
    return (
        f'<div class="arl-advice" id="advice" data-verdict="{esc(a.verdict)}"><b>What to change</b> '
        f"({esc(a.verdict)}): " + " ".join(esc(x) for x in a.lines) + "</div>"
    )


ACTOR_COLUMNS = {
    "actor_id": "actor",
    "status": "status",
    "weights_version": "weights version",
    "lag": "versions behind the learner",
    "batches": "batches",
    "weight_updates": "weight updates",
    "credits": "credits",
    "unacked": "unacked",
    "capacity": "capacity",
    "generate_s": "generate (s)",
    "last_status_s_ago": "last status (s ago)",
}


def actors_html(store: RunStore) -> str:
    """The actors' latest status. Once the run is over (finished, interrupted, crashed) the lag
    behind the learner means nothing any more: it is left blank and the status says why."""
    df = actor_statuses(store)
    if df.empty:
        return note("No actor has reported its status yet.")
    return (
        "<b>Actors</b>"
        + html_table(df.rename(columns=ACTOR_COLUMNS), "actors")
        + note(
            "Versions behind the learner: the learner's version now minus the weights the actor holds. "
            "buffer.max_staleness bounds something else: how many versions older than the step that trains "
            "them an episode's tokens may be (the staleness/* charts), so an actor may be further behind "
            "while what it sends is dropped or waits."
        )
    )


def reward_metrics(store: RunStore) -> tuple[str, ...]:
    """The run's algorithm's own reward metrics (``Workflow.reward_metrics``), charted with reward_mean."""
    try:
        return workflow_class(store.algorithm).reward_metrics if store.algorithm else ()
    except ConfigError:  # an algorithm this install does not have
        return ()


def algorithm_views() -> list[AlgorithmView]:
    """The Completions tab every run has, then one instance of every tab the registered algorithms
    add (``Workflow.views``), in name order."""
    from asyncrl.plugins import resolve_import

    from .completions import CompletionsView

    return [
        CompletionsView(),
        *(resolve_import(path, "views")() for _, wf in sorted(all_workflows().items()) for path in wf.views),
    ]


def staleness_panel(ax, store: RunStore) -> None:
    counts = staleness_counts(store.episodes())
    ax.set_title("staleness of trained episodes", fontsize=10)
    if counts.empty:
        empty_axes(ax, "no episodes yet")
    else:
        ax.bar(counts.index.astype(str), counts.values, color="#8250df")
        ax.set_xlabel("learner version - policy version", fontsize=8)
        ax.tick_params(labelsize=8)


LAG_BINS = ("0", "1", "2", "3", "ge4")


def has_staleness(store: RunStore) -> bool:
    return "staleness/token_lag_frac_0" in store.metrics.columns


def staleness_figure(store: RunStore) -> Figure:
    """Staleness as a distribution (issue 67): per step, the share of the trained tokens made by
    each version lag (``staleness/token_lag_frac_*``, token-weighted, stacked), what the bound cut
    (tokens truncated, episodes dropped as stale, per step), and trained episodes by staleness."""
    m = store.metrics
    fig, ax = figure(3, cols=3, height=3.4)
    ax[0].set_title("trained tokens by version lag, per step", fontsize=10)
    cols = [f"staleness/token_lag_frac_{b}" for b in LAG_BINS if f"staleness/token_lag_frac_{b}" in m]
    if not cols or not len(m):
        empty_axes(ax[0], "no staleness/token_lag_* metrics yet")
    else:
        x = m["step"] if "step" in m else m.index
        ys = [pd.to_numeric(m[c], errors="coerce").fillna(0.0).to_numpy() for c in cols]
        colors = ["#2da44e", "#bf8700", "#cf222e", "#8250df", "#57606a"]
        bottom = np.zeros(len(m))
        for y, c, color in zip(ys, cols, colors):  # (stacked bars: one per step, no interpolation between steps)
            ax[0].bar(x, y, bottom=bottom, width=1.0, color=color, label=f"lag {c.rsplit('_', 1)[1]}", linewidth=0)
            bottom += y
        ax[0].set_ylim(0, 1)
        ax[0].set_xlabel("step", fontsize=8)
        ax[0].set_ylabel("share of the step's tokens", fontsize=8)
        ax[0].legend(fontsize=7, loc="lower left")
        ax[0].tick_params(labelsize=7)
    ax[1].set_title("cut by the staleness bound, per step", fontsize=10)
    if not len(m) or "dropped_stale" not in m:
        empty_axes(ax[1], "no metrics yet")
    else:
        x = m["step"] if "step" in m else m.index
        dropped = pd.to_numeric(m["dropped_stale"], errors="coerce").ffill().fillna(0).diff().clip(lower=0)
        ax[1].plot(x, dropped, label="episodes dropped as stale", color="#cf222e")
        if "staleness/tokens_truncated" in m:
            ax[1].plot(x, pd.to_numeric(m["staleness/tokens_truncated"], errors="coerce"), label="tokens truncated")
        ax[1].set_xlabel("step", fontsize=8)
        ax[1].legend(fontsize=7)
        ax[1].tick_params(labelsize=7)
    staleness_panel(ax[2], store)
    return fig


# ------------------------------------------------------------------------------------- charts
CHARTS_JS = (Path(__file__).parent / "svg_charts.js").read_text()
CHARTS_CSS = """
.arl-charts-bar{display:flex;flex-wrap:wrap;gap:14px;align-items:center;margin:4px 0 8px;font-size:.9em}
.arl-charts-bar select,.arl-charts-bar input[type=search]{border:1px solid #d0d7de;border-radius:6px;padding:2px 6px}
.arl-legend-run{margin-right:10px;font-weight:600}
.arl-charts-state{color:#57606a;font-size:.85em}
details.arl-chart-group{margin:4px 0}details.arl-chart-group>summary{font-weight:600;cursor:pointer;padding:3px 0}
.arl-chart-row{display:flex;flex-wrap:wrap;gap:8px}
.arl-chart{position:relative;border:1px solid #d0d7de;border-radius:6px;padding:4px;background:#fff}
.arl-chart-title{font-size:.85em;font-weight:600;font-family:monospace;margin:0 0 2px 4px}
.arl-chart-span{font-weight:400;font-family:sans-serif;color:#57606a}
.arl-tip{position:absolute;left:56px;top:24px;background:rgba(255,255,255,.95);border:1px solid #d0d7de;
  border-radius:4px;padding:3px 6px;font-size:.78em;pointer-events:none;z-index:5;max-width:300px}
.arl-flat{font-size:.8em;color:#57606a;margin:4px 0 8px}
"""


def charts_json(stores: dict[str, RunStore], pinned: list[str] | tuple[str, ...] = ()) -> str:
    """The value of the charts view: :func:`asyncrl.analysis.chart_data` as JSON (drawn in the
    browser by ``svg_charts.js``)."""
    group_of = {name: "reward" for store in stores.values() for name in reward_metrics(store)}
    return json.dumps(chart_data(stores, pinned, group_of), separators=(",", ":"), allow_nan=False)


def runs_html(stores: dict[str, RunStore]) -> str:
    """The runs compared: each run's state and final figures, and the config keys that differ."""
    if not stores:
        return ""
    df = runs_table(stores)
    n = len(df.columns) - 7 - len(SUMMARY_METRICS)  # (run, algorithm, state, steps, time, samples, best)
    what = (
        f"; the last {n} column(s): the config keys that differ"
        if n > 0
        else "; no config key differs"
        if len(stores) > 1
        else ""
    )
    return f"<b>Runs ({len(stores)}{what})</b>" + html_table(
        df.map(lambda v: fmt(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v), "runs-table"
    )


def config_html(store: RunStore) -> str:
    """The run's config: first what differs from the defaults (``asyncrl config --diff``, the default
    beside each key), then each snapshot in full, folded (``config.yaml``, and ``config.resume-<N>.yaml``
    per resumed segment), as written by the learner."""
    run_dir = store.run_dir
    snaps = []
    if run_dir is not None:
        first = config_snapshot(run_dir)
        if first.exists():
            snaps.append(("config.yaml (the run's first segment)", first))
        resumes = sorted(
            run_dir.glob("config.resume-*.yaml"),
            key=lambda p: int(p.stem.rsplit("-", 1)[1]) if p.stem.rsplit("-", 1)[1].isdigit() else 0,
        )
        snaps += [(f"{p.name} (the segment resumed at step {p.stem.rsplit('-', 1)[1]})", p) for p in resumes]
    if not snaps:
        return note(
            "No config snapshot: this view has no run directory (live events only), or the learner has "
            "not written <code>config.yaml</code> yet."
        )
    parts = [_config_diff(snaps[-1][1])]
    for title, path in snaps:
        try:
            text = path.read_text()
        except OSError as e:
            text = f"(cannot read: {e})"
        parts.append(
            f"<details><summary><b>{esc(title)}</b>, in full</summary>"
            f'<pre class="arl-config">{esc(text)}</pre></details>'
        )
    return f'<div id="config-view">{"".join(parts)}</div>'


def _config_diff(path: Path) -> str:
    """What the snapshot at ``path`` sets apart from the defaults, the default beside each key."""
    from asyncrl.analysis.config_view import show_config
    from asyncrl.config import load_config

    try:
        text = show_config(load_config(path), diff=True)
    except Exception as e:  # noqa: BLE001 - a snapshot this install cannot load (another version's keys)
        return note(
            f"Cannot compare <code>{esc(path.name)}</code> with the defaults: {esc(type(e).__name__)}: {esc(e)}"
        )
    return (
        f"<b>What this run sets apart from the defaults</b> (<code>{esc(path.name)}</code>; "
        f"<code>asyncrl config -c {esc(path.name)} --diff</code>)"
        f'<pre class="arl-config" id="config-diff">{esc(text)}</pre>'
    )


# ------------------------------------------------------------------------------------- replay buffer
REPLAY_METRICS = [
    "replay/pool_tasks",
    "replay/skip_tasks",
    "replay/pool_trajectories",
    "replay/replayed_share",
    "replay/active",
]


def hidden_tabs_css(tab_ids: list[str]) -> str:
    """A style rule hiding the buttons of the tabs ``tab_ids`` (those that do not apply to the run shown)."""
    if not tab_ids:
        return ""
    rules = ",".join(f'button[role=tab][data-tab-id="{esc(t)}"]' for t in tab_ids)
    return f'<style id="hidden-tabs" data-tabs="{esc(",".join(tab_ids))}">{rules}{{display:none}}</style>'


def has_ledger(store: RunStore) -> bool:
    return store.run_dir is not None and (Path(store.run_dir) / LEDGER).exists()


def ledger_html(store: RunStore) -> str:
    """The task ledger (``asyncrl ledger RUN``): per epoch, tasks trained once, dropped and why, dealt
    again, open, and the exactly-once check (docs/guide/guarantees.md)."""
    if not has_ledger(store):
        return note("This run has no task ledger (<code>tasks.ledger=false</code>, or a run read over the wire).")
    try:
        rows, resumes, ok = ledger_rows(Path(store.run_dir))
    except (OSError, ValueError, KeyError, TypeError) as e:
        return note(f"The task ledger could not be read: {esc(e)}")
    rolled = sum(r.get("rolled_back", 0) for r in resumes)
    verdict = (
        '<b id="ledger-verdict">exactly once: every task trained at most once per epoch</b>'
        if ok
        else '<b id="ledger-verdict" style="color:#b00">exactly once: VIOLATED (tasks trained twice below)</b>'
    )
    head = note(
        f"{len(resumes)} resume(s), {rolled} record(s) rolled back with lost steps. An epoch is "
        "<i>closed</i> when every task of it was trained once or counted as used; <i>open</i> tasks of the "
        "newest epochs are in flight."
    )
    table = pd.DataFrame([{k: v for k, v in r.items() if k != "trained twice"} for r in rows[-50:]])
    return verdict + head + html_table(table, table_id="ledger-table")


def has_replay(store: RunStore) -> bool:
    m = store.metrics
    return bool(store.records("replay_state")) or any(c in m.columns for c in REPLAY_METRICS)


def replay_html(store: RunStore) -> str:
    parts = []
    if not has_replay(store):
        parts.append(
            note(
                "This run has no experience replay (no <code>replay/*</code> metrics and no "
                "<code>replay_state</code> events); below: the learner's buffer only."
            )
        )
    states = store.records("replay_state")
    m = store.metrics
    cards = [("buffer size (episodes)", fmt(m["buffer_size"].iloc[-1]) if "buffer_size" in m and len(m) else "-")]
    if states:
        s = states[-1]
        cards += [
            ("pool tasks", fmt(s.get("pool_tasks"))),
            ("skip set tasks", fmt(s.get("skip_tasks"))),
            ("pool trajectories", fmt(s.get("pool_trajectories"))),
        ]
    elif len(m):
        for c, label in (
            ("replay/pool_tasks", "pool tasks"),
            ("replay/skip_tasks", "skip set tasks"),
            ("replay/pool_trajectories", "pool trajectories"),
        ):
            if c in m:
                cards.append((label, fmt(m[c].iloc[-1])))
    if "replay/replayed_share" in m and len(m):
        cards.append(("replayed share (last batch)", fmt(m["replay/replayed_share"].iloc[-1], 3)))
    tr = store.trajectories()
    if not tr.empty:
        recent = tr[tr["step"] > tr["step"].max() - 10]
        cards.append(("replayed share (last 10 steps' logged trajectories)", fmt(recent["is_replay"].mean(), 3)))
    parts.append(
        '<div class="arl-cards" id="replay-cards">'
        + "".join(f'<div class="arl-card"><div class="k">{k}</div><div class="v">{v}</div></div>' for k, v in cards)
        + "</div>"
    )
    return "".join(parts)


def replay_figure(store: RunStore) -> Figure:
    m = store.metrics
    fig, ax = figure(6, cols=3, height=3.4)
    curves(ax[0], m, ["buffer_size", "in_flight"], "buffer size / in flight (episodes)")
    eps = store.episodes()
    ax[1].set_title("trained episodes by policy version (last 20 steps)", fontsize=10)
    if eps.empty:
        empty_axes(ax[1], "no episodes yet")
    else:
        recent = eps[eps["step"] > eps["step"].max() - 20]
        counts = recent["policy_version"].value_counts().sort_index()
        ax[1].bar(counts.index.astype(str), counts.values, color="#2da44e")
        ax[1].set_xlabel("policy version", fontsize=8)
        ax[1].tick_params(labelsize=7)
    curves(ax[2], m, ["replay/pool_tasks", "replay/skip_tasks", "replay/pool_trajectories"], "replay pool / skip set")
    states = store.records("replay_state")
    ax[3].set_title("replay buckets (latest): tasks by success count", fontsize=10)
    if states and states[-1].get("buckets"):
        b = {str(k): v for k, v in states[-1]["buckets"].items()}  # int keys when received live
        keys = sorted(b, key=lambda k: (len(k), k))
        ax[3].bar(keys, [b[k] for k in keys], color="#bf8700")
        ax[3].set_xlabel("successes", fontsize=8)
    else:
        empty_axes(ax[3], "no replay_state events")
    curves(ax[4], m, ["replay/replayed_share"], "replayed share of each batch")
    staleness_panel(ax[5], store)
    return fig


# ------------------------------------------------------------------------------------- samples
def sample_choices(store: RunStore) -> list[tuple[str, int]]:
    out = []
    for i, s in enumerate(store.records("sample")):
        out.append(
            (
                f"step {s.get('step')} · {s.get('sample_type')} · reward {fmt(s.get('reward'))} · "
                f"{s.get('num_tokens')} tokens",
                i,
            )
        )
    return out[::-1]


def _lp(x: Any) -> str:
    return "-" if x is None else f"{float(x):.3f}"


def sample_html(store: RunStore, index: int | None) -> str:
    samples = store.records("sample")
    if not samples:
        return note(
            "This run has no per-token samples (<code>sample</code> events): the learner writes one "
            "every <code>log.sample_every</code> steps (0 turns them off)."
        )
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
            rows.append(
                {
                    "pos": i + s.get("offset", 0),
                    "token": tok,
                    "loss_mask": loss,
                    "exp_mask": exp,
                    "behaviour logp": _lp(b),
                    "current logp": _lp(c),
                    "current - behaviour": _lp(diff),
                }
            )
    head = (
        f"<b>Step {s.get('step')}: {esc(s.get('sample_type'))} trajectory of episode "
        f"<code>{esc(s.get('episode_id'))}</code></b> · behaviour policy version {s.get('policy_version')} · "
        f"reward {fmt(s.get('reward'))} · {s.get('num_tokens')} tokens"
        f"{' (showing the last ' + str(len(toks)) + ')' if s.get('truncated') else ''}"
        f"{' · replayed' if s.get('is_replay') else ''}"
    )
    legend = (
        '<div style="margin:6px 0">'
        '<span class="arl-tok" style="background:#eaeef2">context (loss mask 0)</span> '
        '<span class="arl-tok" style="background:#aceebb">learned (loss mask 1)</span> '
        '<span class="arl-tok" style="background:#ffd8b5">replayed (exp mask 1)</span> '
        "· hover a token for its log-probs</div>"
    )
    table = html_table(pd.DataFrame(rows), "sample-tokens") if rows else ""
    return f'<div id="sample-view">{head}{legend}<div style="line-height:1.9">{"".join(spans)}</div>{table}</div>'
