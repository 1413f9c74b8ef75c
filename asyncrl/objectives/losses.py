"""Policy losses: a registry keyed by ``train.policy_loss``, with verl's shape::

    POLICY_LOSSES.get("ppo")(PolicyLossInputs(logprobs, old_logprobs, advantages, mask), LossConfig(...))

Shapes as in :mod:`asyncrl.objectives`; references: verl's ``core_algos``, AReaL's decoupled PPO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, get_args

import torch
from torch import Tensor

from ..config import ReplayConfig, TrainConfig
from ..registry import Registry
from .aggregation import LOSS_AGG_MODES, NORM_REQUIRED, agg_loss, masked_mean
from .corrections import LOG_RATIO_CLAMP

POLICY_LOSSES: Registry[Callable[..., tuple[Tensor, dict[str, float]]]] = Registry("policy loss")
OFF_POLICY_RESHAPES = get_args(ReplayConfig.model_fields["off_policy_reshape"].annotation)
_TRAIN = TrainConfig.model_fields  # LossConfig's defaults are the config's, declared once there


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
    - ``exp_mask``: 1 on replayed (off-policy) tokens (experience replay); None: none;
    - ``behavior_log_ratio``: detached ``log(pi_old / pi_behaviour)`` per token (decoupled PPO's
      ``log rho``; 0 on replayed tokens), for the trust region around the behaviour policy
      (``LossConfig.behavior_clip``); None: ``old`` is the behaviour policy;
    - ``trace``: a dict the loss fills with its per-token ``[B, T]`` tensors (``ratio``, ``clipped``,
      ``dual_clipped``, ``blocked``), for the token trace (:mod:`asyncrl.learner.trace`); None: not kept.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    behavior_weight: Tensor | None = None
    exp_mask: Tensor | None = None
    behavior_log_ratio: Tensor | None = None
    trace: dict | None = None


def _keep(
    inputs: PolicyLossInputs, ratio: Tensor, clipped: Tensor, dual: Tensor | None, blocked: Tensor | None
) -> None:
    """The per-token flags into ``inputs.trace`` (when the caller asked for them)."""
    if inputs.trace is None:
        return
    none = torch.zeros_like(clipped, dtype=torch.bool)
    inputs.trace.update(
        ratio=ratio.detach(),
        clipped=clipped.detach().expand_as(ratio),
        dual_clipped=(none if dual is None else dual.detach()).expand_as(ratio),
        blocked=(none if blocked is None else blocked).expand_as(ratio),
    )


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
    ``behavior_clip``: the trust region around the behaviour policy (``train.behavior_clip``; it acts
    where the inputs carry ``behavior_log_ratio``). ``gspo_clip_*`` and ``cispo_clip_*``: the bands of
    those losses.
    """

    clip_low: float = _TRAIN["clip_low"].default
    clip_high: float = _TRAIN["clip_high"].default
    dual_clip_c: float = _TRAIN["dual_clip_c"].default
    loss_agg_mode: str = _TRAIN["loss_agg_mode"].default
    agg_norm: float | None = None
    off_clip_high: float | None = None
    off_policy_reshape: str | None = None
    behavior_clip: bool = _TRAIN["behavior_clip"].default
    gspo_clip_low: float = _TRAIN["gspo_clip_low"].default
    gspo_clip_high: float = _TRAIN["gspo_clip_high"].default
    cispo_clip_low: float = _TRAIN["cispo_clip_low"].default
    cispo_clip_high: float = _TRAIN["cispo_clip_high"].default

    def __post_init__(self) -> None:
        if self.off_policy_reshape not in (None, *OFF_POLICY_RESHAPES):
            raise ValueError(
                f"unknown off_policy_reshape {self.off_policy_reshape!r}; valid: {', '.join(OFF_POLICY_RESHAPES)}"
            )
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.agg_norm is None:
            raise ValueError(NORM_REQUIRED)

    @classmethod
    def from_config(cls, train_cfg, replay_cfg=None) -> "LossConfig":
        """``train.*`` settings; with experience replay on, its off-policy ones."""
        replay = replay_cfg if replay_cfg is not None and replay_cfg.enabled else None
        return cls(
            clip_low=train_cfg.clip_low,
            clip_high=train_cfg.clip_high,
            dual_clip_c=train_cfg.dual_clip_c,
            loss_agg_mode=train_cfg.loss_agg_mode,
            agg_norm=train_cfg.loss_scale_norm,
            behavior_clip=train_cfg.behavior_clip,
            gspo_clip_low=train_cfg.gspo_clip_low,
            gspo_clip_high=train_cfg.gspo_clip_high,
            cispo_clip_low=train_cfg.cispo_clip_low,
            cispo_clip_high=train_cfg.cispo_clip_high,
            off_clip_high=replay.off_cliprange_high if replay else None,
            off_policy_reshape=None
            if replay is None or replay.off_policy_reshape == "none"
            else replay.off_policy_reshape,
        )


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
    # the loss and all its statistics share every intermediate tensor: they are computed together
    logprobs, advantages = inputs.logprobs, inputs.advantages
    mask = inputs.mask.to(logprobs.dtype)
    log_ratio = (logprobs - inputs.old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    on_loss, clipped, dual = _clipped_pg(ratio, advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip_c)
    weight = 1.0 if inputs.behavior_weight is None else inputs.behavior_weight.detach().to(logprobs.dtype)

    stats: dict[str, float] = {}
    if inputs.exp_mask is None:
        tok_loss = on_loss * weight
    else:
        tok_loss, clipped, dual, stats = _with_replayed_tokens(
            inputs, cfg, ratio, (on_loss, clipped, dual), weight, mask
        )
    blocked = _behavior_blocked(inputs, cfg, log_ratio, cfg.clip_low, cfg.clip_high, dual_c=cfg.dual_clip_c)
    tok_loss = _without_gradient(tok_loss, blocked)
    _keep(inputs, ratio, clipped, dual, blocked)

    loss = agg_loss(tok_loss, mask, cfg.loss_agg_mode, norm=cfg.agg_norm)
    with torch.no_grad():
        dual_frac = float(masked_mean(dual.to(mask.dtype), mask))
        stats.update(
            _ratio_stats(loss, ratio, log_ratio, clipped, mask, blocked),
            dual_clip_frac=dual_frac,
            clipfrac_lower=dual_frac,
        )
    return loss, stats


def _ratio_stats(
    loss: Tensor, ratio: Tensor, log_ratio: Tensor, clipped: Tensor, mask: Tensor, blocked: Tensor | None
) -> dict[str, float]:
    """The statistics every policy loss reports (token means over ``mask``)."""
    out = dict(
        pg_loss=float(loss),
        clipfrac=float(masked_mean(clipped.to(mask.dtype), mask)),
        ratio_mean=_stat(ratio, mask, "mean"),
        ratio_min=_stat(ratio, mask, "min"),
        ratio_max=_stat(ratio, mask, "max"),
        approx_kl=float(masked_mean(-log_ratio, mask)),
    )
    if blocked is not None:
        out["behavior_clipfrac"] = float(masked_mean(blocked.to(mask.dtype), mask))
    return out


def _behavior_blocked(
    inputs: PolicyLossInputs,
    cfg: LossConfig,
    log_ratio: Tensor,
    low: float,
    high: float,
    per_row: Callable[[Tensor], Tensor] | None = None,
    dual_c: float | None = None,
) -> Tensor | None:
    """``[B, T]`` bool: the generated, non-replayed tokens whose ratio against the behaviour policy
    (``exp(log_ratio + behavior_log_ratio)``, the latter reduced by ``per_row`` first when given, e.g.
    to a sequence mean) is past ``[1 - low, 1 + high]`` on the side their advantage pushes, or, with
    ``dual_c`` (PPO's dual clip), above ``dual_c`` where the advantage is negative (PPO against the
    behaviour policy gives those no gradient either); None when the trust region is off or the
    inputs carry no behaviour log-ratio (the old policy is the behaviour one)."""
    if not cfg.behavior_clip or inputs.behavior_log_ratio is None:
        return None
    with torch.no_grad():
        log_rho = inputs.behavior_log_ratio.to(log_ratio.dtype)
        log_b = log_ratio.detach() + (per_row(log_rho) if per_row is not None else log_rho)
        adv = inputs.advantages
        out = ((adv > 0) & (log_b > math.log1p(high))) | ((adv < 0) & (log_b < _log1m(low)))
        if dual_c is not None:
            out = out | ((adv < 0) & (log_b > math.log(dual_c)))
        if inputs.exp_mask is not None:
            out = out & (inputs.exp_mask == 0)
        return out & (inputs.mask > 0)


def _log1m(x: float) -> float:
    """``log(1 - x)``; -inf for ``x >= 1`` (no lower bound)."""
    return math.log1p(-x) if x < 1.0 else -math.inf


def _without_gradient(tok_loss: Tensor, blocked: Tensor | None) -> Tensor:
    """``tok_loss`` with its value kept and its gradient removed where ``blocked``."""
    return tok_loss if blocked is None else torch.where(blocked, tok_loss.detach(), tok_loss)


def _seq_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """``[B, 1]``: each row's mean of ``log_ratio`` over its masked tokens (0 for an empty row)."""
    return (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


@POLICY_LOSSES.register("gspo")
def compute_gspo_loss(inputs: PolicyLossInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per
    sequence, the geometric mean of its tokens' ratios, ``s_i = exp(mean_t (logp_t - logp_old_t))``,
    clipped per sequence to ``[1 - gspo_clip_low, 1 + gspo_clip_high]``:
    ``L_t = max(-A s_i, -A clip(s_i))`` with ``s_i``'s value on every token and its gradient through
    each token's own ``logp_t`` (``s_i = sg(s_i) exp(logp_t - sg(logp_t))``, verl's
    ``compute_policy_loss_gspo``); times the behaviour weight, aggregated by ``loss_agg_mode`` (the
    paper's is ``seq-mean-token-mean``, the default of ``train.loss_agg_mode`` with this loss). The
    sequence's log-ratio is the mean of its tokens' raw log-ratios, clamped at 10 (verl's; no per-token
    clamp first). ``dual_clip_c`` does not apply. With the trust region on, a
    sequence whose geometric-mean ratio against the behaviour policy is past the band on its
    advantage's side gets no gradient."""
    logprobs, advantages = inputs.logprobs, inputs.advantages
    mask = inputs.mask.to(logprobs.dtype)
    raw = torch.where(
        mask > 0, logprobs - inputs.old_logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    )
    log_ratio = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (for the statistics)
    seq = _seq_log_ratio(raw.detach(), mask)  # (verl: the tokens' own log-ratios; only the sequence's is clamped)
    log_s = (logprobs - logprobs.detach() + seq).clamp(max=10.0)
    s = torch.exp(log_s)
    pg1 = -advantages * s
    pg2 = -advantages * s.clamp(1.0 - cfg.gspo_clip_low, 1.0 + cfg.gspo_clip_high)
    weight = 1.0 if inputs.behavior_weight is None else inputs.behavior_weight.detach().to(logprobs.dtype)
    tok_loss = torch.maximum(pg1, pg2) * weight
    # the sequence's mean log rho, on every token of it
    blocked = _behavior_blocked(
        inputs,
        cfg,
        seq.expand_as(log_s),
        cfg.gspo_clip_low,
        cfg.gspo_clip_high,
        per_row=lambda log_rho: _seq_log_ratio(log_rho, mask).expand_as(log_s),
    )
    tok_loss = _without_gradient(tok_loss, blocked)
    _keep(inputs, s.detach(), pg2 > pg1, None, blocked)
    loss = agg_loss(tok_loss, mask, cfg.loss_agg_mode, norm=cfg.agg_norm)
    with torch.no_grad():
        stats = _ratio_stats(loss, s.detach(), log_ratio, pg2 > pg1, mask, blocked)
        stats.update(dual_clip_frac=0.0, clipfrac_lower=0.0)
    return loss, stats


@POLICY_LOSSES.register("cispo")
def compute_cispo_loss(inputs: PolicyLossInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): no token loses its gradient; the importance weight is clipped and
    detached, ``L_t = -sg(clip(r_t, 1 - cispo_clip_low, 1 + cispo_clip_high)) A_t logp_t`` with
    ``r_t = exp(logp_t - logp_old_t)``, aggregated by ``loss_agg_mode``. Without the trust region it is
    also multiplied by the behaviour weight (the correction's); with it (``behavior_clip`` and a
    behaviour log-ratio) ``r_t`` is taken against the behaviour policy, ``exp(logp_t - logp_old_t +
    log rho_t)``, and its clipped value is the token's whole weight (the correction's would count
    the staleness twice). ``clipfrac``: tokens whose weight was clipped. ``dual_clip_c`` does not apply."""
    logprobs, advantages = inputs.logprobs, inputs.advantages
    mask = inputs.mask.to(logprobs.dtype)
    log_ratio = (logprobs - inputs.old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    against_behavior = cfg.behavior_clip and inputs.behavior_log_ratio is not None
    log_w = log_ratio.detach()
    if against_behavior:
        log_w = (log_w + inputs.behavior_log_ratio.to(log_w.dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    r = torch.exp(log_w)
    w = r.clamp(max(1.0 - cfg.cispo_clip_low, 0.0), 1.0 + cfg.cispo_clip_high)
    clipped = r != w
    if inputs.behavior_weight is not None and not against_behavior:
        w = w * inputs.behavior_weight.detach().to(w.dtype)
    tok_loss = -advantages * w * logprobs
    _keep(inputs, r, clipped, None, None)
    loss = agg_loss(tok_loss, mask, cfg.loss_agg_mode, norm=cfg.agg_norm)
    with torch.no_grad():
        stats = _ratio_stats(loss, torch.exp(log_ratio), log_ratio, clipped, mask, None)
        stats.update(dual_clip_frac=0.0, clipfrac_lower=0.0)
    return loss, stats


def _with_replayed_tokens(
    inputs: PolicyLossInputs, cfg: LossConfig, ratio: Tensor, on: tuple[Tensor, Tensor, Tensor], weight, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, dict[str, float]]:
    """Replayed tokens (``exp_mask``) take their own clip (``off_clip_high``) or ExGRPO's shaping: the
    per-token loss mixed from both, the clipped and dual-clipped flags, and the on/off statistics."""
    advantages, exp = inputs.advantages, inputs.exp_mask.to(inputs.logprobs.dtype)
    on_loss, clipped, dual = on
    if cfg.off_policy_reshape == "p_div_p_0.1":
        off_loss = -advantages * (ratio / (ratio + 0.1))
        off_clipped = torch.zeros_like(clipped)
        off_dual = torch.zeros_like(dual)
    else:
        hi = cfg.clip_high if cfg.off_clip_high is None else cfg.off_clip_high
        off_loss, off_clipped, off_dual = _clipped_pg(ratio, advantages, cfg.clip_low, hi, cfg.dual_clip_c)
    is_off = exp > 0
    on_clipped = clipped
    clipped = torch.where(is_off, off_clipped, clipped)
    dual = torch.where(is_off, off_dual, dual)
    tok_loss = (off_loss * exp + on_loss * (1.0 - exp)) * weight
    on_m, off_m = mask * (1.0 - exp), mask * exp
    with torch.no_grad():
        stats = dict(
            on_pg_loss=float(masked_mean(tok_loss, on_m)),
            off_pg_loss=float(masked_mean(tok_loss, off_m)),
            on_clipfrac=float(masked_mean(on_clipped.to(mask.dtype), on_m)),
            off_clipfrac=float(masked_mean(clipped.to(mask.dtype), off_m)),
            off_ratio_mean=_stat(ratio, off_m, "mean"),
            off_ratio_min=_stat(ratio, off_m, "min"),
            off_ratio_max=_stat(ratio, off_m, "max"),
            off_token_ratio=float(off_m.sum() / mask.sum().clamp(min=1e-8)),
        )
    return tok_loss, clipped, dual, stats
