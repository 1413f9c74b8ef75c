"""What running verifiers tools in the bubblewrap sandbox costs (issue 41.5).

    .venv/bin/python bench/bench_tools.py [--calls 2000]

Prints, for the ``add`` tool of ``asyncrl/testing/verifiers_tasksets.py`` (a calculator a model calls): the
sandboxed worker's start (bubblewrap, a fresh interpreter, importing verifiers, building the
toolsets: paid once per actor and task class, and again after a hung tool is killed), then the
time per call through the sandbox against calling the method in process (what asyncrl did before).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (tests/ holds the taskset)

from asyncrl.envs.verifiers_env import load_taskset  # noqa: E402
from asyncrl.sandbox.tools import ToolSandbox  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    taskset = load_taskset("asyncrl.testing.verifiers_tasksets:ToolAddTaskset", None)
    vtask = next(iter(taskset))
    sandbox = ToolSandbox(type(vtask), vtask.config)
    try:
        t0 = time.perf_counter()
        assert sandbox.call("add", '{"a": 1, "b": 2}') == "3"
        start_s = time.perf_counter() - t0
        per_call = []
        for i in range(args.calls):
            t = time.perf_counter()
            sandbox.call("add", f'{{"a": {i}, "b": 1}}')
            per_call.append(time.perf_counter() - t)
    finally:
        sandbox.close()
    tool = type(vtask).toolsets(vtask.config)[0]
    t = time.perf_counter()
    for i in range(args.calls):
        tool.add(i, 1)
    in_process = (time.perf_counter() - t) / args.calls
    print(f"sandboxed worker start (first call): {start_s:.2f} s")
    print(
        f"per call, sandboxed: median {statistics.median(per_call) * 1e3:.3f} ms, "
        f"p99 {sorted(per_call)[int(0.99 * len(per_call))] * 1e3:.3f} ms ({args.calls} calls)"
    )
    print(f"per call, in process (before): {in_process * 1e6:.2f} us")


if __name__ == "__main__":
    main()
