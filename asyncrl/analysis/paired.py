"""Did held-out accuracy change? Two evaluations of the same held-out problems, compared problem by problem.

Each evaluation's ``eval`` event keeps every problem's outcome (``samples``: ``task_id``, ``correct``;
``log.eval_samples``). The paired difference ``d_i = after_i - before_i`` (each -1, 0 or 1) has mean
``after - before``; its 95% interval is ``mean +- 1.96 * sd(d) / sqrt(n)`` (normal approximation; n of
a few hundred). A change whose interval lies above 0 is one the run made, not the luck of which
problems were drawn.
"""

from __future__ import annotations

import math


def paired_change(before: dict, after: dict) -> dict | None:
    """``{before, after, change, ci95: (low, high), n, gained, lost}`` over the problems both evaluations
    recorded (``samples`` of an ``eval`` event); None when they share fewer than 2."""
    a = {s["task_id"]: bool(s["correct"]) for s in before.get("samples") or [] if "task_id" in s}
    b = {s["task_id"]: bool(s["correct"]) for s in after.get("samples") or [] if "task_id" in s}
    ids = sorted(set(a) & set(b))
    n = len(ids)
    if n < 2:
        return None
    d = [int(b[i]) - int(a[i]) for i in ids]
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = 1.96 * sd / math.sqrt(n)
    return {
        "before": sum(a[i] for i in ids) / n,
        "after": sum(b[i] for i in ids) / n,
        "change": mean,
        "ci95": (mean - half, mean + half),
        "n": n,
        "gained": d.count(1),
        "lost": d.count(-1),
    }
