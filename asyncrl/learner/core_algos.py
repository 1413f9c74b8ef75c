"""The learner's maths: policy losses, aggregation, importance weights, KL, entropy (advantages
are in ``asyncrl.advantages``; references: verl's ``core_algos``, AReaL's decoupled PPO).

Shapes: ``N`` trajectories, ``B`` rows of a batch (one per trajectory), ``T`` target positions.
Every ``[B, T]`` tensor is aligned to the targets of :class:`asyncrl.learner.batch.TrainBatch`
(position ``j`` scores token ``j + 1`` of the padded sequence). Masks are float 0/1.

Policy losses live in a registry keyed by ``train.policy_loss``, with verl's shape::

    POLICY_LOSSES.get("ppo")(PolicyLossInputs(logprobs, old_logprobs, advantages, mask), LossConfig(...))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..registry import Registry

__all__ = [
    "POLICY_LOSSES", "PolicyLossInputs", "LossConfig", "masked_mean", "agg_loss", "LOSS_AGG_MODES",
    "behavior_importance_weight", "behavior_weights", "BehaviorWeight", "CorrectionConfig",
    "OFF_POLICY_CORRECTIONS", "compute_policy_loss", "kl_penalty", "entropy_from_logits",
    "logprobs_from_logits",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
OFF_POLICY_RESHAPES = (None, "none", "p_div_p_0.1")
LOG_RATIO_CLAMP = 20.0


# ----------------------------------------------------------------------------------------------
# registries


POLICY_LOSSES: Registry[Callable[..., tuple[Tensor, dict[str, float]]]] = Registry("policy loss")


# ----------------------------------------------------------------------------------------------
# aggregation


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``sum(values * mask) / sum(mask)`` over all elements; 0 (with grad) when the mask is empty."""
    return (values * mask).sum() / mask.sum().clamp(min=1e-8)


_NORM_REQUIRED = ("loss_agg_mode seq-mean-token-sum-norm needs a constant divisor (train.loss_scale_norm, "
                  "LossConfig.agg_norm, agg_loss's norm; verl's loss_scale_factor): the batch's padded width "
                  "would make the loss depend on padding")


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
            raise ValueError(_NORM_REQUIRED)
        return (loss_mat * mask).sum() / float(norm)
    tokens = mask.sum(-1)
    seq_sums = (loss_mat * mask).sum(-1)
    present = (tokens > 0).to(loss_mat.dtype)
    if mode == "seq-mean-token-sum":
        return masked_mean(seq_sums, present)
    if mode == "seq-mean-token-mean":
        return masked_mean(seq_sums / tokens.clamp(min=1e-8), present)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")


# ----------------------------------------------------------------------------------------------
# importance weights and the PPO loss


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
CAP_MODES = ("truncate", "mask")


@dataclass(frozen=True)
class CorrectionConfig:
    """``train.off_policy_correction``, ``train.is_cap``, ``train.is_cap_mode``, ``train.is_low``."""

    name: str = "decoupled"
    cap: float = 5.0
    cap_mode: str = "truncate"
    low: float | None = None

    def __post_init__(self) -> None:
        if not self.cap >= 1.0:
            raise ValueError(f"is_cap must be >= 1 (zero staleness must stay plain PPO); got {self.cap}")
        if self.cap_mode not in CAP_MODES:
            raise ValueError(f"unknown is_cap_mode {self.cap_mode!r}; valid: {', '.join(CAP_MODES)}")
        if self.low is not None and not 0.0 < self.low <= 1.0:
            raise ValueError(f"is_low must be in (0, 1]; got {self.low}")
        OFF_POLICY_CORRECTIONS.get(self.name)  # an unknown name raises, listing the valid ones

    @property
    def lower(self) -> float:
        """The lower bound a: ``low``, or ``1 / cap`` when unset (verl's reciprocal default)."""
        return self.low if self.low is not None else 1.0 / self.cap

    @classmethod
    def from_config(cls, train_cfg) -> "CorrectionConfig":
        return cls(name=getattr(train_cfg, "off_policy_correction", "decoupled"), cap=train_cfg.is_cap,
                   cap_mode=getattr(train_cfg, "is_cap_mode", "truncate"), low=getattr(train_cfg, "is_low", None))


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


def _none() -> Tensor:
    return torch.zeros((), dtype=torch.bool)


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
    return BehaviorWeight(torch.exp(seq.clamp(max=log_cap)).expand_as(log_rho), capped, _none().expand_as(capped))


@OFF_POLICY_CORRECTIONS.register("seq_mis")
def _seq_mis(log_rho: Tensor, mask: Tensor, cfg: CorrectionConfig) -> BehaviorWeight:
    """Sequence-level masked IS (Liu, Li et al. 2025, as above; TRL's ``sequence_mask``, C = 3 there):
    ``w = prod_t rho_t`` if ``prod_t rho_t <= C``, else 0 for the whole sequence."""
    seq, _ = _seq_log_rho(log_rho, mask)
    drop = (seq > math.log(cfg.cap)).expand_as(log_rho)
    w = torch.where(drop, torch.zeros_like(log_rho), torch.exp(seq.clamp(max=LOG_RATIO_CLAMP)).expand_as(log_rho))
    return BehaviorWeight(w, _none().expand_as(drop), drop)


@OFF_POLICY_CORRECTIONS.register("icepop")
def _icepop(log_rho: Tensor, mask: Tensor, cfg: CorrectionConfig) -> BehaviorWeight:
    """IcePop (Ling Team, inclusionAI 2025: the IcePop blog post "Small Leak Can Sink a Great Ship" and
    the Ring-1T report "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking
    Model"): ``w_t = M(rho_t) = rho_t`` if ``a <= rho_t <= C``, else 0 (the token is dropped from the
    gradient); set a (``is_low``) and C (``is_cap``) to the acceptance band you want."""
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    drop = (log_rho > math.log(cfg.cap)) | (log_rho < math.log(cfg.lower))
    return BehaviorWeight(torch.where(drop, torch.zeros_like(rho), rho), _none().expand_as(drop), drop)


@OFF_POLICY_CORRECTIONS.register("geo_mask")
def _geo_mask(log_rho: Tensor, mask: Tensor, cfg: CorrectionConfig) -> BehaviorWeight:
    """Geometric-mean sequence masking (Liu, Li et al. 2025, as above; verl ``rollout_rs:
    geometric``): ``rho_geo = exp(mean_t log rho_t)``; ``w = 1`` on every token of a sequence with
    ``a <= rho_geo <= C``, 0 otherwise (a rejection mask, no importance weight)."""
    seq, n = _seq_log_rho(log_rho, mask)
    mean = seq / n.clamp(min=1.0)
    drop = ((mean > math.log(cfg.cap)) | (mean < math.log(cfg.lower))).expand_as(log_rho)
    return BehaviorWeight((~drop).to(log_rho.dtype), _none().expand_as(drop), drop)


def _token_truncate(log_rho: Tensor, cap: float) -> BehaviorWeight:
    capped = log_rho > math.log(cap)
    w = torch.exp(log_rho.clamp(max=LOG_RATIO_CLAMP)).clamp(max=cap)
    return BehaviorWeight(w, capped, _none().expand_as(capped))


def _token_mask(log_rho: Tensor, log_cap: float) -> BehaviorWeight:
    drop = log_rho > log_cap
    w = torch.where(drop, torch.zeros_like(log_rho), torch.exp(log_rho.clamp(max=LOG_RATIO_CLAMP)))
    return BehaviorWeight(w, _none().expand_as(drop), drop)


@torch.no_grad()
def behavior_weights(old_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor,
                     cfg: CorrectionConfig) -> BehaviorWeight:
    """The off-policy correction ``cfg.name`` on ``[B, T]`` log-probs: ``log rho_t = old - behavior``
    (float64 for the sequence sums), ``mask[B, T]`` the tokens that belong to each sequence's product
    or mean (generated, not replayed). Weights come back in ``old_logprobs``' dtype, detached; off the
    mask they are whatever the formula gives (the loss masks them anyway)."""
    m = mask.to(torch.float64)
    on = m > 0
    # off the mask log rho is 0 by `where`, not by a product: a masked position may hold -inf (-inf * 0 is NaN,
    # which a sequence sum would spread over the whole row)
    log_rho = torch.where(on, old_logprobs.to(torch.float64) - behavior_logprobs.to(torch.float64),
                          torch.zeros((), dtype=torch.float64))
    out = OFF_POLICY_CORRECTIONS.get(cfg.name)(log_rho, m, cfg)
    return BehaviorWeight(out.weight.to(old_logprobs.dtype).contiguous(), out.capped.expand_as(on) & on,
                          out.masked.expand_as(on) & on)


def _clipped_pg(ratio: Tensor, adv: Tensor, low: float, high: float, c: float) -> tuple[Tensor, Tensor, Tensor]:
    """Clip-higher + dual-clip PPO per token. Returns (loss, clipped, dual_clipped), all ``[B, T]``."""
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -adv * c
    neg = adv < 0
    loss = torch.where(neg, torch.minimum(clip1, pg3), clip1)
    return loss, pg2 > pg1, neg & (clip1 > pg3)


def _stat(x: Tensor, mask: Tensor, how: str) -> float:
    sel = x.detach()[mask > 0]
    if sel.numel() == 0:
        return 0.0
    return float(getattr(sel.float(), how)())


@dataclass
class PolicyLossInputs:
    """What a policy loss sees, all ``[B, T]`` over target positions (see the module doc).

    - ``logprobs``: the current policy, with grad;
    - ``old_logprobs``: the proximal policy; for replayed tokens the recorded log-probs;
    - ``advantages``; ``mask``: the response mask;
    - ``behavior_weight``: detached weight (:func:`behavior_importance_weight`) multiplying every
      token's loss, replayed tokens included; None means 1;
    - ``exp_mask``: 1 on replayed (off-policy) tokens (experience replay); None: none.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    behavior_weight: Tensor | None = None
    exp_mask: Tensor | None = None


@dataclass(frozen=True)
class LossConfig:
    """The settings of a policy loss (``train.*``, and ``replay.*`` for replayed tokens).

    ``off_clip_high``: upper clip ``1 + off_clip_high`` for replayed tokens (None: ``clip_high``).
    ``off_policy_reshape="p_div_p_0.1"``: replayed tokens use the ExGRPO policy shaping
    ``L = -A * f(r)``, ``f(r) = r / (r + 0.1)``, unclipped, with ``r = exp(logp - logp_old)`` the
    importance ratio against the recorded policy (ExGRPO, Zhan et al. 2025, ``f(w) = w / (w + beta)``).
    LUFFY's code path of the same name shapes the bare probability ``exp(logp)`` instead (its
    off-policy data come from a teacher without log-probs); we have recorded ones.
    ``agg_norm``: the constant divisor of ``seq-mean-token-sum-norm`` (``train.loss_scale_norm``,
    verl's ``loss_scale_factor``), required in that mode (``asyncrl.config.Config`` always sets it).
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    agg_norm: float | None = None
    off_clip_high: float | None = None
    off_policy_reshape: str | None = None

    def __post_init__(self) -> None:
        if self.off_policy_reshape not in OFF_POLICY_RESHAPES:
            raise ValueError(f"unknown off_policy_reshape {self.off_policy_reshape!r}; valid: none, p_div_p_0.1")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.agg_norm is None:
            raise ValueError(_NORM_REQUIRED)

    @classmethod
    def from_config(cls, train_cfg, replay_cfg=None) -> "LossConfig":
        """``train.*`` settings; with experience replay on, its off-policy ones."""
        replay = replay_cfg if replay_cfg is not None and replay_cfg.enabled else None
        return cls(clip_low=train_cfg.clip_low, clip_high=train_cfg.clip_high, dual_clip_c=train_cfg.dual_clip_c,
                   loss_agg_mode=train_cfg.loss_agg_mode, agg_norm=getattr(train_cfg, "loss_scale_norm", None),
                   off_clip_high=replay.off_cliprange_high if replay else None,
                   off_policy_reshape=None if replay is None or replay.off_policy_reshape == "none"
                   else replay.off_policy_reshape)


@POLICY_LOSSES.register("ppo")
def compute_policy_loss(inputs: PolicyLossInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, float]]:
    """PPO clip (clip-higher, dual clip) with decoupled staleness weights and replayed tokens.

    Per token ``r = exp(clamp(logp - logp_old, -20, 20))``,
    ``L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``, and where ``A < 0``
    ``L = min(L, -A c)``; then ``L_tok = (L_off * exp + L_on * (1 - exp)) * w``, aggregated by
    ``loss_agg_mode``.
    Returns:
        (scalar loss, stats of python floats). ``clipfrac``: share of masked tokens where the
        clipped branch was taken; ``dual_clip_frac`` (verl's ``clipfrac_lower``, same value): share
        where the dual-clip bound applied; ``ratio_*`` and ``approx_kl`` (mean of old - new) over
        masked tokens; with ``exp_mask`` also ``on_pg_loss``/``off_pg_loss`` (token means of the
        weighted losses), ``on_clipfrac``/``off_clipfrac``, ``off_ratio_*`` (raw ratio on replayed
        tokens) and ``off_token_ratio``.
    """
    # one function rather than several: the loss and all its statistics share every intermediate tensor
    logprobs, old_logprobs, advantages = inputs.logprobs, inputs.old_logprobs, inputs.advantages
    behavior_weight, exp_mask = inputs.behavior_weight, inputs.exp_mask
    clip_low, clip_high, dual_clip_c = cfg.clip_low, cfg.clip_high, cfg.dual_clip_c
    mask = inputs.mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    on_loss, clipped, dual = _clipped_pg(ratio, advantages, clip_low, clip_high, dual_clip_c)
    weight = 1.0 if behavior_weight is None else behavior_weight.detach().to(logprobs.dtype)

    stats: dict[str, float] = {}
    if exp_mask is None:
        tok_loss = on_loss * weight
    else:
        exp = exp_mask.to(logprobs.dtype)
        if cfg.off_policy_reshape == "p_div_p_0.1":
            off_loss = -advantages * (ratio / (ratio + 0.1))
            off_clipped = torch.zeros_like(clipped)
            off_dual = torch.zeros_like(dual)
        else:
            hi = clip_high if cfg.off_clip_high is None else cfg.off_clip_high
            off_loss, off_clipped, off_dual = _clipped_pg(ratio, advantages, clip_low, hi, dual_clip_c)
        is_off = exp > 0
        on_clipped = clipped
        clipped = torch.where(is_off, off_clipped, clipped)
        dual = torch.where(is_off, off_dual, dual)
        tok_loss = (off_loss * exp + on_loss * (1.0 - exp)) * weight
        on_m, off_m = mask * (1.0 - exp), mask * exp
        with torch.no_grad():
            stats.update(
                on_pg_loss=float(masked_mean(tok_loss, on_m)),
                off_pg_loss=float(masked_mean(tok_loss, off_m)),
                on_clipfrac=float(masked_mean(on_clipped.to(mask.dtype), on_m)),
                off_clipfrac=float(masked_mean(clipped.to(mask.dtype), off_m)),
                off_ratio_mean=_stat(ratio, off_m, "mean"),
                off_ratio_min=_stat(ratio, off_m, "min"),
                off_ratio_max=_stat(ratio, off_m, "max"),
                off_token_ratio=float(off_m.sum() / mask.sum().clamp(min=1e-8)),
            )

    loss = agg_loss(tok_loss, mask, cfg.loss_agg_mode, norm=cfg.agg_norm)
    with torch.no_grad():
        dual_frac = float(masked_mean(dual.to(mask.dtype), mask))
        stats.update(
            pg_loss=float(loss),
            clipfrac=float(masked_mean(clipped.to(mask.dtype), mask)),
            dual_clip_frac=dual_frac,
            clipfrac_lower=dual_frac,
            ratio_mean=_stat(ratio, mask, "mean"),
            ratio_min=_stat(ratio, mask, "min"),
            ratio_max=_stat(ratio, mask, "max"),
            approx_kl=float(masked_mean(-log_ratio, mask)),
        )
    return loss, stats


# ----------------------------------------------------------------------------------------------
# KL, entropy, log-probs


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL estimate to a reference policy, ``[B, T]`` (mask and aggregate it yourself).

    - ``k1``: ``logp - ref``.
    - ``k2``: ``0.5 * (logp - ref) ** 2``.
    - ``k3`` / ``low_var_kl``: ``exp(ref - logp) - (ref - logp) - 1``, clamped to ``[-10, 10]``
      (verl), non-negative and low-variance.
    """
    if kind == "k1":
        return logprobs - ref_logprobs
    if kind == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    if kind in ("k3", "low_var_kl"):
        d = ref_logprobs - logprobs
        return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL kind {kind!r}; valid: k1, k2, k3, low_var_kl")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Categorical entropy per position: ``logits[B, T, V] -> [B, T]``.

    ``H = logsumexp(z) - sum(softmax(z) * z)``: one softmax, no [B, T, V] log-softmax kept.
    """
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """``log softmax(logits)[labels]``: ``logits[B, T, V]``, ``labels[B, T]`` -> ``[B, T]``.

    Float32/64: ``gather - logsumexp``, never materialising a full log-softmax. Half precision:
    row by row in float32, since logsumexp in bf16 loses the digits the PPO ratio needs.
    """
    labels = labels.long().unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        return logits.gather(-1, labels).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    rows = [F.log_softmax(row.float(), dim=-1).gather(-1, lab).squeeze(-1)
            for row, lab in zip(logits, labels)]
    return torch.stack(rows)
