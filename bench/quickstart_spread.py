"""The quick start's figures over several seeds and two CPU kernel sets (issue 64.1): what
``make demo`` promises on another machine is a range, not one run's numbers.

The embedded model's build is deterministic on one machine (same CPU instruction set, same torch),
but float32 (and float64) matrix products round differently with AVX-512 and AVX2 kernels, and 400
supervised steps amplify that: the warm start ends at another step with another model. This script
runs the quick start (``configs/quickstart.yaml``) for each seed with the machine's own kernels and
with AVX2 forced (``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2``, what an AVX2-only CPU
runs), each kernel set with its own model cache (a seed builds its own model), and prints one row a
run and the range.

    python bench/quickstart_spread.py [--seeds 0 1 2] [--kernels native avx2] [--run-root /tmp/qs-spread]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

KERNELS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def one_run(run_root: Path, kernels: str, seed: int, report_only: bool = False) -> dict:
    """One quick-start run; returns its build and its figures (read from the run's files)."""
    name = f"qs-{kernels}-s{seed}"
    cache = run_root / f"models-{kernels}"
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "run",
        "-c",
        str(ROOT / "configs/quickstart.yaml"),
        "--overwrite",
        f"seed={seed}",
        f"name={name}",
        f"run_root={run_root}",
        "log.progress=false",
        f"model.embedded.cache_dir={cache}",
    ]
    start = time.perf_counter()
    if not (report_only and (run_root / name / "metrics.jsonl").exists()):
        with open(run_root / f"{name}.log", "w") as log:
            proc = subprocess.run(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, **KERNELS[kernels], "PYTHONPATH": str(ROOT)},
            )
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed (exit {proc.returncode}); see {run_root / (name + '.log')}")
    run = run_root / name
    metrics = sorted(_rows(run / "metrics.jsonl"), key=lambda m: m["version"])
    rewards = [m["reward_mean"] for m in metrics if "reward_mean" in m]
    evals = sorted((e["step"], e["accuracy"]) for e in _rows(run / "events.jsonl") if e.get("kind") == "eval")
    tenth = max(1, len(rewards) // 10)
    info = json.loads(next(cache.glob(f"tiny-*-s{seed}-*/asyncrl_model.json")).read_text())
    return {
        "run": name,
        "kernels": kernels,
        "seed": seed,
        "build_steps": info["steps"],
        "reward_first": sum(rewards[:tenth]) / tenth,
        "reward_last": sum(rewards[-tenth:]) / tenth,
        "heldout_first": evals[0][1] if evals else None,
        "heldout_last": evals[-1][1] if evals else None,
        "wall_s": round(time.perf_counter() - start, 1) if not report_only else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--kernels", nargs="+", choices=sorted(KERNELS), default=["native", "avx2"])
    ap.add_argument("--run-root", type=Path, default=Path("/tmp/qs-spread"))
    ap.add_argument("--report-only", action="store_true", help="read the runs already under --run-root, run none")
    args = ap.parse_args()
    args.run_root.mkdir(parents=True, exist_ok=True)
    results = []
    print(
        "| kernels | seed | warm-start steps | batch reward first 10% -> last 10% | held-out greedy, step 0 -> end | wall s |"
    )
    print("|---|---|---|---|---|---|")
    for kernels in args.kernels:
        for seed in args.seeds:
            r = one_run(args.run_root, kernels, seed, args.report_only)
            results.append(r)
            print(
                f"| {kernels} | {seed} | {r['build_steps']} | {r['reward_first']:.3f} -> {r['reward_last']:.3f} | "
                f"{r['heldout_first']:.3f} -> {r['heldout_last']:.3f} | {r['wall_s']:.0f} |".replace("nan", "-"),
                flush=True,
            )
    (args.run_root / "spread.json").write_text(json.dumps(results, indent=2))
    for key, label in (
        ("build_steps", "warm-start steps"),
        ("heldout_first", "held-out greedy at step 0"),
        ("heldout_last", "held-out greedy at the end"),
        ("reward_last", "batch reward, last 10%"),
    ):
        vals = [r[key] for r in results if r[key] is not None]
        print(f"{label}: {min(vals):g} .. {max(vals):g} over {len(vals)} runs")


if __name__ == "__main__":
    main()
