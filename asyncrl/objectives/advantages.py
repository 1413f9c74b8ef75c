"""Rewards -> advantages, for every algorithm, on either side of the wire.

Estimators live in a registry keyed by ``train.advantage.estimator`` (verl's shape: one scalar per
trajectory from the rewards of its group). The learner applies :func:`trajectory_advantages` to
every batch; a workflow that needs its own normalisation (RLCR's two levels) calls the same
estimators on the actor and carries the result in ``Trajectory.advantage``. Either way the
trajectory's typed ``advantage_scale`` (e.g. Absolute Zero's proposer weight) multiplies the result.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence, get_args

import torch
from torch import Tensor

from ..config import AdvantageConfig
from ..registry import Registry
from ..types import Trajectory

ADV_ESTIMATORS: Registry[Callable[..., Tensor]] = Registry("advantage estimator")


_ADV = AdvantageConfig.model_fields  # the choices and defaults are the config's, declared once there
SINGLETON_RULES = get_args(_ADV["singleton"].annotation)
STD_ESTIMATORS = get_args(_ADV["std"].annotation)
# ``train.advantage`` settings an estimator takes as keyword arguments when they differ from their defaults
_OPTIONS = ("singleton", "std")


@ADV_ESTIMATORS.register("grpo")
def compute_grpo_advantages(rewards: Tensor, group_ids: Sequence[str], norm_by_std: bool = _ADV["norm_by_std"].default,
                            eps: float = 1e-6, singleton: str = _ADV["singleton"].default,
                            std: str = _ADV["std"].default) -> Tensor:
    """GRPO outcome advantage, one scalar per trajectory (Shao et al. 2024, DeepSeekMath).

    Args:
        rewards: ``[N]`` float.
        group_ids: ``N`` group keys; trajectories with equal keys are normalised together.
        norm_by_std: ``A = (R - mean_g) / (std_g + eps)``; ``False`` gives ``A = R - mean_g``
            (Dr.GRPO, Liu et al. 2025; ExGRPO; RLCR).
        singleton: a group of one: ``"zero"`` (ours: a lone trajectory has no baseline, A = 0) or
            ``"verl"`` (verl's convention, mean 0 and std 1: ``A = R / (1 + eps)`` with
            ``norm_by_std``, ``A = R`` without).
        std: ``"unbiased"`` (divide by n - 1, verl's ``torch.std``) or ``"population"`` (divide by
            n; the RLCR reference design's formula).
    Returns:
        ``[N]`` advantages (same dtype as ``rewards``, no grad). Computed in float64, and a group
        whose rewards are all equal gets exactly 0 (in float32 the mean of eight rewards of 0.7 is
        off by ~6e-8, which ``/ (std + 1e-6)`` would turn into advantages of ~0.06).
    """
    if singleton not in SINGLETON_RULES:
        raise ValueError(f"unknown singleton rule {singleton!r}; valid: {', '.join(SINGLETON_RULES)}")
    if std not in STD_ESTIMATORS:
        raise ValueError(f"unknown std estimator {std!r}; valid: {', '.join(STD_ESTIMATORS)}")
    rewards = torch.as_tensor(rewards).detach()
    if rewards.dim() != 1 or len(group_ids) != rewards.shape[0]:
        raise ValueError(f"rewards must be [N] with N == len(group_ids); got {tuple(rewards.shape)} "
                         f"and {len(group_ids)} group ids")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r64 = rewards.to(torch.float64)
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    adv = torch.zeros_like(r64)
    for idx in members.values():
        ix = torch.tensor(idx, device=rewards.device)
        r = r64[ix]
        if len(idx) < 2:
            if singleton == "verl":  # verl: mean 0, std 1 for a group of one
                adv[ix] = r / (1.0 + eps) if norm_by_std else r
            continue
        if bool((r == r[0]).all()):
            continue  # equal rewards: exactly 0, whatever the rounding of mean and std
        a = r - r.mean()
        if norm_by_std:
            a = a / (r.std(unbiased=(std == "unbiased")) + eps)
        adv[ix] = a
    return adv.to(out_dtype)


def estimator_options(adv_cfg) -> dict:
    """The ``train.advantage`` settings beyond ``norm_by_std`` (``singleton``, ``std``) that differ
    from their defaults, as keyword arguments: an estimator registered without them keeps working
    as long as they are left at their defaults."""
    defaults = {k: _ADV[k].default for k in _OPTIONS}
    return {k: v for k, d in defaults.items() if (v := getattr(adv_cfg, k, d)) != d}


def trajectory_advantages(trajs: list[Trajectory], adv_cfg, estimator: Callable[..., Tensor] | None = None) -> Tensor:
    """Scalar advantage per trajectory ``[N]``: the estimator over ``group_id`` groups; a trajectory
    that carries its own (``Trajectory.advantage``, e.g. RLCR) keeps it. Each is then multiplied by
    its ``advantage_scale``. ``estimator``: ``train.advantage.estimator`` already looked up (the trainer
    does so once)."""
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
    estimator = estimator or ADV_ESTIMATORS.get(adv_cfg.estimator)
    adv = estimator(rewards, [t.group_id for t in trajs], norm_by_std=adv_cfg.norm_by_std, **estimator_options(adv_cfg))
    own = torch.tensor([t.advantage if t.advantage is not None else 0.0 for t in trajs], dtype=torch.float32)
    has_own = torch.tensor([t.advantage is not None for t in trajs])
    scale = torch.tensor([t.advantage_scale for t in trajs], dtype=torch.float32)
    return (torch.where(has_own, own.double(), adv.double()) * scale.double()).float()
