"""``actor.weight_update: batch`` against ``inflight`` on a task with long-tailed response lengths
(examples/longtail.yaml: copy a string, 90% of them 2-5 characters, 10% 24-40), embedded model.

    python bench/bench_inflight.py --seeds 3 --steps 300          # 2 modes x 3 seeds, ~25 min on 2 cores
    python bench/bench_inflight.py --engine-only                  # the engine alone, ~1 min
    python bench/bench_inflight.py --seeds 1 --steps 60           # smoke

Two parts:

- the engine alone (``--engine-only``, and first in a full run): the run's model and sampling, 12
  batches of 8 tasks x 8 samples; ``batch`` generates them one engine call after the other (each
  runs to its longest sequence), ``inflight`` serves them from 2 rollout threads through the
  continuous engine (``HFEngine.step``). Completions/s of each, ratio per round, ``--rounds`` rounds.
- whole runs: ``asyncrl run -c examples/longtail.yaml`` (learner and actor processes, one after the
  other, nothing else running) per mode and seed, ``--steps`` steps, held-out evaluation every
  ``--eval-every`` steps. Per run: completions/s (trained completions from the first to the last
  step, evaluations included), the actor's idle share (1 - generate_s / up_s of its last status),
  per-token lag, held-out accuracy at equal samples (each evaluation step: every step trains
  8 x 8 completions) and at equal wall time (each run's last evaluation before the shortest run's
  end). Mean and spread over seeds, ratios inflight / batch per seed; a PNG of the held-out curves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_staleness import _jsonl, _mean_sd, heldout_at, run_one, summarise  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "longtail.yaml"


def engine_only(rounds: int, seed: int = 0) -> list[tuple[float, float]]:
    """``[(batch completions/s, inflight completions/s)]`` per round (module docstring)."""
    import torch

    from asyncrl.config import load_config
    from asyncrl.engine.hf import HFEngine
    from asyncrl.envs.tasks import task_stream
    from asyncrl.models.loading import load_model, load_tokenizer, resolve_model_path
    from asyncrl.prompts import render_tokens

    sys.path.insert(0, str(ROOT))  # examples.longtail
    torch.set_num_threads(1)
    cfg = load_config(str(CONFIG), [f"seed={seed}"])
    model_dir = resolve_model_path(cfg.model, cfg.seed)
    tok = load_tokenizer(model_dir, cfg.tasks.prompt_format)
    engine = HFEngine(load_model(model_dir, "float32", "cpu"), tok)
    stream = task_stream(cfg.tasks, seed)
    out = []
    for r in range(rounds):
        batches = [
            [render_tokens(tok, t.prompt) for t in (next(stream) for _ in range(8)) for _ in range(8)]
            for _ in range(12)
        ]
        t0 = time.perf_counter()
        for i, b in enumerate(batches):
            engine.generate(b, cfg.sampling, seed=1000 * r + i)
        batch_cps = 8 * 8 * len(batches) / (time.perf_counter() - t0)
        engine.start_continuous()
        todo, lock, done = iter(batches), threading.Lock(), []

        def rollouts():
            while True:
                with lock:
                    b = next(todo, None)
                if b is None:
                    return
                done.extend(engine.generate(b, cfg.sampling))

        threads = [threading.Thread(target=rollouts) for _ in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            if not engine.step():
                engine.batcher.wait_for_work(0.005)
        inflight_cps = len(done) / (time.perf_counter() - t0)
        engine.stop_continuous("round over")
        engine.batcher = None
        out.append((batch_cps, inflight_cps))
        print(
            f"engine round {r + 1}: batch {batch_cps:.0f}, inflight {inflight_cps:.0f} completions/s "
            f"({inflight_cps / batch_cps:.2f}x)",
            flush=True,
        )
    return out


def run_summary(run_dir: Path) -> dict:
    out = summarise(run_dir)
    metrics = _jsonl(run_dir / "metrics.jsonl")
    status = [e for e in _jsonl(run_dir / "events.jsonl") if e.get("kind") == "actor_status" and e.get("up_s")]
    if status:
        out["idle_share"] = 1 - status[-1]["generate_s"] / status[-1]["up_s"]
    out["token_past_bound"] = (
        statistics.fmean(m.get("staleness/token_frac_past_bound", 0.0) for m in metrics) if metrics else None
    )
    evals = [e for e in _jsonl(run_dir / "events.jsonl") if e.get("kind") == "eval" and "accuracy" in e]
    out["eval_by_step"] = {e["step"]: e["accuracy"] for e in evals}
    return out


def report(results: dict[str, list[dict]], engine: list[tuple[float, float]] | None) -> None:
    if engine:
        ratios = [b / a for a, b in engine]
        print(
            f"\nengine alone: batch {statistics.median(a for a, _ in engine):.0f}, inflight "
            f"{statistics.median(b for _, b in engine):.0f} completions/s; inflight / batch median "
            f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})"
        )
    if not results:
        return
    t_eq = min(r["wall_s"] for rs in results.values() for r in rs)
    steps = sorted(set.intersection(*(set(r["eval_by_step"]) for rs in results.values() for r in rs)))
    print(
        f"\n| mode | runs | completions/s | actor idle share | token lag (mean) | tokens past bound | "
        f"held-out at step {' / '.join(map(str, steps))} (equal samples) | held-out at {t_eq:.0f} s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, rs in results.items():
        per_step = " / ".join(_mean_sd([r["eval_by_step"].get(s) for r in rs]) for s in steps)
        print(
            f"| {mode} | {len(rs)} | {_mean_sd([r.get('samples_per_s') for r in rs])} | "
            f"{_mean_sd([r.get('idle_share') for r in rs])} | {_mean_sd([r.get('token_lag_mean') for r in rs])} | "
            f"{_mean_sd([r.get('token_past_bound') for r in rs])} | {per_step} | "
            f"{_mean_sd([heldout_at(r, t_eq) for r in rs])} |"
        )
    if {"batch", "inflight"} <= set(results):
        pairs = list(zip(results["batch"], results["inflight"]))
        ratios = [b["samples_per_s"] / a["samples_per_s"] for a, b in pairs]
        diffs = [b["heldout"] - a["heldout"] for a, b in pairs if a.get("heldout") is not None]
        print(
            f"\ninflight / batch completions/s per seed: {', '.join(f'{x:.2f}' for x in ratios)} "
            f"(mean {statistics.fmean(ratios):.2f})"
        )
        print(
            f"final held-out accuracy, inflight - batch per seed (equal samples): "
            f"{', '.join(f'{d:+.3f}' for d in diffs)}"
        )


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, color in (("batch", "tab:blue"), ("inflight", "tab:orange")):
        for i, r in enumerate(results.get(mode, [])):
            label = mode if i == 0 else None
            steps = sorted(r["eval_by_step"])
            ax_s.plot(
                [s * 64 for s in steps],
                [r["eval_by_step"][s] for s in steps],
                color=color,
                alpha=0.7,
                marker="o",
                label=label,
            )
            ax_t.plot(
                [t for t, _ in r["eval_curve"]],
                [a for _, a in r["eval_curve"]],
                color=color,
                alpha=0.7,
                marker="o",
                label=label,
            )
    ax_s.set_xlabel("completions trained on")
    ax_t.set_xlabel("seconds since the first step")
    for ax in (ax_s, ax_t):
        ax.set_ylabel("held-out greedy accuracy (exact copy)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("actor.weight_update: batch vs inflight, long-tailed copy task (one line per seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3, help="engine-only rounds")
    ap.add_argument("--engine-only", action="store_true")
    ap.add_argument("--run-root", default=str(ROOT / "runs" / "bench_inflight"))
    ap.add_argument("--png", default=str(ROOT / "docs" / "inflight.png"))
    ap.add_argument("--json", default=None, help="also write every run's summary here")
    args = ap.parse_args()
    engine = engine_only(args.rounds)
    results: dict[str, list[dict]] = {}
    if not args.engine_only:
        args.config, args.minutes = CONFIG, None
        Path(args.run_root).mkdir(parents=True, exist_ok=True)
        for seed in range(args.seeds):
            for mode in ("batch", "inflight"):
                name = f"{mode}-s{seed}"
                t0 = time.time()
                r = run_summary(
                    run_one(
                        name,
                        [
                            f"seed={seed}",
                            f"actor.weight_update={mode}",
                            f"train.total_steps={args.steps}",
                            f"eval.every={args.eval_every}",
                        ],
                        args,
                    )
                )
                results.setdefault(mode, []).append(r)
                print(
                    f"{name}: {time.time() - t0:.0f} s, {r.get('steps')} steps, {r.get('samples_per_s') or 0:.0f} "
                    f"completions/s, held-out {r.get('heldout')}",
                    flush=True,
                )
        if args.json:
            Path(args.json).write_text(json.dumps(results, default=str))
        plot(results, Path(args.png))
    report(results, engine)


if __name__ == "__main__":
    main()
