"""The learner's optimizers: AdamW over what trains, and one guarded step (the policy's and the critic's)."""

from __future__ import annotations

import math

import torch

from . import distributed as dist_learner

__all__ = ["adamw", "apply_update", "lr_at"]


def lr_at(train_cfg, step: int) -> float:
    """The learning rate of policy version ``step`` (``train.lr_warmup_steps``, ``lr_schedule``,
    ``lr_min_ratio``): a linear warm-up to ``train.lr``, then constant or a linear/cosine decay to
    ``lr x lr_min_ratio`` at ``train.total_steps``."""
    lr, warmup = train_cfg.lr, train_cfg.lr_warmup_steps
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    if train_cfg.lr_schedule == "constant":
        return lr
    progress = min(1.0, max(0.0, (step - warmup) / max(1, train_cfg.total_steps - warmup)))
    shape = 1.0 - progress if train_cfg.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (train_cfg.lr_min_ratio + (1.0 - train_cfg.lr_min_ratio) * shape)


def adamw(params: list[torch.nn.Parameter], train_cfg, fused: bool = True) -> torch.optim.AdamW:
    """AdamW over ``params`` with ``train.lr``, ``betas`` and ``weight_decay``: torch's fused kernel
    where it takes the parameters (``fused``: CPU and CUDA floating-point tensors; about 5x faster
    than the per-tensor loop on the CPU, 10 of a 65 ms step for the 4.2M model), else the loop
    (FSDP2's sharded parameters)."""
    kwargs = dict(lr=train_cfg.lr, betas=tuple(train_cfg.betas), weight_decay=train_cfg.weight_decay)
    if fused:
        try:
            return torch.optim.AdamW(params, fused=True, **kwargs)
        except (RuntimeError, ValueError):  # a device or dtype the fused kernel does not take
            pass
    return torch.optim.AdamW(params, **kwargs)


def apply_update(
    optimizer: torch.optim.Optimizer, loss: float, max_norm: float, distributed: str, apply: bool = True
) -> dict[str, float]:
    """Clip the accumulated gradients of ``optimizer``'s parameters and take its step, unless the loss
    or the gradient norm is not finite on some rank, or not ``apply`` (the gradients are then
    dropped: ``critic.warmup_steps`` holds the policy). A parameter that got no gradient gets a zero
    one, so that AdamW's momentum moves it as in a pass that reached it with a zero gradient."""
    params = optimizer.param_groups[0]["params"]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor over the shards
        grad_norm = grad_norm.full_tensor()
    finite = math.isfinite(float(loss)) and bool(torch.isfinite(grad_norm))
    if distributed != "none":  # every rank takes the same branch (one rank's loss may be the bad one)
        finite = dist_learner.all_true(finite)
    if finite and apply:
        optimizer.step()
    else:  # never apply a NaN/inf update: the weights and the optimizer state stay as they were
        optimizer.zero_grad(set_to_none=True)
    return {"loss": loss, "grad_norm": float(grad_norm), "skipped_nonfinite": float(not finite)}
