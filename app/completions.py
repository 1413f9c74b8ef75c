"""The Completions tab of ``asyncrl ui``: what the policy wrote. One training step's groups (each
prompt with every completion, its reward, the advantage it was trained with, its length, the policy
version that wrote it and its staleness), the held-out outputs of an evaluation next to the gold
answers, and a search over every logged step and evaluation. Every run has it (any algorithm)."""

from __future__ import annotations

import pandas as pd

from asyncrl.analysis import RunStore
from asyncrl.types import prompt_text

from .kit import AlgorithmView, esc, fmt, html_table, note

MAX_ROWS = 200  # a search shows at most this many rows (newest first)
MAX_HELDOUT_ROWS = 1000  # one evaluation's held-out outputs: all of them (log.eval_samples keeps up to 1000)
CSS = """
#completions-table td,#heldout-table td{max-width:520px}
.arl-completion{font-family:monospace;white-space:pre-wrap;word-break:break-word}
.arl-adv-pos{color:#1a7f37;font-weight:600}.arl-adv-neg{color:#cf222e;font-weight:600}
"""


def _adv(x) -> str:
    if x is None:
        return "-"
    cls = "arl-adv-pos" if x > 0 else "arl-adv-neg" if x < 0 else ""
    return f'<span class="{cls}">{fmt(x)}</span>'


def _match(query: str, *texts) -> bool:
    q = query.lower()
    return any(q in str(t).lower() for t in texts)


def training_rows(store: RunStore, step: int | None = None, query: str = "") -> tuple[int | None, pd.DataFrame]:
    """``(step shown, rows)``: one row per logged trajectory of ``step`` (None: the latest logged
    step); with ``query``, the trajectories of every logged step whose prompt or completion holds it
    (newest first, at most MAX_ROWS)."""
    episodes = store.records("episode")
    if not episodes:
        return None, pd.DataFrame()
    if not query:
        steps = logged_steps(store) or [None]
        step = step if step in steps else steps[-1]
        episodes = [e for e in episodes if e.get("step") == step]
    rows = []
    for e in reversed(episodes) if query else episodes:
        prompt = prompt_text(e.get("prompt"))
        for t in e.get("trajectories") or []:
            if query and not _match(query, prompt, t.get("text")):
                continue
            rows.append(
                {
                    "step": e.get("step"),
                    "prompt": prompt,
                    "completion": t.get("text") or "",
                    "reward": t.get("reward"),
                    "advantage": t.get("advantage"),
                    "tokens": t.get("num_generated"),
                    "policy version": t.get("policy_version"),
                    "staleness": e.get("staleness"),
                    "kind": t.get("sample_type") or "",
                    "replayed": bool(t.get("is_replay")),
                    "episode": e.get("episode_id"),
                }
            )
            if len(rows) >= MAX_ROWS:
                break
        if len(rows) >= MAX_ROWS:
            break
    return (None if query else step), pd.DataFrame(rows)


def logged_steps(store: RunStore) -> list[int]:
    """The training steps that have logged episodes, in order."""
    return sorted({e.get("step") for e in store.records("episode") if isinstance(e.get("step"), int)})


def neighbour_step(store: RunStore, step: int | None, direction: int) -> int:
    """The logged step before (``direction`` -1) or after (+1) the one shown for ``step`` (a step
    with no logged episodes, 0 or None shows the latest), kept within the logged steps; 0 when none."""
    steps = logged_steps(store)
    if not steps:
        return 0
    i = steps.index(step) if step in steps else len(steps) - 1
    return steps[min(max(i + direction, 0), len(steps) - 1)]


def training_html(store: RunStore, step: int | None = None, query: str = "") -> str:
    shown, df = training_rows(store, step, query)
    if shown is None and df.empty:
        if not store.records("episode"):
            mode = (store.config.get("log") or {}).get("episode_events", "all")
            return note(
                "No episode events logged yet"
                + (" (log.episode_events=none)" if mode == "none" else "")
                + ": completions appear with the first trained step."
            )
        return note(f"No logged completion holds <code>{esc(query)}</code>.")
    out = df.copy()
    first = out["episode"].ne(out["episode"].shift())  # the prompt once per group
    out["prompt"] = [f'<span class="arl-completion">{esc(p)}</span>' if f else "" for p, f in zip(out["prompt"], first)]
    out["completion"] = [f'<span class="arl-completion">{esc(c)}</span>' for c in out["completion"]]
    out["advantage"] = [_adv(a) for a in out["advantage"]]
    out["replayed"] = ["replayed" if r else "" for r in out["replayed"]]
    out = out.drop(columns=["episode"])
    groups = int(first.sum())
    log = store.config.get("log") or {}
    logged = (
        f"; episode events are sampled: every {log.get('episode_events_every', 10)}th episode without a "
        f"decision is logged"
        if log.get("episode_events") == "sampled"
        else ""
    )
    steps = logged_steps(store)
    where = (
        f" · logged step {steps.index(shown) + 1} of {len(steps)} ({steps[0]} to {steps[-1]}; "
        f"earlier/later step to browse)"
        if shown in steps
        else ""
    )
    head = (
        f"<b>Step {shown}: {groups} group(s), {len(df)} completion(s)</b>{where} (the advantage is the one "
        f"each was trained with; staleness: learner version - the version that wrote it{logged})"
        if shown is not None
        else f"<b>{len(df)} logged completion(s) holding <code>{esc(query)}</code></b>"
        f"{' (the newest ' + str(MAX_ROWS) + ')' if len(df) >= MAX_ROWS else ''}"
    )
    return head + html_table(out, "completions-table", raw_cols=("prompt", "completion", "advantage"))


def heldout_rows(store: RunStore, step: int | None = None, query: str = "") -> tuple[int | None, pd.DataFrame]:
    """``(version, rows)`` of the held-out outputs of the latest evaluation at or before ``step``
    (None: the latest); with ``query``, of every evaluation (newest first)."""
    evals = [e for e in store.records("eval") if e.get("samples")]
    if not evals:
        return None, pd.DataFrame()
    if not query:
        before = [e for e in evals if step is None or (e.get("version") or 0) <= step] or evals[:1]
        evals = before[-1:]
    rows = []
    for e in reversed(evals):
        for s in e["samples"]:
            if query and not _match(query, s.get("prompt"), s.get("completion")):
                continue
            rows.append(
                {
                    "version": e.get("version"),
                    "prompt": s.get("prompt") or "",
                    "completion": s.get("completion") or "",
                    "gold": s.get("answer"),
                    "reward": s.get("reward"),
                    "correct": bool(s.get("correct")),
                }
            )
    return (None if query else evals[-1].get("version")), pd.DataFrame(rows[: MAX_ROWS if query else MAX_HELDOUT_ROWS])


def heldout_html(store: RunStore, step: int | None = None, query: str = "") -> str:
    version, df = heldout_rows(store, step, query)
    if df.empty:
        if version is None and not query:
            return note(
                "No held-out outputs logged yet (each evaluation keeps <code>log.eval_samples</code> of "
                "them; an algorithm with its own evaluation shows its outputs in its own tab)."
            )
        return note(f"No held-out output holds <code>{esc(query)}</code>.")
    out = df.copy()
    out["completion"] = [f'<span class="arl-completion">{esc(c)}</span>' for c in out["completion"]]
    out["correct"] = [
        '<span class="arl-ok">correct</span>' if c else '<span class="arl-bad">wrong</span>' for c in out["correct"]
    ]
    out["gold"] = [esc(g) for g in out["gold"]]
    acc = df["correct"].mean()
    head = (
        f"<b>Held-out outputs at policy version {version}</b> ({len(df)} shown, {fmt(acc, 2)} of them correct)"
        if version is not None
        else f"<b>{len(df)} held-out output(s) holding <code>{esc(query)}</code></b>"
    )
    return head + html_table(out, "heldout-table", raw_cols=("completion", "correct", "gold"))


class CompletionsView(AlgorithmView):
    id = "completions"
    title = "Completions"
    css = CSS

    def build(self, gr, empty: RunStore) -> None:
        with gr.Row():
            self.earlier = gr.Button("\u25c0 earlier step", scale=0, min_width=120, elem_id="completions-earlier")
            step = gr.Number(
                value=0, precision=0, label="training step (0: the latest logged)", scale=1, elem_id="completions-step"
            )
            self.later = gr.Button("later step \u25b6", scale=0, min_width=120, elem_id="completions-later")
            search = gr.Textbox(
                label="search prompts and completions (every logged step and evaluation)",
                scale=3,
                elem_id="completions-search",
            )
        train = gr.HTML(elem_id="completions-view")
        held = gr.HTML(elem_id="heldout-view")
        self.inputs, self.outputs = [step, search], [train, held]

    def render(self, store: RunStore, step=None, search="") -> list:
        step = int(step) if step else None  # 0 or empty: the latest
        query = (search or "").strip()
        return [training_html(store, step, query), heldout_html(store, step, query)]

    def applies(self, store: RunStore) -> bool:
        return True

    def wire(self, gr, main_store, runs) -> None:
        step = self.inputs[0]
        for button, direction in ((self.earlier, -1), (self.later, 1)):
            button.click(
                lambda pick, s, d=direction: neighbour_step(main_store(pick), int(s) if s else None, d),
                inputs=[runs, step],
                outputs=[step],
                show_progress="hidden",
            )
