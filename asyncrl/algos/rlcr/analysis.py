"""RLCR's table from a run's ``episode`` events (read by ``asyncrl.analysis.RunStore``, the UI and
the notebooks): one row per confidence node of the answer -> confidence trees."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...types import prompt_text


def _span(node: dict) -> float:
    """Generated tokens of a tree node: the length of its trained span (NaN when it has none)."""
    span = node.get("mask_span")
    return float(span[1] - span[0]) if span else np.nan


def rlcr_nodes_frame(episodes: list[dict]) -> pd.DataFrame:
    """RLCR: one row per confidence node (prompt -> answer k -> confidence h); an answer without
    confidences gets one row with ``h`` NaN. ``correct`` is the answer's ``acc_reward``; ``brier_reward``
    the confidence's reward ``1 - (correct - confidence)^2``; ``answer_tokens`` and ``confidence_tokens``
    the generated (trained) tokens of each turn."""
    rows = []
    for e in episodes:
        d = e.get("decision") or {}
        if d.get("kind") != "rlcr_tree":
            continue
        base = {
            "step": e.get("step"),
            "episode_id": e.get("episode_id"),
            "prompt": prompt_text(e.get("prompt")),
            "gold": d.get("gold"),
            "policy_version": e.get("policy_version"),
        }
        for a in d.get("answers") or []:
            ans = {
                **base,
                "k": a.get("k"),
                "answer_text": a.get("text"),
                "answer": a.get("answer"),
                "answer_format_ok": bool(a.get("format_ok")),
                "correct": a.get("acc_reward"),
                "answer_advantage": a.get("advantage"),
                "answer_tokens": _span(a),
            }
            confs = a.get("confidences") or []
            if not confs:
                rows.append({**ans, "h": np.nan})
            for c in confs:
                rows.append(
                    {
                        **ans,
                        "h": c.get("h"),
                        "confidence_text": c.get("text"),
                        "confidence": c.get("confidence") if c.get("confidence") is not None else np.nan,
                        "confidence_format_ok": bool(c.get("format_ok")),
                        "brier_reward": c.get("conf_reward"),
                        "confidence_advantage": c.get("advantage"),
                        "confidence_tokens": _span(c),
                    }
                )
    return pd.DataFrame(
        rows,
        columns=None
        if rows
        else [
            "step",
            "episode_id",
            "prompt",
            "k",
            "correct",
            "h",
            "confidence",
            "brier_reward",
            "answer_tokens",
            "confidence_tokens",
        ],
    )
