"""Spot preemption, simulated (issue 66): a learner and ``--actors`` actors as real processes on
loopback; every ``--every`` seconds one actor, drawn at random, is killed with SIGKILL and a new one
started (a preempted spot instance and its replacement). Prints the step rate in windows of
``--window`` seconds with the kills marked, how long the rate took to come back after each kill (to
80% of the rate before it), the ledger's check (no task trained twice) and what was acknowledged but
neither trained nor in the buffer (nothing, if nothing was lost); writes the curve as a PNG.

    .venv/bin/python bench/bench_preemption.py --seconds 120 --every 15 --actors 3
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.analysis.ledger import ledger_report  # noqa: E402
from asyncrl.testing.peer_attacks import LiveRun  # noqa: E402

OVERRIDES = [
    "model.embedded.hidden_size=64",
    "model.embedded.num_layers=2",
    "model.embedded.num_heads=2",
    "model.embedded.intermediate_size=128",
    "model.embedded.warmup_steps=100",
    "sampling.n=4",
    "sampling.max_new_tokens=6",
    "actor.tasks_per_batch=4",
    "train.batch_tasks=8",
    "train.total_steps=100000",
    "eval.every=0",
    "log.progress=false",
    "checkpoint.every=0",
    "actor.heartbeat_s=0.5",
    "log.episode_events=all",
]


def _rate_curve(metrics: list[dict], t0: float, window: float) -> list[tuple[float, float]]:
    times = [m["t"] - t0 for m in metrics]
    end = max(times, default=0.0)
    out, w = [], 0.0
    while w + window <= end + 1e-9:
        n = sum(1 for t in times if w <= t < w + window)
        out.append((w + window / 2, n / window))
        w += window
    return out


def _recovery(metrics: list[dict], t0: float, kills: list[float], window: float) -> list[float | None]:
    """Seconds from each kill to the end of the first 2 s window wholly after it whose step rate is
    back to 80% of the rate in the ``window`` before the kill (None: not before the next kill or the
    end of the run)."""
    times = sorted(m["t"] - t0 for m in metrics)

    def rate(a: float, b: float) -> float:
        return sum(1 for t in times if a <= t < b) / (b - a)

    out = []
    for i, k in enumerate(kills):
        before = rate(k - window, k)
        stop = kills[i + 1] if i + 1 < len(kills) else (times[-1] if times else k)
        found, start = None, k
        while start + 2.0 <= stop:
            if before and rate(start, start + 2.0) >= 0.8 * before:
                found = start + 2.0 - k
                break
            start += 0.25
        out.append(found)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--every", type=float, default=15.0, help="seconds between preemptions")
    ap.add_argument("--actors", type=int, default=3)
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--lease", type=float, default=5.0, help="wire.lease_s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/img/preemption.png")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="asyncrl-preempt-"))
    overrides = [*OVERRIDES, f"wire.lease_s={args.lease}", "wire.credit_timeout_s=30"]
    run = LiveRun(root, "preempt", overrides)
    kills: list[float] = []
    try:
        actors = [run.actor(f"actor-{i}", i) for i in range(args.actors)]
        started = args.actors
        if run.wait_version(3, 600) is None:
            raise SystemExit(f"the run did not reach step 3: {run.log_tail(lines=5)}")
        t0 = time.time()
        print(f"[preempt] {args.actors} actors, one killed every {args.every:g} s for {args.seconds:g} s", flush=True)
        next_kill = t0 + args.every
        while time.time() - t0 < args.seconds:
            if run.learner.poll() is not None:
                raise SystemExit(f"the learner exited: {run.log_tail(lines=10)}")
            if time.time() >= next_kill:
                victim = actors.pop(rng.randrange(len(actors)))
                victim.send_signal(signal.SIGKILL)
                victim.wait(timeout=10)
                kills.append(time.time() - t0)
                actors.append(run.actor(f"actor-{started}", started))
                print(f"[preempt] t={kills[-1]:.1f} s: killed one actor, started actor-{started}", flush=True)
                started += 1
                next_kill += args.every
            time.sleep(0.2)
        t_end = time.time() - t0
    finally:
        run.stop()
    metrics = [m for m in run.metrics() if m["t"] >= t0]
    curve = _rate_curve(metrics, t0, args.window)
    rec = _recovery(metrics, t0, kills, args.window)
    print(f"\nstep rate (steps/s) in {args.window:g} s windows; kills at {[round(k, 1) for k in kills]} s")
    for mid, r in curve:
        mark = " <- kill" if any(mid - args.window / 2 <= k < mid + args.window / 2 for k in kills) else ""
        print(f"  t={mid:6.1f} s  {r:5.2f}  {'#' * int(r * 10)}{mark}")
    credit_timeout = 30.0
    shown = ["n/a" if r is None else f"{r:.1f} s" for r in rec]
    print(
        f"back to 80% of the rate before each kill (a 2 s window wholly after it): {shown} (lease {args.lease:g} s, credit timeout {credit_timeout:g} s)"
    )
    text, ok = ledger_report(run.dir)
    print(text)
    acked = {e["episode_id"] for e in run.events("episode")}
    print(
        f"episodes trained in the window: {sum(m.get('batch_trajectories', 0) > 0 for m in metrics)} steps; "
        f"{len(acked)} episodes trained over the run; ledger exactly-once: {'ok' if ok else 'VIOLATED'}"
    )
    summary = {"kills": kills, "recovery_s": rec, "curve": curve, "seconds": t_end, "exactly_once": ok}
    (root / "preemption.json").write_text(json.dumps(summary))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3))
        ax.plot([c[0] for c in curve], [c[1] for c in curve], marker="o", ms=3)
        for k in kills:
            ax.axvline(k, color="red", alpha=0.4, lw=1)
        ax.set_xlabel("seconds (red: an actor killed with SIGKILL and a new one started)")
        ax.set_ylabel(f"steps/s ({args.window:g} s windows)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"Spot preemption: {args.actors} actors, one preempted every {args.every:g} s")
        fig.tight_layout()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out, dpi=110)
        print(f"curve written to {args.out}")
    except ImportError:
        print("matplotlib is not installed: no plot")
    print(f"run directory: {run.dir}")


if __name__ == "__main__":
    main()
