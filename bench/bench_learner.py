"""Learner step time and samples/s with 1 and 2 learner processes (issue 15).

    .venv/bin/python bench/bench_learner.py [--batch 32] [--steps 8] [--prompt 16] [--response 32]
        [--setups 1x2 1x1 2x1:ddp 2x1:fsdp2] [-o KEY=VALUE ...]

Each setup ``PROCSxTHREADS[:MODE]`` runs the learner's real training step
(:class:`asyncrl.learner.training.trainer.PolicyTrainer`, the config's loss, AdamW) on the model the config
selects (default: the embedded quick-start model) over a fixed batch of ``--batch`` trajectories of
``--prompt`` + ``--response`` tokens (``--group`` completions per prompt, sharing it; or
``--distinct-prompts``), in PROCS processes of THREADS torch threads each (a gloo group
on loopback for PROCS > 1, DDP or FSDP2). Rank 0 times ``--steps`` steps after one warm-up step and
prints the median step time and trajectories/s; under FSDP2 the step includes gathering the full
parameters (what the learner publishes). On a CUDA machine run it with ``-o train.device=cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args) -> None:
    """One rank: build the trainer, time the steps, rank 0 prints one JSON line."""
    import numpy as np
    import torch

    from asyncrl.config import load_config
    from asyncrl.learner.ingest.staleness import StalenessPolicy
    from asyncrl.learner.training import distributed
    from asyncrl.learner.training.ranks import make_trainer
    from asyncrl.models.loading import load_policy
    from asyncrl.types import Trajectory

    torch.set_num_threads(args.threads)
    world = distributed.launched_world()
    rank = 0
    if world > 1:
        rank, _ = distributed.init_from_env(300)
    cfg = load_config(None, args.override)
    model, tok, _ = load_policy(cfg.model, cfg.seed, cfg.train.device)
    trainer = make_trainer(cfg, model, tok, args.mode if world > 1 else "none", StalenessPolicy.from_config(cfg))
    rng = np.random.default_rng(0)
    n = args.prompt + args.response
    mask = np.r_[np.zeros(args.prompt), np.ones(args.response)]
    prompts = [rng.integers(4, len(tok), args.prompt) for _ in range(-(-args.batch // args.group))]
    trajs = []
    for i in range(args.batch):
        ids = rng.integers(4, len(tok), n)
        if not args.distinct_prompts:  # a group's completions share its prompt, as in GRPO
            ids[: args.prompt] = prompts[i // args.group]
        trajs.append(
            Trajectory(
                token_ids=ids,
                loss_mask=mask,
                behavior_logprobs=-rng.uniform(0.5, 3.0, n) * mask,
                policy_version=0,
                reward=float(i % 2),
                group_id=str(i // args.group),
            )
        )
    times = []
    for i in range(args.steps + 1):
        batch = trainer.make_batch([type("E", (), {"trajectories": trajs})()])
        if world > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        trainer.step(batch, version=0)
        if args.mode == "fsdp2" and world > 1:
            distributed.full_state_dict(trainer.model)
        if world > 1:
            torch.distributed.barrier()
        if i:  # the first step warms up
            times.append(time.perf_counter() - t0)
    if rank == 0:
        params = sum(p.numel() for p in distributed.unwrap(trainer.model).parameters())
        print(
            json.dumps(
                {
                    "step_s": float(np.median(times)),
                    "min_s": float(np.min(times)),
                    "max_s": float(np.max(times)),
                    "params": int(params),
                }
            ),
            flush=True,
        )
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run_setup(setup: str, args) -> dict:
    shape, _, mode = setup.partition(":")
    procs, threads = (int(x) for x in shape.split("x"))
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--threads",
        str(threads),
        "--mode",
        mode or "ddp",
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--prompt",
        str(args.prompt),
        "--response",
        str(args.response),
        "--group",
        str(args.group),
        *(["--distinct-prompts"] if args.distinct_prompts else []),
        *[x for o in args.override for x in ("-o", o)],
    ]
    group = {"WORLD_SIZE": str(procs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    running = []
    for rank in range(procs):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if procs > 1:
            env.update(group, RANK=str(rank), LOCAL_RANK=str(rank))
        running.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=1800) for p in running]
    finally:
        for p in running:
            if p.poll() is None:
                p.kill()
    for rank, (p, (_out, err)) in enumerate(zip(running, outs)):
        if p.returncode != 0:
            raise SystemExit(f"{setup}: rank {rank} exited {p.returncode}:\n{err[-2000:]}")
    line = [x for x in outs[0][0].splitlines() if x.startswith("{")][-1]
    return {
        "setup": setup,
        "procs": procs,
        "threads": threads,
        "mode": (mode or "ddp") if procs > 1 else "none",
        **json.loads(line),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--setups", nargs="+", default=["1x2", "1x1", "2x1:ddp", "2x1:fsdp2"], help="PROCSxTHREADS[:ddp|fsdp2] each"
    )
    ap.add_argument("--batch", type=int, default=32, help="trajectories per step (the quick start's: 8 x 4)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (they share its tokens)")
    ap.add_argument(
        "--distinct-prompts",
        action="store_true",
        help="every trajectory its own prompt (nothing for train.shared_prefix to share)",
    )
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="ddp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from tqdm import tqdm

    rows = []
    for setup in tqdm(args.setups, desc="setups", file=sys.stderr):
        rows.append(run_setup(setup, args))
    print(
        f"learner step: {args.batch} trajectories of {args.prompt} + {args.response} tokens, "
        f"{rows[0]['params']:,} parameters, median of {args.steps} steps"
    )
    print(f"{'setup':<12} {'procs':>5} {'threads':>7} {'mode':>6} {'step s':>8} {'traj/s':>8} {'min-max s':>14}")
    for r in rows:
        print(
            f"{r['setup']:<12} {r['procs']:>5} {r['threads']:>7} {r['mode']:>6} {r['step_s']:>8.3f} "
            f"{args.batch / r['step_s']:>8.1f} {r['min_s']:>6.3f}-{r['max_s']:<6.3f}"
        )


if __name__ == "__main__":
    main()
