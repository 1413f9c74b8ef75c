"""One real PolicyTrainer step of the tiny embedded model on a fixed collated batch, per loss
aggregation mode; run as one rank of a gloo group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set
by the test) or imported by the test for the one-process reference.

argv: output folder, then the config overrides that select the tiny model. Rank 0 writes, for each
distributed mode and ``loss_agg_mode``, ``<mode>_<agg>.safetensors`` (full parameters as
``param/<name>`` and full gradients as ``grad/<name>``, after the step) and ``<mode>_<agg>.json``
(the step's metrics). safetensors and JSON, never pickle, between processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from asyncrl.learner.training import distributed
from asyncrl.objectives.aggregation import LOSS_AGG_MODES
from asyncrl.types import Trajectory
from tests.support.plugins import cpu_varlen

# gradient clipping off (so that the gradient's scale, not only its direction, is compared) and both
# token-mean side terms on (their scaling is checked together with the policy loss's)
STEP_OVERRIDES = ["train.max_grad_norm=1e6", "train.lr=1e-3", "train.kl_coef=0.05", "train.entropy_coef=0.01"]


def trajectories(vocab: int, shared_prompts: bool = False, equal_b: bool = False) -> list[Trajectory]:
    """Five rows in two groups, unequal lengths and response lengths, one replayed row with
    recorded log-probs: the two ranks' shares (3 and 2 rows) hold different token counts. With
    ``shared_prompts`` each group's rows start with the same 8-token prompt (the packed forward
    reads one copy of it, on each rank). ``equal_b``: group b's rewards are equal (advantage 0),
    so that rank 1 has no row that carries a gradient."""
    rng = np.random.default_rng(7)
    shapes = (
        [(13, 8, "a", 1.0), (16, 8, "a", 0.0), (11, 8, "a", 1.0), (14, 8, "b", 0.0), (10, 8, "b", 1.0)]
        if shared_prompts
        else [(9, 4, "a", 1.0), (12, 3, "a", 0.0), (7, 4, "a", 1.0), (10, 2, "b", 0.0), (6, 3, "b", 1.0)]
    )
    prompts = {g: rng.integers(4, vocab, 8) for g in "ab"}
    out = []
    for i, (n, prompt, group, reward) in enumerate(shapes):
        reward = 1.0 if equal_b and group == "b" else reward
        mask = np.r_[np.zeros(prompt), np.ones(n - prompt)]
        ids = rng.integers(4, vocab, n)
        if shared_prompts:
            ids[:prompt] = prompts[group]
        out.append(
            Trajectory(
                token_ids=ids,
                loss_mask=mask,
                behavior_logprobs=-rng.uniform(0.5, 3.0, n) * mask,
                policy_version=0,
                reward=reward,
                group_id=group,
                is_replay=i == 3,
                recorded_logprobs=(-2.0 * mask) if i == 3 else None,
            )
        )
    return out


# name -> overrides: every loss aggregation mode in one step, and two mini-batches (two optimizer
# steps, each mini-batch split over the ranks, proximal log-probs from a full-batch forward first)
CASES = {
    **{agg: [f"train.loss_agg_mode={agg}"] for agg in LOSS_AGG_MODES},
    "two_minibatches": ["train.mini_batches=2"],
    "shared_prefix": ["train.shared_prefix=true"],  # with trajectories(shared_prompts=True)
    "padded": ["train.packing=false"],  # the padded forward (the reference layout)
    # issue 44: micro-batches of a token budget (rank 0 runs 3, rank 1 runs 2 and one empty one), and rows
    # left out (group b's equal rewards: one process leaves them out; rank 1, which has no other rows, runs
    # them with a zero gradient for its metrics)
    **{f"micro_{agg}": [f"train.loss_agg_mode={agg}", "train.micro_batch_tokens=12"] for agg in LOSS_AGG_MODES},
    "skip_rows": ["train.kl_coef=0", "train.entropy_coef=0", "train.skip_zero_advantage=true"],
    "lora": ["model.lora.rank=4"],  # adapters only (issue 32), B drawn non-zero so that A has gradients too
    # issue 46: PPO with a critic (values of every row on every rank, GAE, the clipped value loss and the
    # critic's own AdamW step on each rank's rows, over two mini-batches); its head drawn non-zero
    "gae": [
        "train.advantage.estimator=gae",
        "train.advantage.lam=0.9",
        "train.advantage.gamma=0.99",
        "critic.lam=1.0",
        "critic.lr=1e-4",
        "critic.cliprange_value=0.2",
        "critic.max_grad_norm=1e6",
        "train.mini_batches=2",
    ],
    "gae_lora": ["train.advantage.estimator=gae", "model.lora.rank=4", "critic.lr=1e-3", "critic.max_grad_norm=1e6"],
    # issue 62: the flat varlen layout (torch's kernel is CUDA's: tests.support.plugins.cpu_varlen), with
    # micro-batches, and with a critic and LoRA adapters
    "varlen": ["train.attention=varlen", "train.micro_batch_tokens=12"],
    "varlen_gae_lora": [
        "train.attention=varlen",
        "train.advantage.estimator=gae",
        "model.lora.rank=4",
        "critic.lr=1e-3",
        "critic.max_grad_norm=1e6",
    ],
}


def one_step(overrides: list[str], mode: str, case: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Load the tiny model afresh, take one PolicyTrainer step (``keep_rows``) under ``mode`` for
    ``CASES[case]``; returns the tensors after it and the step's metrics. Tensors: ``param/<name>``
    and ``grad/<name>`` (full, on every rank), ``rows/logprobs`` and ``rows/entropy`` (every row of
    the batch), ``state/<name>`` (:func:`distributed.full_state_dict`: what a learner would
    publish) and ``optim/<name>/<key>`` (:func:`distributed.optimizer_state`: what a checkpoint
    saves); the last two on rank 0 only under a process group."""
    from asyncrl.config import load_config
    from asyncrl.models.loading import load_policy

    cfg = load_config(None, [*overrides, *STEP_OVERRIDES, *CASES[case]])
    torch.manual_seed(0)
    model, tok, _ = load_policy(cfg.model, cfg.seed)
    if cfg.model.lora is not None:
        from asyncrl.models.lora import with_adapters

        model = with_adapters(model, cfg.model, cfg.seed)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    with cpu_varlen() if cfg.train.attention == "varlen" else contextlib.nullcontext():
        return _step(cfg, model, tok, mode, case)


def _step(cfg, model, tok, mode: str, case: str) -> tuple[dict[str, torch.Tensor], dict]:
    from asyncrl.learner.training.trainer import PolicyTrainer

    trainer = PolicyTrainer(model, tok, cfg.train, 1.0, distributed=mode, critic_cfg=cfg.critic, model_cfg=cfg.model)
    if trainer.critic is not None:  # a head that is not zero, so that its body gets gradients too
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, p in distributed.unwrap(trainer.critic.model).named_parameters():
                if "lm_head" in name:
                    full = torch.randn(tuple(p.shape), generator=gen) * 0.5
                    if hasattr(p, "full_tensor"):  # FSDP2: this rank's shard of it
                        from torch.distributed.tensor import distribute_tensor

                        full = distribute_tensor(full, p.device_mesh, p.placements)
                    p.copy_(full)
    rows = trajectories(len(tok), shared_prompts=case == "shared_prefix", equal_b=case == "skip_rows")
    batch = trainer.make_batch([type("E", (), {"trajectories": rows})()])
    result = trainer.step(batch, keep_rows=case != "skip_rows", version=0)  # kept rows are never left out
    inner = distributed.unwrap(trainer.model)
    # rows/valid: the real (unpadded) target positions; padded ones hold whatever a forward left there
    out = {"rows/valid": batch.attention_mask[:, 1:].cpu().to(torch.uint8)}
    if result.row_logprobs is not None:
        out.update({"rows/logprobs": result.row_logprobs, "rows/entropy": result.row_entropy})
    for k, p in inner.named_parameters():  # under FSDP2 each full_tensor() is a collective
        out[f"param/{k}"] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
        if p.requires_grad:  # (model.lora: the base weights are frozen)
            out[f"grad/{k}"] = distributed.full_grad(p)
    out.update({f"state/{k}": v for k, v in distributed.full_state_dict(trainer.model).items()})
    # the optimizer state as a checkpoint saves it (by parameter name, gathered from the shards)
    for name, entry in distributed.optimizer_state(trainer.model, trainer.optimizer).get("state", {}).items():
        out.update({f"optim/{name}/{key}": torch.as_tensor(v).detach().cpu() for key, v in entry.items()})
    if trainer.critic is not None:  # the critic's parameters, gradients and optimizer state; the advantages
        out["rows/advantages"] = batch.advantages.detach().cpu()
        out["rows/returns"] = batch.returns.detach().cpu()
        for k, p in distributed.unwrap(trainer.critic.model).named_parameters():
            out[f"critic_param/{k}"] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            if p.requires_grad:
                out[f"critic_grad/{k}"] = distributed.full_grad(p)
        state = distributed.optimizer_state(trainer.critic.model, trainer.critic.optimizer)
        for name, entry in state.get("state", {}).items():
            out.update({f"optim/critic/{name}/{key}": torch.as_tensor(v).detach().cpu() for key, v in entry.items()})
    return out, result.stats


def stalled_peer() -> None:
    """``--stalled-peer``: rank 1 joins the group and then never enters a collective (a hung
    rank); rank 0's first collective must fail after the group's 3 s timeout: it prints the error
    and exits 3. The test kills rank 1."""
    rank, _ = distributed.init_from_env(timeout_s=3)
    if rank == 1:
        time.sleep(600)  # stands for a rank that hangs; killed by the test long before
        return
    started = time.monotonic()
    try:
        distributed.step_totals(torch.ones(2, 3), 1)
    except Exception as exc:  # noqa: BLE001 - the point is that it raises at all, and when
        print(
            f"collective failed after {time.monotonic() - started:.1f}s: {type(exc).__name__}: {exc}"[:500], flush=True
        )
        os._exit(3)  # the group is broken: no orderly destroy
    print("collective returned without the other rank", flush=True)


def assert_matches(got: dict, ref: dict, label: str, tol: float = 1e-5) -> None:
    """Every tensor of a group's step (``got``) within ``tol`` of one process's (``ref``)."""
    assert got.keys() == ref.keys(), (label, sorted(got.keys() ^ ref.keys()))
    for k in ref:
        a, b = got[k], ref[k]
        if k.startswith("rows/"):  # padded positions hold junk that depends on the forward's shape
            a, b = a * ref["rows/valid"], b * ref["rows/valid"]
        diff = float((a - b).abs().max())
        assert diff <= tol, f"{label} {k}: max abs difference {diff}"


def main() -> None:
    """Ranks from the environment; ``DIST_WORKER_CASES`` (comma-separated) limits the cases and
    ``DIST_WORKER_CURVE`` gives the group store's CURVE keys (ranks on several hosts)."""
    if sys.argv[1] == "--stalled-peer":
        return stalled_peer()
    out_dir, overrides = Path(sys.argv[1]), sys.argv[2:]
    rank, _ = distributed.init_from_env(timeout_s=60, curve_dir=os.environ.get("DIST_WORKER_CURVE"))
    cases = os.environ["DIST_WORKER_CASES"].split(",") if os.environ.get("DIST_WORKER_CASES") else list(CASES)
    for mode in ("ddp", "fsdp2"):
        for case in cases:
            tensors, stats = one_step(overrides, mode, case)
            if rank == 0:
                save_file(
                    {k: v.clone().contiguous() for k, v in tensors.items()}, out_dir / f"{mode}_{case}.safetensors"
                )
                (out_dir / f"{mode}_{case}.json").write_text(json.dumps(stats))
    torch.distributed.barrier()  # both ranks past every collective before the group goes
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
