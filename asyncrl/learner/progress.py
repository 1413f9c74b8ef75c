"""Console progress for the learner and the end-of-run summary table."""

from __future__ import annotations

import sys

import numpy as np
from tqdm import tqdm


class Progress:
    def __init__(self, total: int, start: int, enabled: bool = True):
        self.bar = tqdm(total=total, initial=start, desc="learner", unit="step", dynamic_ncols=True,
                        disable=not enabled, file=sys.stdout, mininterval=0.5)

    def update(self, version: int, stats: dict) -> None:
        self.bar.n = version
        post = {"reward": f"{stats.get('reward_mean', 0):.3f}", "stale": stats.get("staleness_max", 0)}
        if "samples_per_s" in stats:
            post["samples/s"] = f"{stats['samples_per_s']:.0f}"
        if "eval/accuracy" in stats:
            post["eval_acc"] = f"{stats['eval/accuracy']:.3f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def summary_table(rewards: list[float], evals: list[dict]) -> dict:
    """First vs last 10% of steps (mean batch reward), and first vs last held-out evaluation.
    Prints a small table and returns the figures."""
    out: dict = {"steps": len(rewards)}
    if rewards:
        k = max(1, len(rewards) // 10)
        out["reward_first_10pct"] = float(np.mean(rewards[:k]))
        out["reward_last_10pct"] = float(np.mean(rewards[-k:]))
        out["reward_gain"] = out["reward_last_10pct"] - out["reward_first_10pct"]
    evals = [e for e in evals if "accuracy" in e]
    if evals:
        out["eval_accuracy_start"] = evals[0]["accuracy"]
        out["eval_accuracy_end"] = evals[-1]["accuracy"]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="asyncrl run summary")
        table.add_column("measure")
        table.add_column("start", justify="right")
        table.add_column("end", justify="right")
        table.add_column("change", justify="right")
        if rewards:
            table.add_row(f"batch reward (first/last 10% of {len(rewards)} steps)",
                          f"{out['reward_first_10pct']:.3f}", f"{out['reward_last_10pct']:.3f}",
                          f"{out['reward_gain']:+.3f}")
        if evals:
            table.add_row("held-out accuracy", f"{out['eval_accuracy_start']:.3f}",
                          f"{out['eval_accuracy_end']:.3f}",
                          f"{out['eval_accuracy_end'] - out['eval_accuracy_start']:+.3f}")
        Console(file=sys.stdout).print(table)
    except Exception:  # a summary must never crash the end of a run
        print(out)
    return out
