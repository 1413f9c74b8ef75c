"""PPO with a critic: per-token rewards, GAE, the clipped value loss and its metrics.

``train.advantage.estimator: gae`` (:data:`.advantages.ADV_ESTIMATORS` names it; the learner's
critic, :mod:`asyncrl.learner.training.critic`, computes it per token). Every tensor is ``[B, T]``
over a batch's target positions (:class:`asyncrl.learner.training.batch.TrainBatch`); ``mask`` is
the response mask: 1 on the tokens the policy generated and trains on, 0 on the prompt, on
environment tokens between turns and past a row's end.

- :func:`token_rewards`: each row's scalar reward on its last trained token, 0 elsewhere.
- :func:`gae`: Generalised Advantage Estimation (Schulman et al. 2016) over each row's trained
  tokens in order, the others skipped: ``delta_t = r_t + gamma V(s_next) - V(s_t)``,
  ``A_t = delta_t + gamma lam A_next`` where *next* is the row's next trained token (none after
  the last: ``V = 0``, ``A = 0``); ``returns = A + V``. An environment's tokens between two turns
  neither add a TD error nor break the chain: the semantics of verl's
  ``compute_gae_advantage_return``, which carries the next value and advantage through masked positions.
- :func:`masked_whiten`: the advantages whitened over the batch's trained tokens (verl's
  ``masked_whiten``: mean subtracted, times ``rsqrt(var + 1e-8)`` with the unbiased variance).
- :func:`value_loss`: ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`` token-mean
  (verl's ``compute_value_loss``; ``c`` None: unclipped), and the clipped share.
- :func:`explained_variance`: ``1 - Var(R - V) / Var(R)`` over trained tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import masked_mean

__all__ = ["explained_variance", "gae", "masked_whiten", "token_rewards", "value_loss"]


def _check_shapes(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or any(len(s) != 2 for s in shapes.values()):
        raise ValueError(f"expected [B, T] tensors of one shape; got {shapes}")


def token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]``: ``rewards[b]`` on row ``b``'s last trained token (``mask > 0``), 0 elsewhere; a row
    with no trained token gets none."""
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"got {tuple(rewards.shape)} rewards for {mask.shape[0]} rows")
    trained = mask > 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(trained, positions, torch.full_like(positions, -1)).max(1).values
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = rewards.to(out.device, out.dtype)[rows]
    return out


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """``(advantages, returns)``, ``[B, T]`` each, 0 off the mask (see the module docstring): each
    row's trained tokens are gathered to the left, the backward recursion runs over them (one vector
    step per token position of the longest row), and the results go back to their positions."""
    _check_shapes(rewards=rewards, values=values, mask=mask)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae: gamma={gamma} and lam={lam} must lie in [0, 1]")
    trained = mask > 0
    counts = trained.sum(1)
    B, width = mask.shape[0], int(counts.max()) if mask.numel() else 0
    adv = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if width == 0:
        return adv, adv.clone()
    # the k-th trained token of each row: a stable sort of (not trained) puts them first, in order
    order = torch.sort((~trained).to(torch.int8), dim=1, stable=True).indices[:, :width]
    valid = torch.arange(width, device=mask.device)[None, :] < counts[:, None]
    r = torch.where(valid, rewards.float().gather(1, order), 0.0)
    v = torch.where(valid, values.float().gather(1, order), 0.0)
    packed = torch.zeros((B, width), dtype=torch.float32, device=mask.device)
    next_v = torch.zeros(B, device=mask.device)
    next_a = torch.zeros(B, device=mask.device)
    for k in range(width - 1, -1, -1):  # (past a row's count: V = 0, A = 0, so its last token sees none)
        a = r[:, k] + gamma * next_v - v[:, k] + gamma * lam * next_a
        a = torch.where(valid[:, k], a, 0.0)
        packed[:, k] = a
        next_v, next_a = v[:, k], a
    adv.scatter_(1, order, torch.where(valid, packed, 0.0))
    adv = torch.where(trained, adv, 0.0)
    returns = torch.where(trained, adv + values.float(), 0.0)
    return adv, returns


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """``values`` whitened over ``mask``'s elements: mean subtracted (``shift_mean``; else added back),
    times ``rsqrt(var + 1e-8)`` with the unbiased variance; fewer than two elements: zeros."""
    m = mask.to(torch.float64)
    n = float(m.sum())
    if n < 2:
        return torch.zeros_like(values)
    x = values.to(torch.float64)
    mean = (x * m).sum() / n
    var = (((x - mean) ** 2) * m).sum() / n * (n / (n - 1.0))
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out.to(values.dtype)


def value_loss(
    vpreds: Tensor, returns: Tensor, old_values: Tensor, mask: Tensor, cliprange: float | None
) -> tuple[Tensor, Tensor]:
    """``(loss, clipfrac)``: the token-mean of ``0.5 * max((V - R)^2, (V_clip - R)^2)`` over ``mask``,
    ``V_clip = old + clamp(V - old, -cliprange, cliprange)`` (None: ``0.5 (V - R)^2``, clipfrac 0), and
    the share of trained tokens where the clipped term is the larger."""
    _check_shapes(vpreds=vpreds, returns=returns, old_values=old_values, mask=mask)
    unclipped = (vpreds - returns) ** 2
    if cliprange is None:
        return 0.5 * masked_mean(unclipped, mask), torch.zeros((), device=vpreds.device)
    clipped_v = old_values + (vpreds - old_values).clamp(-cliprange, cliprange)
    clipped = (clipped_v - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).float(), mask).detach()


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over ``mask``'s elements (1: the values predict the returns; 0: no
    better than their mean; negative: worse). NaN when the returns do not vary."""
    m = mask.to(torch.float64) > 0
    r, v = returns.to(torch.float64)[m], values.to(torch.float64)[m]
    if r.numel() < 2:
        return float("nan")
    var_r = float(r.var(unbiased=False))
    return 1.0 - float((r - v).var(unbiased=False)) / var_r if var_r > 0 else float("nan")
