"""Absolute Zero's tables from a run's ``episode`` events (read by ``asyncrl.analysis.RunStore``,
the UI and the notebooks): one row per question group, one per proposed question."""

from __future__ import annotations

import numpy as np
import pandas as pd


def _azr(e: dict) -> dict | None:
    d = e.get("decision") or {}
    return d if d.get("algorithm") == "absolute_zero" else None


def azr_groups_frame(episodes: list[dict]) -> pd.DataFrame:
    """Absolute Zero: one row per seed prompt (episode): its final question group."""
    rows = []
    for e in episodes:
        d = _azr(e)
        if d is None:
            continue
        final = (d.get("attempts") or [{}])[-1]
        qs = final.get("questions") or []
        sampled = d.get("sampled_index", -1)
        rows.append(
            {
                "step": e.get("step"),
                "episode_id": e.get("episode_id"),
                "seed_prompt": d.get("seed_prompt"),
                "policy_version": d.get("policy_version"),
                "attempts": len(d.get("attempts") or []),
                "repropose_attempts": d.get("repropose_attempts", 0),
                "final_status": d.get("final_status"),
                "kept": bool(d.get("kept")),
                "num_questions": len(qs),
                "num_learnable": sum(bool(q.get("learnable")) for q in qs),
                "num_invalid": sum(not q.get("valid") for q in qs),
                "sampled_index": sampled,
                "sampled_question": qs[sampled].get("question") if 0 <= sampled < len(qs) else None,
                "proposer_reward_mean": float(np.mean(d["proposer_rewards"])) if d.get("proposer_rewards") else np.nan,
            }
        )
    return pd.DataFrame(rows, columns=None if rows else ["step", "episode_id", "seed_prompt", "final_status", "kept"])


def azr_questions_frame(episodes: list[dict]) -> pd.DataFrame:
    """Absolute Zero: one row per proposed question of every attempt, with per-dimension
    ``ratio:<dim>`` / ``passed:<dim>`` and the dimension's window ``window:<dim>``.

    ``final`` marks the attempt that counted; ``sampled`` the question whose responses were
    trained; ``proposer_reward`` is set on the final attempt's questions; ``difficulty`` is
    ``1 - solve_rate`` (NaN for an invalid question)."""
    rows = []
    for e in episodes:
        d = _azr(e)
        if d is None:
            continue
        dims = {x["name"]: x for x in d.get("dimensions") or []}
        attempts = d.get("attempts") or []
        rewards = d.get("proposer_rewards") or []
        for a in attempts:
            final = a is attempts[-1]
            for q in a.get("questions") or []:
                idx = q.get("index", 0)
                row = {
                    "step": e.get("step"),
                    "episode_id": e.get("episode_id"),
                    "seed_prompt": d.get("seed_prompt"),
                    "attempt": a.get("attempt"),
                    "final": final,
                    "group_status": a.get("status"),
                    "repropose_attempts": d.get("repropose_attempts", 0),
                    "index": idx,
                    "proposal": q.get("proposal"),
                    "valid": bool(q.get("valid")),
                    "reason": q.get("reason"),
                    "question": q.get("question"),
                    "answer": q.get("answer"),
                    "learnable": bool(q.get("learnable")),
                    "sampled": final and idx == a.get("sampled_index", -1) and idx >= 0,
                    "proposer_reward": rewards[idx] if final and idx < len(rewards) else np.nan,
                    "solve_rate": q.get("solve_rate") if q.get("solve_rate") is not None else np.nan,
                    "num_responses": len(q.get("responses") or []),
                    "responses": list(q.get("responses") or []),
                    "rewards": list(q.get("rewards") or []),
                    "score_errors": list(q.get("score_errors") or []),
                }
                row["difficulty"] = 1.0 - row["solve_rate"] if row["valid"] else np.nan
                for name, dim in dims.items():
                    row[f"ratio:{name}"] = (q.get("ratios") or {}).get(name, np.nan)
                    row[f"passed:{name}"] = (q.get("passed") or {}).get(name)
                    row[f"window:{name}"] = (
                        f"{'>' if dim.get('direction') == 'above' else '<'}"
                        f"{dim.get('threshold')} in [{dim.get('min_ratio')}, {dim.get('max_ratio')}]"
                    )
                rows.append(row)
    return pd.DataFrame(
        rows,
        columns=None
        if rows
        else [
            "step",
            "episode_id",
            "seed_prompt",
            "attempt",
            "final",
            "index",
            "question",
            "valid",
            "learnable",
            "sampled",
        ],
    )
