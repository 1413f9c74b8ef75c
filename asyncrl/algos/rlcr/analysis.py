"""RLCR's table from a run's ``episode`` events (read by ``asyncrl.analysis.RunStore``, the UI and
the notebooks): one row per confidence node of the answer -> confidence trees."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...analysis.records import prompt_text


def rlcr_nodes_frame(episodes: list[dict]) -> pd.DataFrame:
    """RLCR: one row per confidence node (prompt -> answer k -> confidence h); an answer without
    confidences gets one row with ``h`` NaN. ``correct`` is the answer's ``acc_reward``; ``brier_reward``
    the confidence's reward ``1 - (correct - confidence)^2``."""
    rows = []
    for e in episodes:
        d = e.get("decision") or {}
        if d.get("kind") != "rlcr_tree":
            continue
        base = {"step": e.get("step"), "episode_id": e.get("episode_id"), "prompt": prompt_text(e.get("prompt")),
                "gold": d.get("gold"), "policy_version": e.get("policy_version")}
        for a in d.get("answers") or []:
            ans = {**base, "k": a.get("k"), "answer_text": a.get("text"), "answer": a.get("answer"),
                   "answer_format_ok": bool(a.get("format_ok")), "correct": a.get("acc_reward"),
                   "answer_advantage": a.get("advantage")}
            confs = a.get("confidences") or []
            if not confs:
                rows.append({**ans, "h": np.nan})
            for c in confs:
                rows.append({**ans, "h": c.get("h"), "confidence_text": c.get("text"),
                             "confidence": c.get("confidence") if c.get("confidence") is not None else np.nan,
                             "confidence_format_ok": bool(c.get("format_ok")), "brier_reward": c.get("conf_reward"),
                             "confidence_advantage": c.get("advantage")})
    return pd.DataFrame(rows, columns=None if rows else ["step", "episode_id", "prompt", "k", "correct", "h",
                                                          "confidence", "brier_reward"])

