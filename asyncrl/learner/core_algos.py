"""The learner's maths (DESIGN.md section 4): advantages, policy losses, aggregation, KL, entropy.

Shapes: ``N`` trajectories, ``B`` rows of a batch (one per trajectory), ``T`` target positions.
Every ``[B, T]`` tensor is aligned to the targets of :class:`asyncrl.learner.batch.TrainBatch`
(position ``j`` scores token ``j + 1`` of the padded sequence). Masks are float 0/1.

Estimators and losses live in registries keyed by name, as in verl::

    get_adv_estimator("grpo")(rewards, group_ids, norm_by_std=True)
    get_policy_loss("ppo")(logprobs, old_logprobs, advantages, mask, clip_low=0.2, ...)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "RegistryError", "register_adv_estimator", "get_adv_estimator", "register_policy_loss",
    "get_policy_loss", "adv_estimator_names", "policy_loss_names", "compute_grpo_advantages",
    "broadcast_advantages", "masked_mean", "agg_loss", "LOSS_AGG_MODES",
    "behavior_importance_weight", "replay_old_logprobs", "compute_policy_loss", "kl_penalty",
    "entropy_from_logits", "logprobs_from_logits",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
OFF_POLICY_RESHAPES = (None, "none", "p_div_p_0.1")
LOG_RATIO_CLAMP = 20.0


# ----------------------------------------------------------------------------------------------
# registries


class RegistryError(KeyError, ValueError):
    """An unknown registry name. Both a KeyError and a ValueError, so either ``except`` works."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


_ADV_ESTIMATORS: dict[str, Callable[..., Tensor]] = {}
_POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, float]]]] = {}


def _register(registry: dict, kind: str, name: str) -> Callable:
    def deco(fn: Callable) -> Callable:
        if name in registry and registry[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered ({registry[name].__qualname__})")
        registry[name] = fn
        return fn
    return deco


def _lookup(registry: dict, kind: str, name: str) -> Callable:
    try:
        return registry[name]
    except (KeyError, TypeError):
        raise RegistryError(f"unknown {kind} {name!r}; valid names: {', '.join(sorted(registry))}") from None


def register_adv_estimator(name: str) -> Callable:
    """Decorator: register an advantage estimator under ``name``."""
    return _register(_ADV_ESTIMATORS, "advantage estimator", name)


def get_adv_estimator(name: str) -> Callable[..., Tensor]:
    """The advantage estimator registered as ``name``; RegistryError lists the valid names."""
    return _lookup(_ADV_ESTIMATORS, "advantage estimator", name)


def register_policy_loss(name: str) -> Callable:
    """Decorator: register a policy loss under ``name``."""
    return _register(_POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str) -> Callable[..., tuple[Tensor, dict[str, float]]]:
    """The policy loss registered as ``name``; RegistryError lists the valid names."""
    return _lookup(_POLICY_LOSSES, "policy loss", name)


def adv_estimator_names() -> list[str]:
    return sorted(_ADV_ESTIMATORS)


def policy_loss_names() -> list[str]:
    return sorted(_POLICY_LOSSES)


# ----------------------------------------------------------------------------------------------
# advantages


@register_adv_estimator("grpo")
def compute_grpo_advantages(rewards: Tensor, group_ids: Sequence[str], norm_by_std: bool = True,
                            eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantage, one scalar per trajectory.

    Args:
        rewards: ``[N]`` float.
        group_ids: ``N`` group keys; trajectories with equal keys are normalised together.
        norm_by_std: ``A = (R - mean_g) / (std_g + eps)`` with the unbiased std (verl);
            ``False`` gives ``A = R - mean_g`` (Dr.GRPO, ExGRPO, RLCR).
    Returns:
        ``[N]`` advantages (same dtype as ``rewards``, no grad). A group of one gets 0: unlike verl
        (mean 0, std 1 there, so ``A = R``), a lone trajectory has no baseline to compare with.
    """
    rewards = torch.as_tensor(rewards).detach()
    if rewards.dim() != 1 or len(group_ids) != rewards.shape[0]:
        raise ValueError(f"rewards must be [N] with N == len(group_ids); got {tuple(rewards.shape)} "
                         f"and {len(group_ids)} group ids")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    adv = torch.zeros_like(rewards)
    for idx in members.values():
        if len(idx) < 2:
            continue
        ix = torch.tensor(idx, device=rewards.device)
        r = rewards[ix]
        a = r - r.mean()
        if norm_by_std:
            a = a / (r.std() + eps)
        adv[ix] = a
    return adv


def broadcast_advantages(adv: Tensor, mask: Tensor) -> Tensor:
    """Per-trajectory scalars ``adv[N]`` onto tokens: ``[N, T] = adv[:, None] * mask[N, T]``."""
    return adv.to(mask.dtype if mask.is_floating_point() else torch.float32)[:, None] * mask


# ----------------------------------------------------------------------------------------------
# aggregation


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``sum(values * mask) / sum(mask)`` over all elements; 0 (with grad) when the mask is empty."""
    return (values * mask).sum() / mask.sum().clamp(min=1e-8)


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", norm: float | None = None) -> Tensor:
    """Aggregate a per-token loss ``[B, T]`` under ``mask[B, T]`` into a scalar.

    - ``token-mean``: ``sum(loss * mask) / sum(mask)``.
    - ``seq-mean-token-sum``: mean over sequences of per-sequence sums.
    - ``seq-mean-token-mean``: mean over sequences of per-sequence masked means.
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): ``sum(loss * mask) / norm``, ``norm`` defaulting to
      ``T = mask.shape[-1]``; pass a constant ``norm`` (e.g. the max generation length) to keep the
      scale fixed across batches of different padded length.

    The two ``seq-mean`` modes leave out sequences whose mask is empty (current verl behaviour),
    so a fully masked row does not dilute the mean. An all-zero mask gives 0 connected to the graph.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "seq-mean-token-sum-norm":
        return (loss_mat * mask).sum() / (float(mask.shape[-1]) if norm is None else float(norm))
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
    the engine's at generation time. Equal inputs give exactly 1.
    """
    log_w = (old_logprobs - behavior_logprobs).clamp(max=LOG_RATIO_CLAMP)
    return torch.exp(log_w).clamp(max=cap).detach()


def replay_old_logprobs(old_logprobs: Tensor, recorded_logprobs: Tensor, exp_mask: Tensor) -> Tensor:
    """``[B, T]``: the recorded log-probs where ``exp_mask == 1`` (replayed tokens), else ``old``.

    ExGRPO's ``exp_is_correct``: the ratio of a replayed token is taken against the policy that
    recorded it, not against the current proximal policy.
    """
    return torch.where(exp_mask > 0, recorded_logprobs.to(old_logprobs.dtype), old_logprobs)


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


@register_policy_loss("ppo")
def compute_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    behavior_weight: Tensor | None = None,
    exp_mask: Tensor | None = None,
    off_clip_high: float | None = None,
    off_policy_reshape: str | None = None,
    agg_norm: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clip (clip-higher, dual clip) with decoupled staleness weights and replayed tokens.

    Args:
        logprobs: ``[B, T]`` current policy, with grad.
        old_logprobs: ``[B, T]`` proximal policy (for replayed tokens: the recorded log-probs, see
            :func:`replay_old_logprobs`).
        advantages: ``[B, T]``.
        mask: ``[B, T]`` response mask.
        behavior_weight: ``[B, T]`` detached weight (see :func:`behavior_importance_weight`) that
            multiplies every token's loss, replayed tokens included; None means 1.
        exp_mask: ``[B, T]``, 1 on replayed (off-policy) tokens (DESIGN 5.3).
        off_clip_high: upper clip ``1 + off_clip_high`` for replayed tokens (default: ``clip_high``).
        off_policy_reshape: ``"p_div_p_0.1"``: replayed tokens use the ExGRPO policy shaping
            ``L = -A * f(r)``, ``f(r) = r / (r + 0.1)``, unclipped, with ``r = exp(logp - logp_old)``
            the importance ratio against the recorded policy (ExGRPO paper, ``f(w) = w / (w + beta)``).
            LUFFY's code path of the same name shapes the bare probability ``exp(logp)`` instead
            (its off-policy data come from a teacher without log-probs); we have recorded ones.
        agg_norm: optional constant normaliser for ``seq-mean-token-sum-norm``.
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
    if off_policy_reshape not in OFF_POLICY_RESHAPES:
        raise ValueError(f"unknown off_policy_reshape {off_policy_reshape!r}; valid: none, p_div_p_0.1")
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    on_loss, clipped, dual = _clipped_pg(ratio, advantages, clip_low, clip_high, dual_clip_c)
    weight = 1.0 if behavior_weight is None else behavior_weight.detach().to(logprobs.dtype)

    stats: dict[str, float] = {}
    if exp_mask is None:
        tok_loss = on_loss * weight
    else:
        exp = exp_mask.to(logprobs.dtype)
        if off_policy_reshape == "p_div_p_0.1":
            off_loss = -advantages * (ratio / (ratio + 0.1))
            off_clipped = torch.zeros_like(clipped)
            off_dual = torch.zeros_like(dual)
        else:
            hi = clip_high if off_clip_high is None else off_clip_high
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

    loss = agg_loss(tok_loss, mask, loss_agg_mode, norm=agg_norm)
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
