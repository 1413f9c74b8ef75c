"""The learner's step on real rollouts: padded against packed, micro-batched, with the rows that carry
no gradient left out (issue 44).

    .venv/bin/python bench/bench_packing.py [--workloads quickstart longtail raw4m] [--steps 8]
        [--variants packed padded] [--batches DIR] [--root DIR] [--threads 2] [--json FILE]

For each workload the embedded model of its config (built on first use) rolls out ``--steps`` + 1
batches of real episodes with the HF engine and the config's workflow, environment and reward
(saved as JSON under ``--batches`` and reused, so that every variant and another checkout train on
the same batches). Each variant then trains a fresh copy of the model on them, one
:class:`PolicyTrainer` step per batch, the first a warm-up; printed per variant: the median step
time, the batch's real tokens (every row's tokens) per second of step, the padding share of the
slots the forward ran, the share of rows left out, and the real-token FLOP rate (``6 x parameters
x real tokens / step time``, the parameter count standing for the work per token, embedding included)
as a share of this machine's measured float32 matmul peak, and the executed FLOP rate (the same over
the slots the forward actually ran). The real-token rate can pass 100%: a shared prompt is run once
per bin and a row left out is not run at all, so the batch is got through faster than its tokens'
arithmetic would take at the peak; the executed rate is the hardware's utilisation.

Variants: ``packed`` (this checkout's defaults: packing, shared prompts, skipping), ``padded``
(``train.packing=false``, no skipping: every row padded to the longest) and ``default`` (whatever
the checkout's defaults are: with ``--root`` an older checkout, imported instead of this one, for
the before figure; its padding share is computed from the batch). Ratios from one run on a noisy
machine, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS: dict[str, tuple[str, list[str]]] = {
    "quickstart": ("configs/quickstart.yaml", []),
    "longtail": ("examples/longtail.yaml", []),
    "raw4m": (
        "configs/quickstart.yaml",
        [
            "model.embedded.prompt_format=raw",
            "model.embedded.hidden_size=256",
            "model.embedded.intermediate_size=1024",
            "model.embedded.num_heads=8",
        ],
    ),
}
VARIANTS = {
    "packed": ["train.packing=true", "train.skip_zero_advantage=true"],
    "padded": ["train.packing=false", "train.skip_zero_advantage=false"],
    "default": [],
}
TRAJ_FIELDS = ("token_ids", "loss_mask", "behavior_logprobs")


def matmul_peak(threads: int, size: int = 1024, repeats: int = 20) -> float:
    """float32 GFLOP/s of a ``size``-square matmul on ``threads`` threads (the median of ``repeats``)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / statistics.median(times) / 1e9


def _rollouts(cfg, n_batches: int) -> list[list[dict]]:
    """``n_batches`` batches of episodes from the embedded model, each trajectory as plain JSON."""
    from asyncrl.engine import make_engine
    from asyncrl.envs.base import make_env
    from asyncrl.envs.tasks import task_stream
    from asyncrl.models.loading import load_model, load_tokenizer, resolve_model_path
    from asyncrl.rollout.workflow import RolloutContext, get_workflow

    workflow = get_workflow(cfg.algorithm, cfg)
    model_dir = resolve_model_path(cfg.model, cfg.seed, warmstart_formats=type(workflow).warmstart_formats)
    tok = load_tokenizer(model_dir, cfg.tasks.prompt_format)
    engine = make_engine(cfg, model_dir, tok, lambda: load_model(model_dir, cfg.model.dtype, "cpu"))
    ctx = RolloutContext(engine, tok, make_env(cfg.env), cfg, "bench", seed=1)
    tasks = task_stream(cfg.tasks, 1)
    out = []
    for i in range(n_batches):
        episodes = workflow.rollout([next(tasks) for _ in range(cfg.train.batch_tasks)], ctx)
        out.append(
            [
                {**{f: getattr(t, f).tolist() for f in TRAJ_FIELDS}, "reward": float(t.reward), "group_id": t.group_id}
                for ep in episodes
                for t in ep.trajectories
            ]
        )
        print(f"  rollouts {i + 1}/{n_batches}", flush=True)
    return out


def _episodes(batch: list[dict]):
    import numpy as np

    from asyncrl.types import Episode, Trajectory

    dtypes = {"token_ids": np.int32, "loss_mask": np.uint8, "behavior_logprobs": np.float32}
    trajs = [
        Trajectory(
            **{f: np.asarray(row[f], dtype=dtypes[f]) for f in TRAJ_FIELDS},
            policy_version=0,
            reward=row["reward"],
            group_id=row["group_id"],
        )
        for row in batch
    ]
    return [Episode(trajectories=trajs)]


def _time_variant(cfg, batches: list[list[dict]], threads: int) -> dict:
    import torch

    from asyncrl.learner.training.trainer import PolicyTrainer
    from asyncrl.models.loading import load_policy

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    model, tok, _ = load_policy(cfg.model, cfg.seed)
    trainer = PolicyTrainer(model, tok, cfg.train, cfg.sampling.temperature)
    params = sum(p.numel() for p in model.parameters())
    times, tokens, pad, skipped, rows, slots = [], [], [], [], [], []
    for version, raw in enumerate(batches):
        batch = trainer.make_batch(_episodes(raw))
        real = int(batch.attention_mask.sum())
        t0 = time.perf_counter()
        stats = trainer.step(batch, version=version).stats
        elapsed = time.perf_counter() - t0
        if version == 0:
            continue  # warm-up
        times.append(elapsed)
        tokens.append(real)
        pad.append(stats.get("learner/padding_share", 1.0 - real / batch.input_ids.numel()))
        skipped.append(stats.get("learner/rows_skipped", 0.0))
        if "learner/forward_tokens" in stats:  # the slots the forward ran, padding included
            slots.append(stats["learner/forward_tokens"] / max(1.0 - stats["learner/padding_share"], 1e-9))
        rows.append(batch.batch_size)
    step = statistics.median(times)
    return {
        "step_s": step,
        "tokens_per_s": sum(tokens) / sum(times),
        "padding_share": statistics.mean(pad),
        "rows_skipped_share": sum(skipped) / sum(rows),
        "params": params,
        "flops_per_s": 6 * params * sum(tokens) / sum(times),
        "executed_flops_per_s": 6 * params * sum(slots) / sum(times) if slots else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--variants", nargs="+", default=["padded", "packed"], choices=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=Path, default=Path("/tmp/asyncrl-bench-packing"))
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose asyncrl is timed")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    sys.path.insert(0, str(args.root.resolve()))
    import asyncrl
    from asyncrl.config import load_config

    peak = matmul_peak(args.threads)
    print(
        f"matmul peak (float32, {args.threads} threads): {peak:.1f} GFLOP/s   asyncrl from "
        f"{Path(asyncrl.__file__).parent}"
    )
    args.batches.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.workloads:
        config, overrides = WORKLOADS[name]
        cfg = load_config(str(ROOT / config), overrides)
        saved = args.batches / f"{name}-{args.steps}.json"
        if not saved.exists():
            print(f"{name}: rolling out {args.steps + 1} batches", flush=True)
            saved.write_text(json.dumps(_rollouts(cfg, args.steps + 1)))
        batches = json.loads(saved.read_text())
        for variant in args.variants:
            vcfg = load_config(str(ROOT / config), [*overrides, *VARIANTS[variant]])
            r = _time_variant(vcfg, batches, args.threads)
            r["peak_share"] = r["flops_per_s"] / (peak * 1e9)
            executed = r["executed_flops_per_s"]
            r["executed_peak_share"] = None if executed is None else executed / (peak * 1e9)
            results[f"{name}/{variant}"] = r
            print(
                f"{name:10s} {variant:8s} step {r['step_s'] * 1e3:7.1f} ms  real tokens/s {r['tokens_per_s']:8.0f}  "
                f"padding {r['padding_share']:.2f}  rows skipped {r['rows_skipped_share']:.2f}  "
                f"real-token FLOP rate {r['peak_share']:.0%} of peak, executed "
                + ("-" if executed is None else f"{r['executed_peak_share']:.0%}"),
                flush=True,
            )
        if {"padded", "packed"} <= set(args.variants):
            a, b = results[f"{name}/padded"], results[f"{name}/packed"]
            print(f"{name:10s} packed/padded: {a['step_s'] / b['step_s']:.2f}x faster step", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"peak_gflops": peak, "root": str(args.root), "results": results}, indent=1))


if __name__ == "__main__":
    main()
