"""The quick start with and without LoRA (issue 32): completions/s, reward and held-out accuracy,
bytes per version and publish -> applied time, one run after the other, nothing else running.

    python bench/bench_lora.py                          # full and LoRA r=16, seed 0, 800 steps (~5 min on 2 cores)
    python bench/bench_lora.py --seeds 0 1 --steps 800
    python bench/bench_lora.py --steps 60               # smoke
    python bench/bench_lora.py --modes lora --lora-lr 5e-4 --seeds 0 1   # LoRA at a larger learning rate

Each run is ``asyncrl run -c configs/quickstart.yaml`` (learner and actor processes on loopback);
``lora`` adds ``model.lora.rank=<--rank>`` (alpha 2r, attention and MLP projections) and
``--lora-lr`` (LoRA usually trains with a larger learning rate than full fine-tuning; by default
the quick start's own, 5e-5, so that only the adapters differ). Completions/s: trained completions
from the first to the last step (evaluations included); reward: the batch reward of the first and
last 10% of steps; held-out: greedy accuracy at the end (200 problems never trained on).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_staleness import _jsonl, _mean_sd, run_one, summarise  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def one(mode: str, seed: int, args) -> dict:
    over = [f"seed={seed}", f"train.total_steps={args.steps}", "checkpoint.every=0"]
    if mode == "lora":
        over += [f"model.lora.rank={args.rank}", f"model.lora.alpha={2 * args.rank}"]
        if args.lora_lr:
            over.append(f"train.lr={args.lora_lr}")
    run_dir = run_one(f"lora-bench-{mode}-s{seed}", over, args)
    r = summarise(run_dir)
    metrics = sorted(_jsonl(run_dir / "metrics.jsonl"), key=lambda m: m["step"])
    rewards = [m["reward_mean"] for m in metrics]
    k = max(1, len(rewards) // 10)
    published = [e for e in _jsonl(run_dir / "events.jsonl") if e.get("kind") == "weights_published"]
    applied = [m["sync/applied_ms_mean"] for m in metrics if "sync/applied_ms_mean" in m]
    r.update(
        reward_first=statistics.fmean(rewards[:k]),
        reward_last=statistics.fmean(rewards[-k:]),
        bytes=published[-1]["bytes"] if published else None,
        applied_ms=statistics.median(applied) if applied else None,
    )
    print(
        f"[bench_lora] {mode} seed {seed}: {json.dumps({k: v for k, v in r.items() if 'curve' not in k and k != 'reward_per_minute'})}",
        flush=True,
    )
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora-lr", type=float, default=None)
    p.add_argument("--run-root", default=str(ROOT / "runs" / "bench_lora"))
    p.add_argument("--minutes", type=float, default=0)
    p.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    a = p.parse_args()
    a.config = ROOT / "configs" / "quickstart.yaml"
    Path(a.run_root).mkdir(parents=True, exist_ok=True)
    results = {m: [] for m in ("full", "lora")}
    for mode in ("full", "lora"):
        if mode not in a.modes:
            del results[mode]
    for seed in a.seeds:
        for mode in results:
            results[mode].append(one(mode, seed, a))
    print(
        f"\nquick start, {a.steps} steps, seeds {a.seeds}; lora: rank {a.rank}, alpha {2 * a.rank}, lr "
        f"{a.lora_lr or 5e-5} (full: 5e-5)"
    )
    print("| | full | LoRA | LoRA / full |\n|---|---|---|---|")
    rows = [
        ("completions/s", "samples_per_s"),
        ("batch reward, first 10% of steps", "reward_first"),
        ("batch reward, last 10% of steps", "reward_last"),
        ("held-out greedy accuracy, end", "heldout"),
        ("bytes per version", "bytes"),
        ("publish -> applied ms (median of steps)", "applied_ms"),
    ]
    for label, key in rows:
        f = [r[key] for r in results.get("full", []) if r.get(key) is not None]
        lo = [r[key] for r in results.get("lora", []) if r.get(key) is not None]
        ratio = ""
        if f and lo and key in ("samples_per_s", "bytes", "applied_ms"):
            ratio = f"{statistics.fmean(lo) / statistics.fmean(f):.3g}x"
        print(f"| {label} | {_mean_sd(f)} | {_mean_sd(lo)} | {ratio} |")


if __name__ == "__main__":
    main()
