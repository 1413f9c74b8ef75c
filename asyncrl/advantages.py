"""Rewards -> advantages, for every algorithm, on either side of the wire.

Estimators live in a registry keyed by ``train.advantage.estimator`` (verl's shape: one scalar per
trajectory from the rewards of its group). The learner applies :func:`trajectory_advantages` to
every batch; a workflow that needs its own normalisation (RLCR's two levels) calls the same
estimators on the actor and carries the result in ``Trajectory.advantage``. Either way the
trajectory's typed ``advantage_scale`` (e.g. Absolute Zero's proposer weight) multiplies the result.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import torch
from torch import Tensor

from .registry import Registry
from .types import Trajectory

ADV_ESTIMATORS: Registry[Callable[..., Tensor]] = Registry("advantage estimator")


@ADV_ESTIMATORS.register("grpo")
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


def trajectory_advantages(trajs: list[Trajectory], adv_cfg) -> Tensor:
    """Scalar advantage per trajectory ``[N]``: the estimator over ``group_id`` groups; a trajectory
    that carries its own (``Trajectory.advantage``, e.g. RLCR) keeps it. Each is then multiplied by
    its ``advantage_scale``."""
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    adv = ADV_ESTIMATORS.get(adv_cfg.estimator)(rewards, [t.group_id for t in trajs], norm_by_std=adv_cfg.norm_by_std)
    own = torch.tensor([t.advantage if t.advantage is not None else 0.0 for t in trajs], dtype=torch.float32)
    has_own = torch.tensor([t.advantage is not None for t in trajs])
    scale = torch.tensor([t.advantage_scale for t in trajs], dtype=torch.float32)
    return torch.where(has_own, own, adv) * scale
