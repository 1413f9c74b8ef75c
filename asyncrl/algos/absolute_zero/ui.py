"""Absolute Zero's tab in ``asyncrl ui``: "Proposed tasks" (question groups per seed prompt, every
proposed question with its learnability decision per dimension, a question's solver responses).
Loaded by the UI only (``AbsoluteZeroWorkflow.views``)."""

from __future__ import annotations

import pandas as pd

from asyncrl.analysis import RunStore
from asyncrl.app.kit import AlgorithmView, esc, fmt, html_table, note

MAX_QUESTION_ROWS = 400
STATUS_FILTERS = ["all", "learnable", "not learnable", "invalid", "sampled"]


def azr_groups_html(store: RunStore, limit: int = 30) -> str:
    g = store.table("azr_groups")
    if g.empty:
        return note("No Absolute Zero episodes logged yet.")
    g = g.tail(limit).iloc[::-1]
    view = pd.DataFrame(
        {
            "step": g["step"],
            "seed prompt": g["seed_prompt"],
            "attempts": g["attempts"],
            "reproposed": g["repropose_attempts"],
            "final status": g["final_status"],
            "learnable": [f"{a}/{b}" for a, b in zip(g["num_learnable"], g["num_questions"])],
            "invalid": g["num_invalid"],
            "sampled question": g["sampled_question"].fillna("-"),
            "proposer reward (mean)": g["proposer_reward_mean"],
        }
    )
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
        hay = q["question"].fillna("") + " " + q["proposal"].fillna("") + " " + q["seed_prompt"].fillna("")
        q = q[hay.str.lower().str.contains(s, regex=False)]
    return q.iloc[::-1].head(MAX_QUESTION_ROWS)  # newest first


def questions_table(q: pd.DataFrame) -> tuple[pd.DataFrame, list[tuple]]:
    """Display table of filtered questions and the row keys ``(episode_id, attempt, index)``."""
    dims = _dims(q)
    cols = (
        ["step", "seed prompt", "attempt", "q", "question", "answer", "valid"]
        + [f"{d} ratio" for d in dims]
        + ["learnable", "sampled", "reproposed", "proposer reward", "solve rate"]
    )
    if q.empty:
        return pd.DataFrame(columns=cols), []
    out = pd.DataFrame(
        {
            "step": q["step"].astype(int),
            "seed prompt": q["seed_prompt"],
            "attempt": q["attempt"].astype(int),
            "q": q["index"].astype(int),
            "question": [x if v else f"(invalid) {p}" for x, v, p in zip(q["question"], q["valid"], q["proposal"])],
            "answer": q["answer"].fillna(""),
            "valid": q["valid"].map({True: "yes", False: "no"}),
        }
    )
    for d in dims:
        windows = q[f"window:{d}"].dropna()
        name = ratio_header(q, d)
        out[name] = [
            f"{fmt(r, 2)} {'pass' if p else 'FAIL'}" + ("" if windows.nunique() == 1 else f" ({w})")
            for r, p, w in zip(q[f"ratio:{d}"], q[f"passed:{d}"], q[f"window:{d}"])
        ]
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
    q = store.table("azr_questions")
    sel = q[(q["episode_id"] == key[0]) & (q["attempt"] == key[1]) & (q["index"] == key[2])]
    if sel.empty:
        return note("That question is no longer in the view.")
    r = sel.iloc[0]
    dims = _dims(q)
    head = (
        f"<b>Step {int(r['step'])}, prompt <code>{esc(r['seed_prompt'])}</code>, attempt {int(r['attempt'])}, "
        f"question {int(r['index'])}</b><br>proposal <code>{esc(r['proposal'])}</code> -> question "
        f"<code>{esc(r['question'])}</code> answer <code>{esc(r['answer'])}</code>; "
        f"{'<span class=arl-ok>learnable</span>' if r['learnable'] else '<span class=arl-bad>not learnable</span>'}"
        f"{', sampled for training' if r['sampled'] else ''}"
    )
    if not r["valid"]:
        return f'<div id="question-detail">{head}<br>invalid: {esc(r["reason"])}</div>'
    dim_rows = pd.DataFrame(
        {
            "dimension": dims,
            "share of responses": [r[f"ratio:{d}"] for d in dims],
            "counts": [_counted(r[f"window:{d}"], d) for d in dims],
            "window": [r[f"window:{d}"] for d in dims],
            "passed": ["yes" if r[f"passed:{d}"] else "no" for d in dims],
        }
    )
    resp = pd.DataFrame(
        {
            "#": range(len(r["responses"])),
            "response": r["responses"],
            "reward": list(r["rewards"]) + [None] * (len(r["responses"]) - len(r["rewards"])),
        }
    )
    errors = f"<br>scoring errors: {esc('; '.join(r['score_errors']))}" if r["score_errors"] else ""
    return (
        f'<div id="question-detail">{head}{html_table(dim_rows)}<b>Solver responses</b>'
        f"{html_table(resp, 'solver-responses')}{errors}</div>"
    )


class ProposedTasksView(AlgorithmView):
    id, title = "tasks", "Proposed tasks"
    algorithm, algorithm_title, missing = "absolute_zero", "Absolute Zero", "no proposed tasks"
    css = (
        "#azr-questions th,#azr-questions th *{word-break:keep-all!important;overflow-wrap:normal!important;"
        "hyphens:none!important}"
    )

    def build(self, gr, empty: RunStore) -> None:
        self.groups = gr.HTML(elem_id="azr-groups-view")
        with gr.Row():
            status = gr.Dropdown(STATUS_FILTERS, value="all", label="questions")
            final = gr.Checkbox(True, label="final attempt of each prompt only")
            search = gr.Textbox(label="search (question, proposal, seed prompt)")
        self.table = gr.Dataframe(
            interactive=False,
            wrap=True,
            elem_id="azr-questions",
            label="Proposed questions (newest first); click one for its responses",
        )
        self.detail = gr.HTML(question_detail_html(empty, None), elem_id="azr-detail")
        self.keys = gr.State([])
        self.inputs = [status, final, search]
        self.outputs = [self.groups, self.table, self.keys]

    def render(self, store: RunStore, status, final_only, search) -> list:
        q = filter_questions(store.table("azr_questions"), status or "all", bool(final_only), search or "")
        table, keys = questions_table(q)
        return [azr_groups_html(store), table, keys]

    def wire(self, gr, main_store, runs) -> None:
        def on_select(keys, evt: gr.SelectData, sel=None):
            row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
            key = tuple(keys[row]) if keys and row is not None and 0 <= row < len(keys) else None
            return question_detail_html(main_store(sel), key)

        self.table.select(on_select, inputs=[self.keys, runs], outputs=[self.detail])
