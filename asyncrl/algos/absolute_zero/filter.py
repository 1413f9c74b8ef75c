"""Absolute Zero's unified reward and learnability filter (the reference design's
``_compute_unified_reward_and_filter``, docs/algorithms/absolute_zero.md), as pure functions over score tables.

Shapes: a *question* has ``n`` responses, each a dict of named scores; a *group* is the ``k``
questions one seed prompt produced. Learnability of a question is one check per
:class:`Dimension`: the ratio of responses whose score is strictly above (or below) the threshold
must lie in ``[min_ratio, max_ratio]`` (inclusive). A group is *mixed* when some but not all of its
questions are learnable; only a mixed group can be sampled, otherwise it is re-proposed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal, Sequence

Scores = dict[str, float]
MIXED, ALL_LEARNABLE, NONE_LEARNABLE = "mixed", "all_learnable", "all_not_learnable"
RATIO_EPS = 1e-9  # ratios are k/n; keep 3/10 inside [0.3, 0.7] whatever the float rounding


@dataclass(frozen=True)
class Dimension:
    """One learnability check: ``#(score above|below threshold) / n in [min_ratio, max_ratio]``."""

    name: str
    score: str  # which named score of a response
    threshold: float
    direction: Literal["above", "below"]
    min_ratio: float
    max_ratio: float

    def ratio(self, responses: Sequence[Scores]) -> float:
        """Fraction of responses counted by this dimension (strict comparison with the threshold)."""
        if not responses:
            return 0.0
        values = [float(r.get(self.score, 0.0)) for r in responses]
        if self.direction == "above":
            hits = sum(v > self.threshold for v in values)
        else:
            hits = sum(v < self.threshold for v in values)
        return hits / len(values)

    def passes(self, ratio: float) -> bool:
        return self.min_ratio - RATIO_EPS <= ratio <= self.max_ratio + RATIO_EPS


# The reference design's two dimensions and their defaults (docs/algorithms/absolute_zero.md).
SEED_DIMENSIONS = (
    Dimension("safety", "safety", 0.5, "above", 0.3, 0.7),  # safe_ratio = #(safety > 0.5) / n
    Dimension("completion", "completion", 0.5, "below", 0.3, 0.7),  # incomplete_ratio
)


@dataclass
class Learnability:
    learnable: bool
    ratios: dict[str, float] = field(default_factory=dict)
    passed: dict[str, bool] = field(default_factory=dict)


def check_learnability(responses: Sequence[Scores], dims: Sequence[Dimension]) -> Learnability:
    """Learnable iff every dimension passes (``_check_learnability``). No responses: not learnable."""
    ratios = {d.name: d.ratio(responses) for d in dims}
    passed = {d.name: d.passes(ratios[d.name]) for d in dims}
    return Learnability(bool(responses) and all(passed.values()), ratios, passed)


def group_status(learnable: Sequence[bool]) -> str:
    """``mixed``, ``all_learnable`` (all_not_skip) or ``all_not_learnable`` (all_skip)."""
    if learnable and all(learnable):
        return ALL_LEARNABLE
    if not any(learnable):
        return NONE_LEARNABLE
    return MIXED


def sample_question(learnable: Sequence[bool], rng: random.Random) -> int:
    """Index of one learnable question drawn uniformly, or -1 when the group is not mixed
    (it must be re-proposed)."""
    if group_status(learnable) != MIXED:
        return -1
    return rng.choice([i for i, ok in enumerate(learnable) if ok])


@dataclass(frozen=True)
class RewardWeights:
    safety: float = 0.7  # safety_reward_weight
    completion: float = 0.3  # task_completion_weight
    format: float = 0.5  # format reward weight


def solver_reward(scores: Scores, w: RewardWeights) -> float:
    """``w.safety * safety + w.completion * completion + w.format * format`` (the reference design:
    harm reward plus 0.5 x format reward)."""
    return (
        w.safety * float(scores.get("safety", 0.0))
        + w.completion * float(scores.get("completion", 0.0))
        + w.format * float(scores.get("format", 0.0))
    )


LEARNABLE_REWARD, NOT_LEARNABLE_REWARD, REPROPOSE_PENALTY = 1.0, 0.0, -0.5


def proposer_rewards(learnable: Sequence[bool], never_mixed: bool) -> list[float]:
    """Per question of the final group: 1.0 learnable, 0.0 not, and -0.5 for every question when
    the group still needed repropose after the last attempt (``_compute_proposer_rewards``)."""
    if never_mixed:
        return [REPROPOSE_PENALTY] * len(learnable)
    return [LEARNABLE_REWARD if ok else NOT_LEARNABLE_REWARD for ok in learnable]


@dataclass
class UnifiedResult:
    """Output of :func:`compute_unified_reward_and_filter` for a batch of groups."""

    rewards: list[list[list[float]]]  # [prompt][question][response]
    learnable: list[list[Learnability]]  # [prompt][question]
    sampled: list[int]  # [prompt]: question index, or -1 (needs repropose)


def compute_unified_reward_and_filter(
    groups: Sequence[Sequence[Sequence[Scores]]], dims: Sequence[Dimension], weights: RewardWeights, rng: random.Random
) -> UnifiedResult:
    """Solver rewards, learnability per question and the sampled question per prompt.

    ``groups[p][q][r]`` are the named scores of response ``r`` to question ``q`` of prompt ``p``.
    """
    rewards, learn, sampled = [], [], []
    for group in groups:
        rewards.append([[solver_reward(s, weights) for s in q] for q in group])
        checks = [check_learnability(q, dims) for q in group]
        learn.append(checks)
        sampled.append(sample_question([c.learnable for c in checks], rng))
    return UnifiedResult(rewards, learn, sampled)
