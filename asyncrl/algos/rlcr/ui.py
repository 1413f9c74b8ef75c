"""RLCR's tab in ``asyncrl ui``: "Confidence trees" (the reliability diagram and calibration over
evaluations, and the latest answer -> confidence trees). Loaded by the UI only
(``RLCRWorkflow.views``)."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from asyncrl.analysis import NA, RunStore, calibration_summary, reliability_frame
from asyncrl.app.kit import AlgorithmView, empty_axes, esc, figure, fmt, note


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
        parts = [
            f'<details class="arl-tree rlcr-tree"{is_open}><summary>step {e.get("step")} · prompt '
            f"<code>{esc(prompt)}</code> · gold <code>{esc(d.get('gold'))}</code> · accuracy {fmt(acc, 2)} · "
            f"mean Brier reward {fmt(np.mean(briers) if briers else float('nan'), 3)}</summary>"
        ]
        for a in answers:
            parts.append(
                f'<details class="rlcr-answer"{is_open}><summary>answer {a.get("k")}: '
                f"<code>{esc(a.get('answer'))}</code> "
                f"{_mark(bool(a.get('acc_reward')), 'correct', 'wrong')} · acc reward {fmt(a.get('acc_reward'))}"
                f" · advantage {fmt(a.get('advantage'))}"
                f"{'' if a.get('format_ok') else ' · format: ' + esc(a.get('reason'))}</summary>"
                f'<div class="arl-mono">{esc(a.get("text"))}</div><ul>'
            )
            for c in a.get("confidences") or []:
                conf = c.get("confidence")
                parts.append(
                    f'<li class="rlcr-confidence">confidence {c.get("h")}: <b>{fmt(conf, 2)}</b> · Brier '
                    f"reward {fmt(c.get('conf_reward'))} · advantage {fmt(c.get('advantage'))}"
                    f"{'' if c.get('format_ok') else ' · ' + esc(c.get('reason'))}"
                    f' <span class="arl-mono">{esc(c.get("text"))}</span></li>'
                )
            parts.append("</ul></details>")
        parts.append("</details>")
        out.append("".join(parts))
    return "".join(out)


def calibration_figure(store: RunStore) -> Figure:
    ev = store.evals()
    fig, ax = figure(2, cols=2, height=3.2)
    with_bins = ev[ev["reliability"].notna()] if "reliability" in ev else ev.iloc[0:0]
    if with_bins.empty:
        empty_axes(ax[0], "no evaluation with reliability bins yet")
        empty_axes(ax[1], "no evaluation yet")
        return fig
    last = with_bins.iloc[-1]
    bins = reliability_frame(last.to_dict())
    centers = (bins["lo"] + bins["hi"]) / 2
    filled = bins["count"] > 0
    ax[0].bar(
        centers[filled],
        bins["accuracy"][filled].astype(float),
        width=bins["hi"][0] - bins["lo"][0],
        edgecolor="black",
        color="#54aeff",
        label="accuracy",
    )
    ax[0].plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    ax[0].set_xlim(0, 1)
    ax[0].set_ylim(0, 1)
    ax[0].set_xlabel("stated confidence", fontsize=8)
    ax[0].set_ylabel("accuracy", fontsize=8)
    cs = calibration_summary(last.to_dict())
    ece, brier = (NA if cs[k] is None else fmt(cs[k]) for k in ("ece", "brier"))
    ax[0].set_title(
        f"reliability, eval at version {last.get('version', last['step'])}: ECE {ece}, "
        f"Brier {brier}\n({cs['parsed']} of {cs['size']} confidences parsed; "
        f"unparsed count as 0)",
        fontsize=9,
    )
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


class ConfidenceTreesView(AlgorithmView):
    id, title = "trees", "Confidence trees"
    algorithm, algorithm_title, missing = "rlcr", "RLCR", "no confidence trees"

    def build(self, gr, empty: RunStore) -> None:
        plot = gr.Plot(show_label=False, format="png", elem_id="calibration-plot")
        with gr.Row():
            limit = gr.Slider(1, 100, value=10, step=1, label="trees shown")
            search = gr.Textbox(label="search prompts")
        trees = gr.HTML(elem_id="rlcr-trees")
        self.inputs, self.outputs = [limit, search], [plot, trees]

    def render(self, store: RunStore, limit, search) -> list:
        return [calibration_figure(store), trees_html(store, int(limit or 10), search or "")]
