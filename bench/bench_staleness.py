"""Does asynchrony cost learning? The quick-start task under several staleness bounds and off-policy
corrections, several seeds each, at equal wall time (``--minutes``) or equal fresh samples
(``--steps``); prints mean and spread over seeds and saves a PNG.

    python bench/bench_staleness.py --seeds 3 --minutes 5                       # 8 settings x 3 seeds, ~2 h
    python bench/bench_staleness.py --seeds 3 --steps 400 --corrections off decoupled icepop
    python bench/bench_staleness.py --seeds 1 --minutes 0.4 --staleness 0 1 --corrections decoupled  # smoke
    python bench/bench_staleness.py --merge runs/grid_a runs/grid_b --png docs/staleness.png  # grids together

Each run is ``asyncrl run -c CONFIG`` in its own process group (stopped with SIGINT at the time
limit, killed if it does not stop; always killed in ``finally``). Per run it reads
``runs/<name>/metrics.jsonl`` and the ``eval`` events of ``events.jsonl``:

- reward per minute: the mean batch reward of the steps logged in each minute since the first step;
- held-out greedy accuracy: the last evaluation (with ``--steps`` the final one at the end of
  training; with ``--minutes`` the last periodic one, ``eval.every`` steps apart, since a stopped run
  skips the final evaluation); its step is printed with it;
- steps, fresh samples (``batch_trajectories``) and samples per second.

Settings are the product of ``--staleness`` (``buffer.max_staleness``; 0 is synchronous) and
``--corrections`` (names below). Extra ``key=value`` overrides for every run go after ``--set``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# correction name -> config overrides (docs/off_policy.md); bounds where the default would not apply
CORRECTIONS: dict[str, list[str]] = {
    "off": ["train.recompute_proximal=false"],  # plain PPO against the behaviour policy
    "decoupled": [],  # the default: min(rho, is_cap)
    "decoupled_mask": ["train.is_cap_mode=mask"],  # AReaL's code: 0 above the cap
    "token_tis": ["train.off_policy_correction=token_tis"],
    "seq_tis": ["train.off_policy_correction=seq_tis"],
    "seq_mis": ["train.off_policy_correction=seq_mis", "train.is_cap=3"],  # TRL's C = 3
    "icepop": ["train.off_policy_correction=icepop", "train.is_low=0.5"],
    "geo_mask": ["train.off_policy_correction=geo_mask", "train.is_cap=1.1"],  # length-normalised: near 1
}


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by the stop
    return out


def run_one(name: str, overrides: list[str], args) -> Path:
    """One ``asyncrl run``; returns its run directory. Stopped at ``--minutes`` (SIGINT, then SIGKILL
    after a grace period) or left to finish ``--steps``; never left running."""
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", "-c", str(args.config), "--overwrite", f"name={name}",
           f"run_root={args.run_root}", "log.progress=false", *overrides]
    run_dir = Path(args.run_root) / name
    log = open(Path(args.run_root) / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        limit = args.minutes * 60 if args.minutes else None
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)  # the launcher stops learner and actors cleanly
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    return run_dir


def summarise(run_dir: Path) -> dict:
    """Reward per minute, last held-out accuracy (and its step), steps, samples, samples/s."""
    metrics = sorted(_jsonl(run_dir / "metrics.jsonl"), key=lambda m: m["step"])
    evals = [e for e in _jsonl(run_dir / "events.jsonl") if e.get("kind") == "eval" and "accuracy" in e]
    if not metrics:
        return {"steps": 0}
    t0 = metrics[0]["t"]
    per_min: dict[int, list[float]] = {}
    for m in metrics:
        per_min.setdefault(int((m["t"] - t0) // 60), []).append(m["reward_mean"])
    samples = sum(m.get("batch_trajectories", 0) for m in metrics)
    span = metrics[-1]["t"] - t0
    last = evals[-1] if evals else {}
    return {"steps": metrics[-1]["step"], "samples": samples, "samples_per_s": samples / span if span > 0 else None,
            "reward_per_minute": [statistics.fmean(per_min[k]) for k in sorted(per_min)],
            "reward_last_minute": statistics.fmean(per_min[max(per_min)]),
            "heldout": last.get("accuracy"), "heldout_step": last.get("step"),
            "heldout_start": evals[0].get("accuracy") if evals else None,
            "token_lag_mean": statistics.fmean(m.get("staleness/token_lag_mean", 0.0) for m in metrics),
            "masked_frac": statistics.fmean(m.get("is_weight_masked_frac", 0.0) for m in metrics),
            "capped_frac": statistics.fmean(m.get("is_weight_capped_frac", 0.0) for m in metrics),
            "wall_s": span, "curve": [(m["t"] - t0, m["reward_mean"]) for m in metrics],
            "eval_curve": [(e["t"] - t0, e["accuracy"]) for e in evals if "t" in e]}


def heldout_at(r: dict, t: float):
    """Held-out accuracy of the last evaluation at most ``t`` seconds after the run's first step."""
    before = [a for s, a in r.get("eval_curve", []) if s <= t]
    return before[-1] if before else None


def _mean_sd(xs: list) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.fmean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")


def report(results: dict[str, list[dict]]) -> None:
    # equal wall time: every run's held-out accuracy at the time the shortest run finished
    spans = [r["wall_s"] for rs in results.values() for r in rs if r.get("wall_s")]
    t_eq = min(spans) if spans else 0.0
    cols = ["setting", "runs", "steps", "samples/s", "reward last min", "held-out acc (step)",
            f"held-out at {t_eq:.0f} s", "token lag", "capped", "masked"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for setting, rs in results.items():
        steps = [r.get("heldout_step") for r in rs]
        print(f"| {setting} | {len(rs)} | {_mean_sd([r.get('steps') for r in rs])} | "
              f"{_mean_sd([r.get('samples_per_s') for r in rs])} | {_mean_sd([r.get('reward_last_minute') for r in rs])} | "
              f"{_mean_sd([r.get('heldout') for r in rs])} ({'/'.join(str(s) for s in steps)}) | "
              f"{_mean_sd([heldout_at(r, t_eq) for r in rs])} | "
              f"{_mean_sd([r.get('token_lag_mean') for r in rs])} | {_mean_sd([r.get('capped_frac') for r in rs])} | "
              f"{_mean_sd([r.get('masked_frac') for r in rs])} |")


def plot(results: dict[str, list[dict]], path: Path) -> None:
    """Two panels, one line per setting, means over its runs: batch reward over wall time (10 s
    bins, the runs' points pooled) and held-out accuracy at each evaluation (x: the evaluation's
    mean time since the first step)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(13, 5))
    for setting, rs in results.items():
        bins: dict[int, list[float]] = {}
        for r in rs:
            for t, rew in r.get("curve", []):
                bins.setdefault(int(t // 10), []).append(rew)
        if bins:
            ks = sorted(bins)
            line, = ax_r.plot([k * 10 + 5 for k in ks], [statistics.fmean(bins[k]) for k in ks], label=setting)
            curves = [r.get("eval_curve", []) for r in rs]
            n = min((len(c) for c in curves), default=0)
            if n:
                ax_e.plot([statistics.fmean(c[i][0] for c in curves) for i in range(n)],
                          [statistics.fmean(c[i][1] for c in curves) for i in range(n)], marker=".",
                          color=line.get_color(), label=setting)
    ax_r.set_xlabel("seconds since the first step")
    ax_r.set_ylabel("batch reward (mean over seeds, 10 s bins)")
    ax_e.set_xlabel("seconds since the first step")
    ax_e.set_ylabel("held-out greedy accuracy (mean over seeds)")
    ax_e.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    ap.add_argument("--seeds", type=int, default=3)
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, default=None, help="wall time per run (equal-time comparison)")
    budget.add_argument("--steps", type=int, default=None, help="optimizer steps per run (equal fresh samples)")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--corrections", nargs="+", default=["off", "decoupled"], choices=sorted(CORRECTIONS))
    ap.add_argument("--eval-every", type=int, default=50, help="eval.every (held-out accuracy in --minutes mode)")
    ap.add_argument("--run-root", default=str(ROOT / "runs" / "bench_staleness"))
    ap.add_argument("--png", type=Path, default=None, help="plot path (default: <run-root>/staleness.png)")
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every run")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="RUN_ROOT",
                    help="no runs: print the table and draw the plot of earlier grids' results.json together")
    args = ap.parse_args()
    if args.merge:
        results = {}
        for root in args.merge:
            results.update(json.loads((root / "results.json").read_text()))
        report(results)
        plot(results, args.png or args.merge[0] / "staleness.png")
        return
    if args.minutes is None and args.steps is None:
        args.minutes = 5.0
    Path(args.run_root).mkdir(parents=True, exist_ok=True)
    budget_over = [f"train.total_steps={args.steps}"] if args.steps else ["train.total_steps=1000000"]
    results: dict[str, list[dict]] = {}
    for k in args.staleness:
        for corr in args.corrections:
            setting = f"staleness {k}, {corr}"
            for seed in range(args.seeds):
                name = f"st{k}_{corr}_s{seed}"
                over = [f"seed={seed}", f"buffer.max_staleness={k}", f"eval.every={args.eval_every}",
                        "checkpoint.every=0", *budget_over, *CORRECTIONS[corr], *args.set]
                t0 = time.time()
                summary = summarise(run_one(name, over, args))
                print(f"{name}: {time.time() - t0:.0f} s, {summary.get('steps')} steps, held-out "
                      f"{summary.get('heldout')} at step {summary.get('heldout_step')}", flush=True)
                results.setdefault(setting, []).append(summary)
    report(results)
    out = Path(args.run_root) / "results.json"
    out.write_text(json.dumps(results))
    print(f"results: {out}")
    plot(results, args.png or Path(args.run_root) / "staleness.png")


if __name__ == "__main__":
    main()
