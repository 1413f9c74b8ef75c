"""The learner over several processes (issue 15, first piece): DDP or FSDP2 on a process group.

Promised here, used by nothing else yet (the Learner loop is not wired to it):
- ``init_from_env`` joins the group that ``torchrun`` / ``accelerate launch`` describe in the
  environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), gloo on CPU, with a timeout on every
  collective so a killed rank ends the others with an error instead of a hang.
- ``wrap`` puts a model under DistributedDataParallel (gradients averaged) or under FSDP2's
  ``fully_shard`` on a 1-D device mesh (parameters sharded).
- ``full_state_dict`` gives the full, unsharded parameters (what actors and checkpoints need).
Gradient averaging equals the one-process gradient only when each rank's loss is its share of
the global normalisation: ``rank_loss_scale`` gives that factor.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_from_env(timeout_s: float = 60.0) -> tuple[int, int]:
    """Join the process group named by the launcher's environment; returns (rank, world_size)."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise RuntimeError(f"distributed.init_from_env: {name} is not set; start under "
                               "torchrun or accelerate launch")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Wrap ``model`` for ``mode`` 'ddp' or 'fsdp2'; 'none' returns it unchanged."""
    if mode == "none":
        return model
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        device = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(f"distributed.wrap: mode {mode!r} unknown; expected 'none', 'ddp' or 'fsdp2'")


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full parameters on every rank (gathered from shards under FSDP2), CPU tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {k: v.detach().cpu() for k, v in get_model_state_dict(model, options=opts).items()}


def rank_loss_scale(local_tokens: int) -> float:
    """Factor for a rank's token-sum loss so that averaged gradients equal the global token mean.

    DDP/FSDP average gradients over ``W`` ranks; a rank whose loss is ``sum_local / N_global * W``
    contributes exactly its share of ``sum_all / N_global``.
    """
    if not dist.is_initialized():
        return 1.0 / max(local_tokens, 1)
    n = torch.tensor([float(local_tokens)])
    dist.all_reduce(n)
    return dist.get_world_size() / max(n.item(), 1.0)
