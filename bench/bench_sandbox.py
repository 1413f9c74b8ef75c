"""Cost of the bwrap sandbox: wall time of one sandboxed run of a small code_o program with
``isolation: none`` (a plain subprocess) and ``isolation: bwrap``, interleaved, N runs each.

    .venv/bin/python bench/bench_sandbox.py [--runs 100]

Prints the median and mean per run for both, the difference and the ratio. The static check and
the determinism check are off (one run per call) so that only the process start-up is compared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.sandbox.python import SandboxLimits, isolation_problem, run_python

PROGRAM = "def f(xs):\n    return sorted(xs)[::-1]\nprint(repr(f([3, 1, 2])))"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    args = ap.parse_args()
    problem = isolation_problem(SandboxLimits())
    if problem:
        raise SystemExit(problem)
    limits = {iso: SandboxLimits(isolation=iso, determinism_runs=1) for iso in ("none", "bwrap")}
    times: dict[str, list[float]] = {iso: [] for iso in limits}
    for lim in limits.values():  # warm-up (the bwrap probe, page cache)
        assert run_python(PROGRAM, lim, check=False).output == "[3, 2, 1]"
    for _ in range(args.runs):
        for iso, lim in limits.items():
            t0 = time.perf_counter()
            res = run_python(PROGRAM, lim, check=False)
            times[iso].append(time.perf_counter() - t0)
            assert res.ok, res.reason
    med = {iso: statistics.median(t) * 1e3 for iso, t in times.items()}
    mean = {iso: statistics.fmean(t) * 1e3 for iso, t in times.items()}
    print(f"{args.runs} runs each, one sandboxed run per call")
    for iso in limits:
        print(f"  isolation {iso:5}: median {med[iso]:6.1f} ms   mean {mean[iso]:6.1f} ms")
    print(
        f"  bwrap - none: median {med['bwrap'] - med['none']:+.1f} ms; ratio bwrap/none: "
        f"median {med['bwrap'] / med['none']:.2f}x, mean {mean['bwrap'] / mean['none']:.2f}x"
    )


if __name__ == "__main__":
    main()
