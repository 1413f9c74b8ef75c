"""One AdamW step of a tiny real model on a fixed batch, split over ranks; run under torchrun.

argv: mode (none|ddp|fsdp2), output path. Rank 0 writes the full parameters after the step.
"""
import sys

import torch
from safetensors.torch import save_file

from asyncrl.learner import distributed


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    rank, world = distributed.init_from_env(timeout_s=60) if mode != "none" else (0, 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    counts = [2, 4]                  # unequal shares: the loss scale must make up for it
    lo = sum(counts[:rank]) if world > 1 else 0
    hi = lo + counts[rank] if world > 1 else 6
    model = distributed.wrap(model, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    err = ((model(x[lo:hi]) - y[lo:hi]) ** 2).sum(dim=1)
    loss = err.sum() * distributed.rank_loss_scale(hi - lo)
    loss.backward()
    opt.step()
    state = distributed.full_state_dict(model)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, out)  # (never pickle between processes)
    if world > 1:
        torch.distributed.barrier()  # both ranks past the state-dict gather before the group goes
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
