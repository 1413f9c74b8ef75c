"""Records to DataFrames: metrics, events per kind, episodes, trajectories, evaluations, actors,
and calibration summaries. The algorithms' own tables are in ``asyncrl.algos.*.analysis``."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd

from ..types import SUMMARY_FIELDS, prompt_text


def metrics_frame(records: list[dict]) -> pd.DataFrame:
    if not records:
        return pd.DataFrame(columns=["step", "t", "version"]).set_index("step")
    df = pd.DataFrame.from_records(records)
    df = df.drop_duplicates("step", keep="last").sort_values("step").set_index("step", drop=False)
    df.index.name = None
    return df


def kind_frame(records: list[dict]) -> pd.DataFrame:
    if not records:
        return pd.DataFrame(columns=["schema", "kind", "t", "step"])
    return pd.DataFrame.from_records(records)


def events_frames(by_kind: dict[str, list[dict]]) -> dict[str, pd.DataFrame]:
    return {k: kind_frame(v) for k, v in sorted(by_kind.items())}


def episodes_frame(episodes: list[dict]) -> pd.DataFrame:
    """One row per logged episode."""
    rows = []
    for e in episodes:
        trajs = e.get("trajectories") or []
        learn = [t for t in trajs if t.get("sample_type") != "proposer"]
        d = e.get("decision") or {}
        rows.append(
            {
                "step": e.get("step"),
                "t": e.get("t"),
                "episode_id": e.get("episode_id"),
                "actor_id": e.get("actor_id"),
                "task_id": e.get("task_id"),
                "prompt": prompt_text(e.get("prompt")),
                "policy_version": e.get("policy_version"),
                "staleness": e.get("staleness"),
                "num_trajectories": len(trajs),
                "num_replay": sum(bool(t.get("is_replay")) for t in trajs),
                "reward_mean": float(np.mean([t.get("reward") or 0.0 for t in learn])) if learn else np.nan,
                "algorithm": d.get("algorithm"),
                **{f"m:{k}": v for k, v in (e.get("metrics") or {}).items()},
            }
        )
    return pd.DataFrame(rows, columns=None if rows else ["step", "episode_id", "policy_version", "staleness"])


def trajectories_frame(episodes: list[dict]) -> pd.DataFrame:
    """One row per trajectory of the logged episodes."""
    rows = []
    for e in episodes:
        for t in e.get("trajectories") or []:
            rows.append(
                {
                    "step": e.get("step"),
                    "episode_id": e.get("episode_id"),
                    "episode_policy_version": e.get("policy_version"),
                    **{k: v for k, v in t.items()},
                }
            )
    return pd.DataFrame(rows, columns=None if rows else ["step", "episode_id", *SUMMARY_FIELDS])


def evals_frame(evals: list[dict]) -> pd.DataFrame:
    if not evals:
        return pd.DataFrame(columns=["step", "version", "accuracy"])
    df = pd.DataFrame.from_records(evals)
    return df.sort_values("step", kind="stable").reset_index(drop=True)


def reliability_frame(eval_record: dict) -> pd.DataFrame:
    """The reliability bins of one ``eval`` record (RLCR): lo, hi, count, confidence, accuracy."""
    bins = eval_record.get("reliability")
    if not bins:
        raise ValueError("this eval record has no 'reliability' bins (not an RLCR run?)")
    return pd.DataFrame(bins)


def actors_frame(statuses: list[dict], learner_version: int, now: float | None = None) -> pd.DataFrame:
    """Latest status per actor: weights version in use, lag behind the learner, age of the status."""
    now = time.time() if now is None else now
    latest: dict[str, dict] = {}
    for s in statuses:
        latest[str(s.get("actor_id"))] = s
    rows = []
    for actor_id, s in sorted(latest.items()):
        version = s.get("version")
        age = now - float(s.get("t") or now)
        state = "stopping" if s.get("stopping") else ("silent" if age > 30 else "active")
        rows.append(
            {
                "actor_id": actor_id,
                "status": state,
                "weights_version": version,
                "lag": learner_version - version if isinstance(version, int) else None,
                "batches": s.get("batches"),
                "weight_updates": s.get("weight_updates"),
                "credits": s.get("credits"),
                "unacked": s.get("unacked"),
                "capacity": s.get("capacity"),
                "generate_s": s.get("generate_s"),
                "idle_share": (
                    round(1 - s["generate_s"] / s["up_s"], 3)
                    if s.get("up_s") and s.get("generate_s") is not None
                    else None
                ),
                "last_status_s_ago": round(age, 1),
            }
        )
    return pd.DataFrame(rows, columns=None if rows else ["actor_id", "status", "weights_version", "lag"])


def staleness_counts(episodes: pd.DataFrame) -> pd.Series:
    """Episodes by staleness (learner version at training minus the episode's policy version)."""
    if episodes.empty or "staleness" not in episodes:
        return pd.Series(dtype="int64")
    return episodes["staleness"].dropna().astype(int).value_counts().sort_index()


def calibration_summary(eval_record: dict) -> dict:
    """An RLCR ``eval`` record's calibration figures with how many confidences they rest on:
    ``parsed`` of ``size``; with no confidence parsed, ECE, Brier and AUROC are ``None`` (n/a: an
    unparsed confidence is scored as 0, so over zero parsed ones the figures would say nothing)."""
    size = int(eval_record.get("size") or 0)
    fail = eval_record.get("confidence_parse_fail")
    parsed = int(round(size * (1 - float(fail)))) if fail is not None and size else (size if fail is None else 0)
    out = {"size": size, "parsed": parsed, "accuracy": eval_record.get("accuracy")}
    for k in ("ece", "brier", "auroc", "confidence_mean"):
        v = eval_record.get(k)
        out[k] = None if parsed == 0 or v is None or (isinstance(v, float) and np.isnan(v)) else float(v)
    return out
