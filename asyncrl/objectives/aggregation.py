"""Aggregation: a per-token quantity ``[B, T]`` under a mask into one scalar (``train.loss_agg_mode``).

Shapes as in :mod:`asyncrl.objectives`: ``B`` rows, ``T`` target positions, masks float 0/1."""

from __future__ import annotations

from typing import get_args

from torch import Tensor

from ..config import TrainConfig

LOSS_AGG_MODES = get_args(TrainConfig.model_fields["loss_agg_mode"].annotation)  # declared once, in the config


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``sum(values * mask) / sum(mask)`` over all elements; 0 (with grad) when the mask is empty."""
    return (values * mask).sum() / mask.sum().clamp(min=1e-8)


NORM_REQUIRED = (
    "loss_agg_mode seq-mean-token-sum-norm needs a constant divisor (train.loss_scale_norm, "
    "LossConfig.agg_norm, agg_loss's norm; verl's loss_scale_factor): the batch's padded width "
    "would make the loss depend on padding"
)


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", norm: float | None = None) -> Tensor:
    """Aggregate a per-token loss ``[B, T]`` under ``mask[B, T]`` into a scalar.

    - ``token-mean``: ``sum(loss * mask) / sum(mask)``.
    - ``seq-mean-token-sum``: mean over sequences of per-sequence sums.
    - ``seq-mean-token-mean``: mean over sequences of per-sequence masked means.
    - ``seq-mean-token-sum-norm`` (Dr.GRPO, as verl has it): ``sum(loss * mask) / norm`` with ``norm`` a
      constant (``train.loss_scale_norm``, verl's ``loss_scale_factor``; e.g. the max generation
      length), required: the batch's padded width would make the loss depend on padding. Dr.GRPO's
      paper also divides by the number of sequences (its ``1/G``); verl does not, nor do we (with a
      fixed number of sequences per step it is a constant factor of the learning rate).

    The two ``seq-mean`` modes leave out sequences whose mask is empty (current verl behaviour),
    so a fully masked row does not dilute the mean. An all-zero mask gives 0 connected to the graph.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "seq-mean-token-sum-norm":
        if norm is None:
            raise ValueError(NORM_REQUIRED)
        return (loss_mat * mask).sum() / float(norm)
    tokens = mask.sum(-1)
    seq_sums = (loss_mat * mask).sum(-1)
    present = (tokens > 0).to(loss_mat.dtype)
    if mode == "seq-mean-token-sum":
        return masked_mean(seq_sums, present)
    if mode == "seq-mean-token-mean":
        return masked_mean(seq_sums / tokens.clamp(min=1e-8), present)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
