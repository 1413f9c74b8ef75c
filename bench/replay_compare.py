"""Compare a run with experience replay against one without, at equal numbers of fresh rollouts.

    python bench/replay_compare.py runs/cmp_off runs/cmp_on [--bins 8]

Reads each run's ``metrics.jsonl`` and ``events.jsonl``. Fresh rollouts per step are
``batch_trajectories - replay/replayed_trajectories`` (replayed ones are not generated). Prints the
mean fresh-rollout reward in equal bins of cumulative fresh rollouts, and every held-out evaluation
with the fresh rollouts spent when it ran.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def curve(run: Path) -> tuple[list[tuple[int, float, float]], list[tuple[int, int, float]]]:
    """``[(version, cumulative fresh rollouts, fresh reward mean)]`` and ``[(version, fresh, eval acc)]``."""
    metrics = sorted(_jsonl(run / "metrics.jsonl"), key=lambda m: m["version"])
    rows, fresh, at = [], 0, {0: 0}
    for m in metrics:
        fresh += m["batch_trajectories"] - int(m.get("replay/replayed_trajectories", 0))
        at[m["version"]] = fresh
        rows.append((m["version"], fresh, m["reward_mean"]))
    evals = [
        (e["step"], at.get(e["step"], fresh), e["accuracy"])
        for e in _jsonl(run / "events.jsonl")
        if e["kind"] == "eval"
    ]
    return rows, evals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--bins", type=int, default=8)
    args = ap.parse_args()
    curves = {r.name: curve(r) for r in args.runs}
    top = min(rows[-1][1] for rows, _ in curves.values())
    edges = [round(top * i / args.bins) for i in range(args.bins + 1)]
    print(f"fresh-rollout reward, mean per bin of cumulative fresh rollouts (common range 0..{top})")
    print("fresh rollouts".ljust(18) + "".join(name.rjust(12) for name in curves))
    for lo, hi in zip(edges, edges[1:]):
        cells = []
        for rows, _ in curves.values():
            sel = [r for _, f, r in rows if lo < f <= hi]
            cells.append(f"{sum(sel) / len(sel):.3f}" if sel else "-")
        print(f"{lo:>7}-{hi:<9}" + "".join(c.rjust(12) for c in cells))
    for name, (rows, evals) in curves.items():
        print(f"\n{name}: {rows[-1][0]} steps, {rows[-1][1]} fresh rollouts; held-out greedy accuracy:")
        print("  " + ", ".join(f"v{v} ({f} fresh) {a:.3f}" for v, f, a in evals))


if __name__ == "__main__":
    main()
