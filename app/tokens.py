"""The Tokens tab of ``asyncrl ui`` (issue 67): one traced row of a logged step (a ``token_trace``
event, :mod:`asyncrl.learner.trace`), every token coloured by how many versions old the policy that
generated it was at that step (an in-flight update mixes versions within a row), with what the loss
saw on it: the behaviour and the learner's log-prob, the importance weight and ratio, whether the
correction capped or masked it, whether the loss clipped it or the trust region blocked it, and the
advantage. Hover a token for its numbers; the table under the row has them for every trained token.
Prompt and environment tokens (a multi-turn agent's tool output) are shown as such."""

from __future__ import annotations

import pandas as pd

from asyncrl.analysis import RunStore

from .kit import esc, fmt, html_table, note

MAX_CHOICES = 400  # rows offered in the picker (the newest traced steps first)
LAG_COLOURS = ("#aceebb", "#dcf5a6", "#fff1a8", "#ffd8b5", "#ffb3b3")  # lag 0, 1, 2, 3, 4 or more
ROLE_COLOURS = {"prompt": "#eaeef2", "environment": "#cfe2ff", "replayed": "#e0d4ff"}
LABELS = {  # a sample type that names an algorithm's role or level
    "proposer": "Absolute Zero proposer",
    "solver": "Absolute Zero solver",
    "answer": "RLCR answer level",
    "confidence": "RLCR confidence level",
}
CSS = """
.arl-tok.clipped{outline:2px solid #cf222e;outline-offset:-1px}
.arl-tok.out{text-decoration:line-through;text-decoration-thickness:2px}
.arl-tok.capped{border-bottom:3px dotted #9a6700}
#token-trace-table td{white-space:nowrap}
"""


def traces(store: RunStore) -> list[dict]:
    return [t for t in store.records("token_trace") if t.get("rows")]


def has_traces(store: RunStore) -> bool:
    return bool(traces(store))


def _label(row: dict) -> str:
    kind = row.get("sample_type") or "policy"
    return LABELS.get(kind, kind)


def _versions(row: dict) -> str:
    lo, hi = row.get("oldest_version"), row.get("newest_version")
    return f"v{lo}" if lo == hi else f"v{lo}-{hi}"


def choices(store: RunStore) -> list[tuple[str, str]]:
    """``(label, "step:row")`` for every traced row, the newest step first."""
    out = []
    for t in reversed(traces(store)):
        rows = t["rows"]
        for i, r in enumerate(rows):
            out.append(
                (
                    f"step {t.get('step')} · row {i + 1}/{len(rows)} · {_label(r)} · reward {fmt(r.get('reward'))}"
                    f" · advantage {fmt(r.get('advantage'))} · {_versions(r)}",
                    f"{t.get('step')}:{i}",
                )
            )
            if len(out) >= MAX_CHOICES:
                return out
    return out


def _find(store: RunStore, choice: str | None) -> tuple[int, int, dict, int] | None:
    """``(step, row index, row, rows in the step)`` of ``choice`` (None or not found: the newest first row)."""
    found = traces(store)
    if not found:
        return None
    by_step = {t.get("step"): t for t in found}
    try:
        step, i = (int(x) for x in str(choice).split(":"))
        rows = by_step[step]["rows"]
        return step, i, rows[i], len(rows)
    except (ValueError, KeyError, IndexError):
        t = found[-1]
        return t.get("step"), 0, t["rows"][0], len(t["rows"])


def _colour(role: str, lag: int | None) -> str:
    if role in ROLE_COLOURS:
        return ROLE_COLOURS[role]
    return LAG_COLOURS[min(max(lag or 0, 0), len(LAG_COLOURS) - 1)]


def _flags(row: dict, j: int) -> list[str]:
    said = []
    for key, words in (
        ("clipped", "clipped"),
        ("dual_clipped", "dual-clipped"),
        ("is_capped", "IS weight capped"),
        ("is_masked", "IS masked"),
        ("blocked", "blocked by the trust region"),
        ("dropped", "out of the loss (staleness bound or overlong)"),
    ):
        col = row.get(key) or []
        if j < len(col) and col[j]:
            said.append(words)
    return said


def _at(row: dict, key: str, j: int):
    col = row.get(key) or []
    return col[j] if j < len(col) else None


def tokens_html(store: RunStore, choice: str | None) -> str:
    found = _find(store, choice)
    if found is None:
        return note(
            "This run has no token traces (<code>token_trace</code> events): the learner writes one every "
            "<code>log.sample_every</code> steps for <code>log.trace_rows</code> rows of the batch (0 turns "
            "them off)."
        )
    step, i, row, n_rows = found
    learner_version = int(step) - 1  # (the policy the step trained: it made version ``step``)
    spans, table, lags = [], [], set()
    for j, tok in enumerate(row.get("tokens") or []):
        role = _at(row, "role", j) or "prompt"
        version = _at(row, "version", j)
        lag = None if version is None else learner_version - int(version)
        if lag is not None and role == "generated":
            lags.add((lag, version))
        flags = _flags(row, j)
        cls = "arl-tok" + (" clipped" if {"clipped", "dual-clipped"} & set(flags) else "")
        cls += " out" if any(f.startswith(("IS masked", "blocked", "out of")) for f in flags) else ""
        cls += " capped" if "IS weight capped" in flags else ""
        pos = j + int(row.get("offset") or 0)
        title = f"#{pos} {role}"
        if version is not None:
            b, lp = _at(row, "behaviour", j), _at(row, "learner", j)
            title += (
                f" · version {version} (lag {lag}) · behaviour logp {fmt(b)} · learner logp {fmt(lp)}"
                f" · IS weight {fmt(_at(row, 'weight', j))} · ratio {fmt(_at(row, 'ratio', j))}"
                f" · advantage {fmt(_at(row, 'token_advantage', j))}" + (f" · {', '.join(flags)}" if flags else "")
            )
            table.append(
                {
                    "pos": pos,
                    "token": tok,
                    "role": role,
                    "version": version,
                    "lag": lag,
                    "behaviour logp": b,
                    "learner logp": lp,
                    "learner - behaviour": None if b is None or lp is None else lp - b,
                    "IS weight": _at(row, "weight", j),
                    "ratio": _at(row, "ratio", j),
                    "advantage": _at(row, "token_advantage", j),
                    "flags": ", ".join(flags),
                }
            )
        shown = tok.replace("\n", "\u21b5\n") if tok else "\u2205"
        spans.append(
            f'<span class="{cls}" style="background:{_colour(role, lag)}" title="{esc(title)}" '
            f'data-role="{role}" data-version="{"" if version is None else version}">{esc(shown)}</span>'
        )
    return (
        f'<div id="token-trace">{_head(row, step, i, n_rows, table)}{_legend(lags, row)}'
        f'<div style="line-height:1.9">{"".join(spans)}</div>'
        f"{html_table(pd.DataFrame(table), 'token-trace-table') if table else ''}</div>"
    )


def _head(row: dict, step, i: int, n_rows: int, table: list[dict]) -> str:
    trained = [r for r in table if r["role"] == "generated"]
    counted = {
        name: sum(any(_at(row, k, j) for k in keys) for j in range(len(row.get("tokens") or [])))
        for name, keys in (
            ("clipped", ("clipped", "dual_clipped")),
            ("IS", ("is_capped", "is_masked")),
            ("blocked", ("blocked",)),
            ("out of the loss", ("dropped",)),
        )
    }
    weights = [r["IS weight"] for r in trained if r["IS weight"] is not None]
    return (
        f"<b>Step {esc(step)}, traced row {i + 1} of {n_rows}: {esc(_label(row))} trajectory of episode "
        f"<code>{esc(row.get('episode_id'))}</code></b> ({esc(row.get('actor_id'))}, task "
        f"<code>{esc(row.get('task_id'))}</code>) · reward {fmt(row.get('reward'))} · advantage "
        f"{fmt(row.get('advantage'))} · generated by {_versions(row)}, trained by version {int(step) - 1} · "
        f"{row.get('num_tokens')} tokens"
        + (f" (showing the last {len(row.get('tokens') or [])})" if row.get("offset") else "")
        + (" · replayed" if row.get("is_replay") else "")
        + f'<div id="token-trace-summary">{len(trained)} trained token(s); '
        f"clipped {counted['clipped']}, IS capped or masked {counted['IS']}, blocked by the trust region "
        f"{counted['blocked']}, out of the loss {counted['out of the loss']}"
        + (f"; IS weight mean {fmt(sum(weights) / len(weights))}, min {fmt(min(weights))}" if weights else "")
        + "</div>"
    )


def _legend(lags: set, row: dict) -> str:
    items = [
        f'<span class="arl-tok" style="background:{_colour("generated", lag)}">version {v} (lag {lag})</span>'
        for lag, v in sorted(lags)
    ]
    roles = set(row.get("role") or [])
    items += [
        f'<span class="arl-tok" style="background:{ROLE_COLOURS[r]}">{r}</span>' for r in ROLE_COLOURS if r in roles
    ]
    items += [
        '<span class="arl-tok clipped" style="background:#fff">clipped</span>',
        '<span class="arl-tok capped" style="background:#fff">IS weight capped</span>',
        '<span class="arl-tok out" style="background:#fff">masked, blocked or out of the loss</span>',
    ]
    return f'<div id="token-legend" style="margin:6px 0">{" ".join(items)} · hover a token for its numbers</div>'
