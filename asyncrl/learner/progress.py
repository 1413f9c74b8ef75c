"""Console progress for the learner and the end-of-run summary table."""

from __future__ import annotations

import sys

import numpy as np
from tqdm import tqdm

# rewards shown next to the headline one when a step reports them: RLCR's answer accuracy and Brier
# confidence reward (its ``reward_mean`` is the answers' accuracy only)
PROGRESS_SPLIT_REWARDS = (("rlcr/answer_reward_mean", "acc"), ("rlcr/confidence_reward_mean", "brier_r"))


class Progress:
    def __init__(self, total: int, start: int, enabled: bool = True):
        self.bar = tqdm(
            total=total,
            initial=start,
            desc="learner",
            unit="step",
            dynamic_ncols=True,
            disable=not enabled,
            file=sys.stdout,
            mininterval=0.5,
        )

    def update(self, version: int, stats: dict) -> None:
        self.bar.n = version
        post = {"reward": f"{stats.get('reward_mean', 0):.3f}", "stale": stats.get("staleness_max", 0)}
        for key, label in PROGRESS_SPLIT_REWARDS:  # an algorithm's rewards reported apart (RLCR)
            if key in stats:
                post[label] = f"{stats[key]:.3f}"
        if "samples_per_s" in stats:
            post["samples/s"] = f"{stats['samples_per_s']:.0f}"
        if "eval/accuracy" in stats:
            post["eval_acc"] = f"{stats['eval/accuracy']:.3f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


# held-out figures the summary compares start -> end, when the evaluation reports them (RLCR: calibration)
SUMMARY_EVAL_FIGURES = (("accuracy", "held-out accuracy"), ("ece", "held-out ECE"), ("brier", "held-out Brier score"))


def _eval_rows(evals: list[dict]) -> tuple[dict, list[tuple[str, str, str, str]]]:
    """Figures and table rows (measure, start, end, change) of the first and last evaluation. An
    RLCR figure over zero parsed confidences is n/a, and the parse counts are shown beside it."""
    from ..analysis import NA, calibration_summary
    from ..analysis.paired import paired_change

    out: dict = {}
    rows = []
    first, last = evals[0], evals[-1]
    calib = "confidence_parse_fail" in last
    a, b = (calibration_summary(e) if calib else e for e in (first, last))
    for key, label in SUMMARY_EVAL_FIGURES:
        if key not in last:
            continue
        x, y = a.get(key), b.get(key)
        out[f"eval_{key}_start"], out[f"eval_{key}_end"] = x, y
        show = [
            f"{v:.3f}" if v is not None and not (key == "accuracy" and _all_failed(e)) else NA
            for v, e in ((x, first), (y, last))
        ]
        change = f"{y - x:+.3f}" if x is not None and y is not None and NA not in show else NA
        rows.append((label, *show, change))
    paired = paired_change(first, last)
    if paired is not None:  # the same problems before and after: is the change more than the draw's luck?
        lo, hi = paired["ci95"]
        out["eval_accuracy_change_ci95"] = [lo, hi]
        out["eval_problems_gained"], out["eval_problems_lost"] = paired["gained"], paired["lost"]
        rows.append(
            (
                f"held-out change, paired 95% CI ({paired['n']})",
                f"{paired['lost']} lost",
                f"{paired['gained']} gained",
                f"[{lo:+.3f}, {hi:+.3f}]",
            )
        )
    accs = [(e["accuracy"], e.get("version", i)) for i, e in enumerate(evals) if e.get("accuracy") is not None]
    if accs:  # the best evaluation (the first of equals): what a checkpoint picked by held-out accuracy gives
        best, at = max(accs, key=lambda av: av[0])
        out["eval_accuracy_best"], out["eval_accuracy_best_version"] = best, at
        rows.append(
            (
                f"held-out accuracy, best (version {at})",
                f"{a.get('accuracy', best):.3f}" if a.get("accuracy") is not None else NA,
                f"{best:.3f}",
                f"{best - a['accuracy']:+.3f}" if a.get("accuracy") is not None else NA,
            )
        )
    if calib:
        out["confidences_parsed_start"], out["confidences_parsed_end"] = a["parsed"], b["parsed"]
        rows.append(("held-out confidences parsed", f"{a['parsed']}/{a['size']}", f"{b['parsed']}/{b['size']}", ""))
    return out, rows


def _all_failed(e: dict) -> bool:
    """An evaluation whose every reward call failed (its accuracy of 0 says nothing of the model)."""
    return bool(e.get("size")) and int(e.get("failures") or 0) >= int(e["size"])


def summary_table(
    rewards: list[float],
    evals: list[dict],
    trained_steps: int | None = None,
    total_steps: int | None = None,
    stopped: str | None = None,
    heldout: str | None = None,
    empty_steps: int = 0,
) -> dict:
    """The end-of-run summary: first vs last 10% of steps (mean batch reward) and first vs last
    held-out evaluation (accuracy; ECE and Brier when the evaluation reports them). Prints a small
    table and returns the figures.

    ``trained_steps``: steps trained by this learner (a resumed run's ``rewards`` also hold the
    earlier segments'); with 0 no learning summary is printed, only why (``stopped``: why the
    learner stopped early, e.g. a stop signal). ``heldout`` is printed under the table."""
    trained = len(rewards) if trained_steps is None else trained_steps
    out: dict = {"steps": len(rewards), "steps_trained": trained}
    if empty_steps:  # (steps with no trajectory to train on: every rollout failed, or a filter dropped all)
        out["empty_steps"] = empty_steps
    if stopped:
        out["stopped"] = stopped
        shown = f"stopped after {trained} of {total_steps} steps" if total_steps else "stopped"
        print(f"[learner] {shown}: {stopped}", flush=True)  # (a plain line: the reason in full, unwrapped)
    if empty_steps:
        print(
            f"[learner] {empty_steps} step(s) had no trajectory to train on (every rollout failed or was filtered "
            f"out) and are not counted as trained",
            flush=True,
        )
    if trained == 0:
        why = stopped or (
            f"the run was already at total_steps ({total_steps})" if total_steps is not None else "no batch was trained"
        )
        print(f"[learner] no learning summary: this run trained 0 steps ({why})", flush=True)
        if heldout:
            print(f"[learner] {heldout}", flush=True)
        return out
    if rewards:
        k = max(1, len(rewards) // 10)
        out["reward_first_10pct"] = float(np.mean(rewards[:k]))
        out["reward_last_10pct"] = float(np.mean(rewards[-k:]))
        out["reward_gain"] = out["reward_last_10pct"] - out["reward_first_10pct"]
    evals = [e for e in evals if "accuracy" in e]
    eval_rows: list = []
    if len(evals) >= 2:
        figures, eval_rows = _eval_rows(evals)
        out.update(figures)
    elif evals:
        out["eval_accuracy_start"] = evals[0]["accuracy"]
    try:
        _print_summary(out, rewards, evals, eval_rows, trained, total_steps, stopped, heldout)
    except Exception:  # a summary must never crash the end of a run
        print(out)
    return out


def _print_summary(out, rewards, evals, eval_rows, trained, total_steps, stopped, heldout) -> None:
    from rich.console import Console
    from rich.table import Table

    title = "asyncrl run summary"
    if stopped:
        title += f" (stopped after {trained} of {total_steps} steps)" if total_steps else " (stopped)"
    table = Table(title=title)
    for col, justify in (("measure", "left"), ("start", "right"), ("end", "right"), ("change", "right")):
        table.add_column(col, justify=justify)
    if rewards:
        table.add_row(
            f"batch reward (first/last 10% of {len(rewards)} steps)",
            f"{out['reward_first_10pct']:.3f}",
            f"{out['reward_last_10pct']:.3f}",
            f"{out['reward_gain']:+.3f}",
        )
    for row in eval_rows:
        table.add_row(*row)
    if len(evals) == 1:
        table.add_row(
            f"held-out accuracy (version {evals[0].get('version', 0)} only)",
            "n/a" if _all_failed(evals[0]) else f"{evals[0]['accuracy']:.3f}",
            "-",
            "-",
        )
    if any(e.get("failures") for e in evals):  # a failed reward call scores 0: say how many there were
        first, last = evals[0], evals[-1]
        table.add_row(
            "held-out reward calls failed",
            f"{first.get('failures') or 0} of {first.get('size', '?')}",
            f"{last.get('failures') or 0} of {last.get('size', '?')}" if len(evals) > 1 else "-",
            "",
        )
    console = Console(file=sys.stdout)
    console.print(table)
    if heldout:
        console.print(heldout, markup=False, highlight=False)
