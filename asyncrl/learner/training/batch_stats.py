"""Per-step figures of a training batch that the learner logs beside the loss statistics:
response lengths, the share of groups with no learning signal, and the reward function's named
scores.

A GRPO group whose members all got the same reward has advantage 0 for every member (``A = R -
mean``), so it contributes no gradient (DAPO, Yu et al. 2025, "dynamic sampling"); the share of
such groups is how much of the batch was spent for nothing.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ...objectives.advantages import one_per_rollout
from ...types import Episode

SAME_REWARD_TOL = 1e-9


def batch_metrics(episodes: list[Episode]) -> dict[str, float]:
    """``response_length_mean`` / ``_max`` (generated tokens per trajectory, all trajectories of the
    batch), ``groups/identical_reward_share`` and ``groups/count`` (groups of two or more fresh
    trajectories sharing a ``group_id``; groups that carry their own advantages, e.g. RLCR, count
    too: they are judged by reward), and ``score/<name>``: the mean of each named score of the
    fresh trajectories (the reward function's dict, ``reward`` itself left out)."""
    trajs = [t for ep in episodes for t in ep.trajectories]
    out: dict[str, float] = {}
    if trajs:
        lengths = [t.num_generated for t in trajs]
        out.update(response_length_mean=float(np.mean(lengths)), response_length_max=float(max(lengths)))
    fresh = [t for t in trajs if not t.is_replay]
    groups: dict[str, list[float]] = defaultdict(list)
    for t in one_per_rollout(fresh):  # a rollout of several rows (an agent's) is one member
        groups[t.group_id].append(float(t.reward))
    sized = [r for g, r in groups.items() if g and len(r) >= 2]
    if sized:
        out["groups/count"] = float(len(sized))
        out["groups/identical_reward_share"] = float(np.mean([max(r) - min(r) <= SAME_REWARD_TOL for r in sized]))
    scores: dict[str, list[float]] = defaultdict(list)
    for t in fresh:
        for name, value in (t.scores or {}).items():
            if name != "reward" and isinstance(value, (int, float)) and not isinstance(value, bool):
                scores[name].append(float(value))
    out.update({f"score/{name}": float(np.mean(v)) for name, v in sorted(scores.items())})
    return out
