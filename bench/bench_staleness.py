"""Does asynchrony cost learning? The quick-start task under several staleness bounds and off-policy
corrections, several seeds each, at equal wall time (``--minutes``) or equal fresh samples
(``--steps``); prints mean and spread over seeds and saves a PNG.

    python bench/bench_staleness.py --seeds 3 --minutes 5                       # 8 settings x 3 seeds, ~2 h
    python bench/bench_staleness.py --seeds 3 --steps 400 --corrections off decoupled icepop
    python bench/bench_staleness.py --seeds 1 --minutes 0.4 --staleness 0 1 --corrections decoupled  # smoke
    python bench/bench_staleness.py --merge runs/grid_a runs/grid_b --png docs/img/staleness.png  # grids together

Each run is ``asyncrl run -c CONFIG`` in its own process group (stopped with SIGINT at the time
limit, killed if it does not stop; always killed in ``finally``). Per run it reads
``runs/<name>/metrics.jsonl`` and the ``eval`` events of ``events.jsonl``:

- reward per minute: the mean batch reward of the steps logged in each minute since the first step;
- held-out greedy accuracy: the last evaluation (with ``--steps`` the final one at the end of
  training; with ``--minutes`` the last periodic one, ``eval.every`` steps apart, since a stopped run
  skips the final evaluation); its step is printed with it;
- steps, fresh samples (``batch_trajectories``) and samples per second.

Settings are the product of ``--staleness`` (``buffer.max_staleness``; 0 is synchronous) and
``--corrections`` (names below), with ``--actors`` actor processes (more actors: real lag). Extra
``key=value`` overrides for every run go after ``--set``.

Printed: per setting the mean ± standard deviation over seeds (throughput, held-out, realised
per-token lag mean and max, the largest behaviour weight rho, capped and masked shares); then the
held-out accuracy at every evaluation step all runs share (equal samples), mean ± 95% t interval over
seeds, and each setting minus the first setting seed by seed (paired), mean ± 95% interval. The PNG's
right panel is held-out accuracy against samples trained, with the 95% band. The study in
``docs/results/staleness.md``:

    STUDY="model.embedded.target_accuracy=0.1 model.embedded.heldout_size=1000 tasks.eval_size=1000 eval.size=1000"
    python bench/bench_staleness.py --seeds 5 --steps 800 --eval-every 100 --staleness 0 1 \
        --corrections decoupled --run-root runs/st_a --set $STUDY
    python bench/bench_staleness.py --seeds 5 --steps 800 --eval-every 100 --staleness 4 \
        --corrections off decoupled --actors 4 --run-root runs/st_b --set $STUDY
    python bench/bench_staleness.py --merge runs/st_a runs/st_b --png docs/img/staleness.png
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

# correction name -> config overrides (docs/design/off_policy.md); bounds where the default would not apply
CORRECTIONS: dict[str, list[str]] = {
    "off": ["train.recompute_proximal=false"],  # plain PPO against the behaviour policy
    "decoupled": [],  # the default: min(rho, is_cap)
    "decoupled_mask": ["train.is_cap_mode=mask"],  # AReaL's code: 0 above the cap
    "token_tis": ["train.off_policy_correction=token_tis"],
    "seq_tis": ["train.off_policy_correction=seq_tis"],
    "seq_mis": ["train.off_policy_correction=seq_mis", "train.is_cap=3"],  # TRL's C = 3
    "icepop": ["train.off_policy_correction=icepop", "train.is_low=0.5"],
    "geo_mask": ["train.off_policy_correction=geo_mask", "train.is_cap=1.1"],  # length-normalised: near 1
    "decoupled_noclip": [
        "train.behavior_clip=false"
    ],  # the default before the behaviour clip (docs/algorithms/objectives.md)
    # the objectives menu (docs/algorithms/objectives.md): estimators, losses, dynamic sampling, beside the default (grpo + ppo)
    "grpo": [],
    "rloo": ["train.advantage.estimator=rloo"],
    "reinforce_pp": ["train.advantage.estimator=reinforce_pp"],
    "gspo": ["train.policy_loss=gspo", "train.loss_agg_mode=seq-mean-token-mean"],  # the paper's aggregation
    "cispo": ["train.policy_loss=cispo"],
    "dynamic": ["buffer.filter_groups=true"],
    # PPO with a critic (issue 46; docs/algorithms/objectives.md): GAE with the defaults (gamma 1, lam 1: each token's
    # advantage is R - V(s_t), whitened), the critic 10x the policy's learning rate and 10 steps of value warm-up
    "gae": ["train.advantage.estimator=gae", "critic.lr=5e-4", "critic.warmup_steps=10"],
    # on-policy distillation (issue 68; docs/algorithms/objectives.md) from --teacher: the teacher's per-token
    # reverse KL alone, or beside the task reward's GRPO advantage
    "distill": ["train.distill.teacher={teacher}", "train.distill.task_coef=0"],
    "distill_mixed": ["train.distill.teacher={teacher}"],
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
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "run",
        "-c",
        str(args.config),
        "--overwrite",
        f"name={name}",
        f"run_root={args.run_root}",
        "log.progress=false",
        *overrides,
    ]
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
    return {
        "steps": metrics[-1]["step"],
        "samples": samples,
        "samples_per_s": samples / span if span > 0 else None,
        "reward_per_minute": [statistics.fmean(per_min[k]) for k in sorted(per_min)],
        "reward_last_minute": statistics.fmean(per_min[max(per_min)]),
        "heldout": last.get("accuracy"),
        "heldout_step": last.get("step"),
        "heldout_start": evals[0].get("accuracy") if evals else None,
        "token_lag_mean": statistics.fmean(m.get("staleness/token_lag_mean", 0.0) for m in metrics),
        "token_lag_max": max(m.get("staleness/token_lag_max", 0.0) for m in metrics),
        "is_weight_max": max((m["is_weight_max"] for m in metrics if "is_weight_max" in m), default=None),
        "samples_per_step": samples / len(metrics),
        "eval_by_step": {str(e["step"]): e["accuracy"] for e in evals},
        "masked_frac": statistics.fmean(m.get("is_weight_masked_frac", 0.0) for m in metrics),
        "capped_frac": statistics.fmean(m.get("is_weight_capped_frac", 0.0) for m in metrics),
        "wall_s": span,
        "curve": [(m["t"] - t0, m["reward_mean"]) for m in metrics],
        "eval_curve": [(e["t"] - t0, e["accuracy"]) for e in evals if "t" in e],
    }


def heldout_at(r: dict, t: float):
    """Held-out accuracy of the last evaluation at most ``t`` seconds after the run's first step."""
    before = [a for s, a in r.get("eval_curve", []) if s <= t]
    return before[-1] if before else None


def _mean_sd(xs: list) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.fmean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")


# two-sided 95% Student t quantiles by degrees of freedom (scipy is not a dependency)
T95 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    14: 2.145,
    19: 2.093,
    29: 2.045,
}


def mean_ci(xs: list) -> tuple[float, float] | None:
    """Mean and the half-width of its 95% t confidence interval (None: no values; half-width nan: one)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0], float("nan")
    df = len(xs) - 1
    t = T95.get(df) or T95[max(k for k in T95 if k <= df)]
    return statistics.fmean(xs), t * statistics.stdev(xs) / len(xs) ** 0.5


def _ci(xs: list, digits: int = 3) -> str:
    m = mean_ci(xs)
    return "-" if m is None else f"{m[0]:+.{digits}f} ± {m[1]:.{digits}f}".lstrip("+")


def shared_steps(runs: list[dict]) -> list[str]:
    """The evaluation steps every one of ``runs`` has, in order (the points at equal samples)."""
    if not runs:
        return []
    return sorted(set.intersection(*(set(r.get("eval_by_step", {})) for r in runs)), key=int)


def report_matched(results: dict[str, list[dict]]) -> None:
    """Held-out accuracy at equal samples (the evaluation steps every run has), mean ± 95% CI over
    seeds; then each setting minus the first (seed by seed: paired), mean ± 95% CI."""
    steps = shared_steps([r for rs in results.values() for r in rs])
    if not steps:
        return
    per_step = [r.get("samples_per_step", 0) for rs in results.values() for r in rs]
    k = statistics.fmean(per_step) if per_step else 0
    print("\nHeld-out accuracy at equal samples (mean ± 95% CI over seeds):\n")
    print("| setting | " + " | ".join(f"step {s} ({int(s) * k / 1000:.1f}k samples)" for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for setting, rs in results.items():
        print(f"| {setting} | " + " | ".join(_ci([r["eval_by_step"].get(s) for r in rs]) for s in steps) + " |")
    base_name, base = next(iter(results.items()))
    print(
        f"\nDifference from `{base_name}`, seed by seed (mean ± 95% CI; an interval that holds 0 "
        f"does not tell the two apart):\n"
    )
    print("| setting | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for setting, rs in list(results.items())[1:]:
        cells = []
        for s in steps:
            pairs = [(r["eval_by_step"].get(s), b["eval_by_step"].get(s)) for r, b in zip(rs, base)]
            cells.append(_ci([a - b for a, b in pairs if a is not None and b is not None]))
        print(f"| {setting} | " + " | ".join(cells) + " |")


def report(results: dict[str, list[dict]]) -> None:
    # equal wall time: every run's held-out accuracy at the time the shortest run finished
    spans = [r["wall_s"] for rs in results.values() for r in rs if r.get("wall_s")]
    t_eq = min(spans) if spans else 0.0
    cols = [
        "setting",
        "runs",
        "steps",
        "samples/s",
        "reward last min",
        "held-out acc (step)",
        f"held-out at {t_eq:.0f} s",
        "token lag mean",
        "token lag max",
        "largest rho",
        "capped",
        "masked",
    ]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for setting, rs in results.items():
        steps = [r.get("heldout_step") for r in rs]
        print(
            f"| {setting} | {len(rs)} | {_mean_sd([r.get('steps') for r in rs])} | "
            f"{_mean_sd([r.get('samples_per_s') for r in rs])} | {_mean_sd([r.get('reward_last_minute') for r in rs])} | "
            f"{_mean_sd([r.get('heldout') for r in rs])} ({'/'.join(str(s) for s in steps)}) | "
            f"{_mean_sd([heldout_at(r, t_eq) for r in rs])} | "
            f"{_mean_sd([r.get('token_lag_mean') for r in rs])} | {_mean_sd([r.get('token_lag_max') for r in rs])} | "
            f"{_mean_sd([r.get('is_weight_max') for r in rs])} | {_mean_sd([r.get('capped_frac') for r in rs])} | "
            f"{_mean_sd([r.get('masked_frac') for r in rs])} |"
        )
    report_matched(results)


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
            (line,) = ax_r.plot([k * 10 + 5 for k in ks], [statistics.fmean(bins[k]) for k in ks], label=setting)
            steps = shared_steps(rs)
            if steps:  # held-out accuracy at equal samples: mean over seeds, and its 95% interval
                k = statistics.fmean(r.get("samples_per_step", 0) for r in rs) / 1000
                cis = [mean_ci([r["eval_by_step"][s] for r in rs]) for s in steps]
                xs = [int(s) * k for s in steps]
                ax_e.plot(xs, [c[0] for c in cis], marker=".", color=line.get_color(), label=setting)
                if len(rs) > 1:
                    ax_e.fill_between(
                        xs, [c[0] - c[1] for c in cis], [c[0] + c[1] for c in cis], color=line.get_color(), alpha=0.12
                    )
    ax_r.set_xlabel("seconds since the first step")
    ax_r.set_ylabel("batch reward (mean over seeds, 10 s bins)")
    ax_e.set_xlabel("thousands of fresh samples trained (equal samples)")
    ax_e.set_ylabel("held-out greedy accuracy (mean, 95% CI over seeds)")
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
    ap.add_argument("--actors", type=int, default=1, help="actor processes (actor.num) in every run")
    ap.add_argument("--eval-every", type=int, default=50, help="eval.every (held-out accuracy in --minutes mode)")
    ap.add_argument("--run-root", default=str(ROOT / "runs" / "bench_staleness"))
    ap.add_argument("--png", type=Path, default=None, help="plot path (default: <run-root>/staleness.png)")
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every run")
    ap.add_argument("--teacher", default=None, help="the distill settings' teacher: a Hugging Face model directory")
    ap.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="RUN_ROOT",
        help="no runs: print the table and draw the plot of earlier grids' results.json together",
    )
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
    if any("{teacher}" in o for c in args.corrections for o in CORRECTIONS[c]) and not args.teacher:
        ap.error("the distill settings need --teacher DIR (e.g. a run's checkpoints/step_N/model)")
    Path(args.run_root).mkdir(parents=True, exist_ok=True)
    budget_over = [f"train.total_steps={args.steps}"] if args.steps else ["train.total_steps=1000000"]
    results: dict[str, list[dict]] = {}
    for k in args.staleness:
        for corr in args.corrections:
            setting = f"staleness {k}, {corr}" + (f", {args.actors} actors" if args.actors > 1 else "")
            for seed in range(args.seeds):
                name = f"st{k}_{corr}_a{args.actors}_s{seed}"
                over = [
                    f"seed={seed}",
                    f"buffer.max_staleness={k}",
                    f"eval.every={args.eval_every}",
                    f"actor.num={args.actors}",
                    "checkpoint.every=0",
                    *budget_over,
                    *(o.format(teacher=args.teacher) for o in CORRECTIONS[corr]),
                    *args.set,
                ]
                t0 = time.time()
                summary = summarise(run_one(name, over, args))
                print(
                    f"{name}: {time.time() - t0:.0f} s, {summary.get('steps')} steps, held-out "
                    f"{summary.get('heldout')} at step {summary.get('heldout_step')}",
                    flush=True,
                )
                results.setdefault(setting, []).append(summary)
    report(results)
    out = Path(args.run_root) / "results.json"
    out.write_text(json.dumps(results))
    print(f"results: {out}")
    plot(results, args.png or Path(args.run_root) / "staleness.png")


if __name__ == "__main__":
    main()
