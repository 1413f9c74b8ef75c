"""Off-policy corrections: the detached behaviour weight of every generated token from
``rho_t = pi_prox(y_t) / pi_behav(y_t)`` (``train.off_policy_correction``, ``is_cap``, ``is_cap_mode``,
``is_low``; docs/design/off_policy.md). A correction is one registered function; its name is all a config needs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, get_args

import torch
from torch import Tensor

from ..config import TrainConfig
from ..registry import Registry

LOG_RATIO_CLAMP = 20.0
_TRAIN = TrainConfig.model_fields  # the defaults and choices below are the config's, declared once there


@torch.no_grad()
def behavior_importance_weight(old_logprobs: Tensor, behavior_logprobs: Tensor, cap: float) -> Tensor:
    """Decoupled-PPO staleness weight ``min(exp(old - behavior), cap)``, ``[B, T]``, detached.

    ``old_logprobs`` are the proximal policy's (recomputed by the learner), ``behavior_logprobs``
    the engine's at generation time. Equal inputs give exactly 1. (The ``decoupled`` correction of
    :func:`behavior_weights` with ``cap_mode="truncate"``.)
    """
    log_w = (old_logprobs - behavior_logprobs).clamp(max=LOG_RATIO_CLAMP)
    return torch.exp(log_w).clamp(max=cap).detach()


# ----------------------------------------------------------------------------------------------
# off-policy corrections: the behaviour weight from rho_t = pi_prox(y_t) / pi_behav(y_t)
#
# Notation: rho_t = exp(logp_prox_t - logp_behav_t) per generated token t of a sequence (the
# decoupled-PPO weight of Hilton et al. 2021 / Fu et al. 2025, and the training/inference ratio of
# Yao et al. 2025), C = ``cap`` (>= 1), a = ``low`` in (0, 1] (default 1 / C). Each correction
# gives a detached weight w_t that multiplies token t's PPO loss. Every one of them gives w = 1
# exactly when logp_prox == logp_behav (rho = 1), so zero staleness is plain PPO under all.


OFF_POLICY_CORRECTIONS: Registry[Callable[..., "BehaviorWeight"]] = Registry("off-policy correction")
CAP_MODES = get_args(_TRAIN["is_cap_mode"].annotation)


@dataclass(frozen=True)
class CorrectionConfig:
    """``train.off_policy_correction``, ``train.is_cap``, ``train.is_cap_mode``, ``train.is_low``."""

    name: str = _TRAIN["off_policy_correction"].default
    cap: float = _TRAIN["is_cap"].default
    cap_mode: str = _TRAIN["is_cap_mode"].default
    low: float | None = _TRAIN["is_low"].default
    fn: Callable[..., "BehaviorWeight"] = field(init=False, repr=False, compare=False)  # the correction, looked up once

    def __post_init__(self) -> None:
        if not self.cap >= 1.0:
            raise ValueError(f"is_cap must be >= 1 (zero staleness must stay plain PPO); got {self.cap}")
        if self.cap_mode not in CAP_MODES:
            raise ValueError(f"unknown is_cap_mode {self.cap_mode!r}; valid: {', '.join(CAP_MODES)}")
        if self.low is not None and not 0.0 < self.low <= 1.0:
            raise ValueError(f"is_low must be in (0, 1]; got {self.low}")
        object.__setattr__(self, "fn", OFF_POLICY_CORRECTIONS.get(self.name))  # an unknown name lists the valid ones

    @property
    def lower(self) -> float:
        """The lower bound a: ``low``, or ``1 / cap`` when unset (verl's reciprocal default)."""
        return self.low if self.low is not None else 1.0 / self.cap

    @classmethod
    def from_config(cls, train_cfg) -> "CorrectionConfig":
        return cls(
            name=train_cfg.off_policy_correction,
            cap=train_cfg.is_cap,
            cap_mode=train_cfg.is_cap_mode,
            low=train_cfg.is_low,
        )


@dataclass
class BehaviorWeight:
    """A correction's result, all ``[B, T]``: ``weight`` (float, detached; 0 where masked),
    ``capped`` (bool: the weight was truncated to the cap) and ``masked`` (bool: set to 0)."""

    weight: Tensor
    capped: Tensor
    masked: Tensor


def _seq_log_rho(log_rho: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per sequence ``sum_t log rho_t`` and the token count over ``mask``, both ``[B, 1]``."""
    return (log_rho * mask).sum(-1, keepdim=True), mask.sum(-1, keepdim=True)


def _none(like: Tensor) -> Tensor:
    """No token flagged: a boolean scalar on ``like``'s device (expanded to its shape by the caller)."""
    return torch.zeros((), dtype=torch.bool, device=like.device)


@OFF_POLICY_CORRECTIONS.register("decoupled")
def _decoupled(log_rho: Tensor, mask: Tensor, cfg: CorrectionConfig) -> BehaviorWeight:
    """Decoupled PPO (Hilton et al. 2021; AReaL, Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
    Reinforcement Learning System for Language Reasoning"): ``truncate``: ``w_t = min(rho_t, C)``;
    ``mask`` (AReaL's code): ``w_t = rho_t if rho_t <= C else 0``."""
    if cfg.cap_mode == "mask":
        return _token_mask(log_rho, math.log(cfg.cap))
    return _token_truncate(log_rho, cfg.cap)


@OFF_POLICY_CORRECTIONS.register("token_tis")
def _token_tis(log_rho: Tensor, mask: Tensor, cfg: CorrectionConfig) -> BehaviorWeight:
    """Token-level truncated IS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"): ``w_t = min(rho_t, C)``. The same weight as ``decoupled`` with
    ``truncate``; here under the name verl, SkyRL and OpenRLHF use (``is_cap_mode`` is ignored)."""
    return _token_truncate(log_rho, cfg.cap)


@OFF_POLICY_CORRECTIONS.register("seq_tis")
def _seq_tis(log_rho: Tensor, mask: Tensor, cfg: CorrectionConfig) -> BehaviorWeight:
    """Sequence-level truncated IS (Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL
    Collapse from the Training-Inference Mismatch"; verl ``rollout_is: sequence``):
    ``w = min(prod_t rho_t, C) = min(exp(sum_t log rho_t), C)`` on every token of the sequence."""
    seq, _ = _seq_log_rho(log_rho, mask)
    log_cap = math.log(cfg.cap)
    capped = (seq > log_cap).expand_as(log_rho)
    return BehaviorWeight(torch.exp(seq.clamp(max=log_cap)).expand_as(log_rho), capped, _none(capped).expand_as(capped))


@OFF_POLICY_CORRECTIONS.register("seq_mis")
def _seq_mis(log_rho: Tensor, mask: Tensor, cfg: CorrectionConfig) -> BehaviorWeight:
    """Sequence-level masked IS (Liu, Li et al. 2025, as above; TRL's ``sequence_mask``, C = 3 there):
    ``w = prod_t rho_t`` if ``prod_t rho_t <= C``, else 0 for the whole sequence."""
    seq, _ = _seq_log_rho(log_rho, mask)
    drop = (seq > math.log(cfg.cap)).expand_as(log_rho)
    w = torch.where(drop, torch.zeros_like(log_rho), torch.exp(seq.clamp(max=LOG_RATIO_CLAMP)).expand_as(log_rho))
    return BehaviorWeight(w, _none(drop).expand_as(drop), drop)


@OFF_POLICY_CORRECTIONS.register("icepop")
def _icepop(log_rho: Tensor, mask: Tensor, cfg: CorrectionConfig) -> BehaviorWeight:
    """IcePop (Ling Team, inclusionAI 2025: the IcePop blog post "Small Leak Can Sink a Great Ship" and
    the Ring-1T report "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking
    Model"): ``w_t = M(rho_t) = rho_t`` if ``a <= rho_t <= C``, else 0 (the token is dropped from the
    gradient); set a (``is_low``) and C (``is_cap``) to the acceptance band you want."""
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    drop = (log_rho > math.log(cfg.cap)) | (log_rho < math.log(cfg.lower))
    return BehaviorWeight(torch.where(drop, torch.zeros_like(rho), rho), _none(drop).expand_as(drop), drop)


@OFF_POLICY_CORRECTIONS.register("geo_mask")
def _geo_mask(log_rho: Tensor, mask: Tensor, cfg: CorrectionConfig) -> BehaviorWeight:
    """Geometric-mean sequence masking (Liu, Li et al. 2025, as above; verl ``rollout_rs:
    geometric``): ``rho_geo = exp(mean_t log rho_t)``; ``w = 1`` on every token of a sequence with
    ``a <= rho_geo <= C``, 0 otherwise (a rejection mask, no importance weight)."""
    seq, n = _seq_log_rho(log_rho, mask)
    mean = seq / n.clamp(min=1.0)
    drop = ((mean > math.log(cfg.cap)) | (mean < math.log(cfg.lower))).expand_as(log_rho)
    return BehaviorWeight((~drop).to(log_rho.dtype), _none(drop).expand_as(drop), drop)


@OFF_POLICY_CORRECTIONS.register("seq_geo")
def _seq_geo(log_rho: Tensor, mask: Tensor, cfg: CorrectionConfig) -> BehaviorWeight:
    """The sequence-level weight for a sequence-level loss (GSPO's default, issue 68): the geometric
    mean of the sequence's rho, ``w = min(exp(mean_t log rho_t), C)`` on every token of it, the
    behaviour analogue of GSPO's own ratio (a per-token weight inside a sequence loss is what GSPO
    argues against); ``is_cap_mode=mask``: 0 for the whole sequence above C."""
    seq, n = _seq_log_rho(log_rho, mask)
    mean = seq / n.clamp(min=1.0)
    log_cap = math.log(cfg.cap)
    over = (mean > log_cap).expand_as(log_rho)
    if cfg.cap_mode == "mask":
        w = torch.where(over, torch.zeros_like(log_rho), torch.exp(mean.clamp(max=LOG_RATIO_CLAMP)).expand_as(log_rho))
        return BehaviorWeight(w, _none(over).expand_as(over), over)
    return BehaviorWeight(torch.exp(mean.clamp(max=log_cap)).expand_as(log_rho), over, _none(over).expand_as(over))


def _token_truncate(log_rho: Tensor, cap: float) -> BehaviorWeight:
    capped = log_rho > math.log(cap)
    w = torch.exp(log_rho.clamp(max=LOG_RATIO_CLAMP)).clamp(max=cap)
    return BehaviorWeight(w, capped, _none(capped).expand_as(capped))


def _token_mask(log_rho: Tensor, log_cap: float) -> BehaviorWeight:
    drop = log_rho > log_cap
    w = torch.where(drop, torch.zeros_like(log_rho), torch.exp(log_rho.clamp(max=LOG_RATIO_CLAMP)))
    return BehaviorWeight(w, _none(drop).expand_as(drop), drop)


@torch.no_grad()
def behavior_weights(
    old_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, cfg: CorrectionConfig
) -> BehaviorWeight:
    """The off-policy correction ``cfg.name`` on ``[B, T]`` log-probs: ``log rho_t = old - behavior``
    (float64 for the sequence sums), ``mask[B, T]`` the tokens that belong to each sequence's product
    or mean (generated, not replayed). Weights come back in ``old_logprobs``' dtype, detached; off the
    mask they are whatever the formula gives (the loss masks them anyway)."""
    m = mask.to(torch.float64)
    on = m > 0
    # off the mask log rho is 0 by `where`, not by a product: a masked position may hold -inf (-inf * 0 is NaN,
    # which a sequence sum would spread over the whole row)
    log_rho = torch.where(
        on,
        old_logprobs.to(torch.float64) - behavior_logprobs.to(torch.float64),
        torch.zeros((), dtype=torch.float64, device=old_logprobs.device),
    )
    out = cfg.fn(log_rho, m, cfg)
    return BehaviorWeight(
        out.weight.to(old_logprobs.dtype).contiguous(), out.capped.expand_as(on) & on, out.masked.expand_as(on) & on
    )
