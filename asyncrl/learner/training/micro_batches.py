"""A mini-batch cut into micro-batches by a token budget (``train.micro_batch_tokens``), the rows that
carry no gradient left out, and the loss normalised over the whole mini-batch.

The loss of a mini-batch is one aggregation over all its rows (``train.loss_agg_mode``). Cut into
micro-batches ``m`` whose gradients are summed, each micro-batch's own aggregate is multiplied by
the share of the mini-batch's normaliser it holds (:func:`loss_scales`): for ``token-mean``
``S_m / n_m * n_m / N = S_m / N``, for the sequence means the same with sequences, and
``seq-mean-token-sum-norm`` divides by a constant already. The sum over micro-batches is then the
one-pass loss, and so is its gradient. Over ``W`` ranks whose gradients are averaged, the factor
carries ``W`` and ``N`` counts every rank's rows (:func:`asyncrl.learner.training.distributed.step_totals`).

A row whose advantage is 0 on every token (a GRPO group with equal rewards) or that has no trained
token contributes exactly 0 to a policy loss and its gradient; when no KL or entropy term reads
it and its log-probs are not wanted, it is not forwarded at all (``skip_zero_advantage``). Its
tokens stay in ``N``, so the update is the one with it included. A mini-batch in which no row carries
a gradient still runs its first micro-batch, for the step's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...objectives.aggregation import LOSS_AGG_MODES
from .batch import TrainBatch

__all__ = ["MicroPlan", "Totals", "combine_stats", "loss_scales", "plan_micro_batches"]


@dataclass(frozen=True)
class Totals:
    """A mini-batch's normalisers over every rank: trained ``tokens`` and ``seqs`` (rows with a
    trained token), and the ``world`` size whose gradients are averaged."""

    tokens: float
    seqs: float
    world: int = 1

    @classmethod
    def of(cls, mask: torch.Tensor, world: int = 1) -> "Totals":
        m = mask.detach().double()
        return cls(float(m.sum()), float((m.sum(-1) > 0).sum()), world)


def loss_scales(mask: torch.Tensor, agg_mode: str, totals: Totals) -> tuple[float, float]:
    """``(policy_scale, token_scale)`` of a part (a micro-batch, one rank's rows) with response
    ``mask[b, T]``: the policy loss aggregated by ``agg_mode`` over the part, times ``policy_scale``,
    summed over the parts (and averaged over ``totals.world`` ranks), is the whole's; ``token_scale``
    does the same for a token-mean term (KL, entropy)."""
    if agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"loss_scales: loss_agg_mode {agg_mode!r} unknown; expected one of {', '.join(LOSS_AGG_MODES)}"
        )
    part = Totals.of(mask)
    token_scale = totals.world * part.tokens / max(totals.tokens, 1.0)
    if agg_mode == "token-mean":
        return token_scale, token_scale
    if agg_mode == "seq-mean-token-sum-norm":
        return float(totals.world), token_scale
    return totals.world * part.seqs / max(totals.seqs, 1.0), token_scale


@dataclass
class MicroPlan:
    """Which rows of a mini-batch go through the model, in which micro-batches (lists of row
    indices), and the rows left out."""

    micro_batches: list[list[int]]
    skipped: list[int]


def carries_gradient(batch: TrainBatch) -> torch.Tensor:
    """``[B]`` bool: the row has a trained token with a non-zero advantage."""
    return ((batch.advantages != 0) & (batch.response_mask > 0)).any(1)


def plan_micro_batches(batch: TrainBatch, budget: int, packing: bool, skip: bool) -> MicroPlan:
    """Cut ``batch``'s rows into micro-batches of at most ``budget`` tokens, in batch order (a
    prompt's completions stay together for the shared prompt): with ``packing`` a micro-batch
    counts its rows' tokens, without it its padded slots (rows x the longest). A row over the budget
    goes alone. ``skip``: rows that carry no gradient (:func:`carries_gradient`) are left out; when
    no row carries one, the first micro-batch still runs (its loss and gradient are 0), so that the
    step still reports its entropy and train/inference mismatch."""
    keep = carries_gradient(batch).tolist() if skip else [True] * batch.batch_size
    if skip and not any(keep):
        first = plan_micro_batches(batch, budget, packing, skip=False).micro_batches[:1]
        ran = set(first[0]) if first else set()
        return MicroPlan(first, [b for b in range(batch.batch_size) if b not in ran])
    lengths = batch.attention_mask.sum(1).tolist()
    rows = [b for b in range(batch.batch_size) if keep[b]]
    out: list[list[int]] = []
    current: list[int] = []
    longest = used = 0
    for b in rows:
        n = int(lengths[b])
        cost = used + n if packing else (len(current) + 1) * max(longest, n)
        if current and cost > budget:
            out.append(current)
            current, longest, used = [], 0, 0
        current.append(b)
        longest, used = max(longest, n), used + n
    if current:
        out.append(current)
    return MicroPlan(out, [b for b in range(batch.batch_size) if not keep[b]])


SUM_KEYS = frozenset({"loss", "pg_loss"})  # already scaled to the whole: the parts add up


def combine_stats(
    parts: list[tuple[dict[str, float], float]],
    sum_keys: frozenset[str] = SUM_KEYS,
    mean_keys: frozenset[str] = frozenset(),
) -> dict[str, float]:
    """One dict from parts ``(stats, weight)``: per key over the parts that report it, the maximum
    for ``*_max``, the minimum for ``*_min``, the sum for counts (``*tokens``, ``*rows_skipped``) and
    ``sum_keys``, the plain mean for ``mean_keys``, else the mean weighted by ``weight`` (the part's
    trained tokens: exact for token means)."""
    out: dict[str, float] = {}
    for key in sorted({k for s, _ in parts for k in s}):
        vals = [(s[key], w) for s, w in parts if key in s]
        xs = [v for v, _ in vals]
        if key.endswith("_max"):
            out[key] = max(xs)
        elif key.endswith("_min"):
            out[key] = min(xs)
        elif key.endswith(("tokens", "rows_skipped")) or key in sum_keys:
            out[key] = sum(xs)
        elif key in mean_keys:
            out[key] = sum(xs) / len(xs)
        else:
            total = sum(w for _, w in vals)
            out[key] = sum(v * w for v, w in vals) / total if total > 0 else sum(xs) / len(xs)
    return out
