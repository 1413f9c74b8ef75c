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

from asyncrl.analysis import RunStore, reliability_frame, staleness_counts  # noqa: E402

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
table.arl th{background:#f6f8fa}
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
        return "-"
    return f"{f:.{digits}g}" if abs(f) < 1e-3 and f != 0 else f"{f:.{digits}f}".rstrip("0").rstrip(".") or "0"


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


def _curves(ax, m: pd.DataFrame, cols: list[str], title: str) -> None:
    ax.set_title(title, fontsize=10)
    present = [c for c in cols if c in m.columns and m[c].notna().any()]
    if not present:
        _empty(ax, "not logged in this run")
        return
    for c in present:
        ax.plot(m["step"], m[c], marker="." if len(m) < 30 else None, label=c)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    if len(present) > 1:
        ax.legend(fontsize=7)


# ------------------------------------------------------------------------------------- overview
def run_status(store: RunStore, live: dict | None = None) -> str:
    if store.records("learner_stop"):
        return "finished"
    if live and live.get("received"):
        return "live"
    if store.last_update and time.time() - store.last_update < 60:
        return "running"
    return "waiting" if not store.revision else "idle"


def overview_html(store: RunStore, live: dict | None = None) -> str:
    m = store.metrics
    last = m.iloc[-1] if len(m) else pd.Series(dtype=object)
    start = store.records("learner_start")
    total = start[-1].get("total_steps") if start else store.config.get("train", {}).get("total_steps")
    eps = store.records("episode")
    cards = [("policy version", f'<span id="policy-version">{store.version}</span>'),
             ("steps logged", f'<span id="steps">{len(m)}</span>' + (f" / {esc(total)}" if total else "")),
             ("episodes/s", fmt(last.get("episodes_per_s"), 3)), ("tokens/s", fmt(last.get("tokens_per_s"), 4)),
             ("samples/s", fmt(last.get("samples_per_s"), 3)), ("reward (last step)", fmt(last.get("reward_mean"))),
             ("episodes logged", str(len(eps))), ("algorithm", esc(store.algorithm or "?")),
             ("run", f'<span id="run-status">{run_status(store, live)}</span>')]
    body = "".join(f'<div class="arl-card"><div class="k">{k}</div><div class="v">{v}</div></div>' for k, v in cards)
    extra = ""
    if live is not None:
        ago = f", last {time.time() - live['last']:.1f} s ago" if live.get("last") else ""
        extra = (f'<div class="k">live events from <code>{esc(live.get("address"))}</code>: '
                 f'{live.get("received", 0)} received{ago}{"; " + esc(live["error"]) if live.get("error") else ""}</div>')
    warn = ""
    if store.warnings:
        warn = note("Skipped records: " + "<br>".join(esc(w) for w in store.warnings[-3:]))
    return f'<div class="arl-cards" id="overview-cards">{body}</div>{extra}{warn}'


def actors_html(store: RunStore) -> str:
    df = store.actors()
    if df.empty:
        return note("No actor has reported its status yet.")
    if store.records("learner_stop"):
        df["status"] = "run ended"
    return "<b>Actors</b>" + html_table(df, "actors")


def overview_figure(store: RunStore) -> Figure:
    m = store.metrics
    fig, ax = _figure(8, cols=4)
    _curves(ax[0], m, ["reward_mean", "eval/accuracy"], "reward")
    _curves(ax[1], m, ["loss", "pg_loss"], "loss")
    _curves(ax[2], m, ["approx_kl", "kl"], "KL")
    _curves(ax[3], m, ["clipfrac", "dual_clip_frac"], "clip fraction")
    _curves(ax[4], m, ["ratio_mean", "ratio_min", "ratio_max", "is_weight_mean"], "importance ratio")
    _curves(ax[5], m, ["episodes_per_s", "samples_per_s"], "throughput (per s)")
    _curves(ax[6], m, ["tokens_per_s"], "tokens/s")
    counts = staleness_counts(store.episodes())
    ax[7].set_title("staleness of trained episodes", fontsize=10)
    if counts.empty:
        _empty(ax[7], "no episodes yet")
    else:
        ax[7].bar(counts.index.astype(str), counts.values, color="#8250df")
        ax[7].set_xlabel("learner version - policy version", fontsize=8)
        ax[7].tick_params(labelsize=8)
    return fig


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
        name = f"{d} ratio ({windows.iloc[0]})" if windows.nunique() == 1 else f"{d} ratio"
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
    dim_rows = pd.DataFrame({"dimension": dims, "ratio": [r[f"ratio:{d}"] for d in dims],
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
    ax[0].set_title(f"reliability, eval at version {last.get('version', last['step'])} "
                    f"(n={int(bins['count'].sum())}, ECE {fmt(last.get('ece'))})", fontsize=10)
    for x, n in zip(centers[filled], bins["count"][filled]):
        ax[0].text(x, 0.02, str(int(n)), ha="center", fontsize=7)
    ax[0].legend(fontsize=7)
    x = with_bins["version"] if "version" in with_bins else with_bins["step"]
    for col in ("ece", "brier", "accuracy"):
        if col in with_bins:
            ax[1].plot(x, with_bins[col].astype(float), marker="o", label=col)
    ax[1].set_title("calibration over evaluations", fontsize=10)
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
    fig, ax = _figure(5, cols=5)
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
