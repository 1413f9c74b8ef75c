"""What the guarantees of issue 66 cost (no processes, no model download):

- the weight digest (``asyncrl.weights.digest``) of a 0.5B bfloat16 model's shapes (Qwen2.5-0.5B:
  24 layers, hidden 896, intermediate 4864, vocab 151936, tied embeddings), and of the quick
  start's embedded model;
- the actor's check that its engine holds what arrived (``HFEngine.loaded_mismatch``: one compare
  per tensor), on the 0.5B shapes;
- the task ledger's bookkeeping for one quick-start step (8 tasks dealt, delivered and trained).

    .venv/bin/python bench/bench_receipts.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_ray import qwen05b_shapes  # noqa: E402 (bench/, beside this script)

from asyncrl.learner.ledger import TaskLedger  # noqa: E402
from asyncrl.types import Episode, Task  # noqa: E402
from asyncrl.weights.digest import tensor_crcs, weights_digest  # noqa: E402


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"cpus: {os.cpu_count()}, torch threads: {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(0)
    big = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in qwen05b_shapes().items()}
    nbytes = sum(t.numel() * t.element_size() for t in big.values())
    params = sum(t.numel() for t in big.values())
    ts = timed(lambda: weights_digest(big), args.repeat)
    print(
        f"digest, 0.5B bf16 shapes ({params / 1e6:.0f}M parameters, {nbytes / 2**20:.0f} MiB, {len(big)} tensors): "
        f"min {min(ts):.3f} s, median {sorted(ts)[len(ts) // 2]:.3f} s ({nbytes / min(ts) / 1e9:.2f} GB/s)"
    )
    held = {n: t.clone() for n, t in big.items()}
    ts = timed(lambda: tensor_crcs(held) == tensor_crcs(big), args.repeat)
    print(f"engine holds what arrived (HF engine on a CPU: the CRC32C of both), 0.5B bf16: min {min(ts):.3f} s")
    tiny = {f"w{i}": torch.randn(128, 128) for i in range(38)}  # about the quick start's 4 MB of float32
    tiny["embed"] = torch.randn(100, 128)
    ts = timed(lambda: weights_digest(tiny), max(args.repeat, 20))
    print(
        f"digest, the quick start's model size ({sum(t.numel() * 4 for t in tiny.values()) / 1e6:.1f} MB): "
        f"min {min(ts) * 1e3:.2f} ms"
    )
    tasks = [Task(f"t{i}", [{"role": "user", "content": f"{i}+1="}], i + 1) for i in range(4000)]
    with tempfile.TemporaryDirectory() as d:
        ledger = TaskLedger(tasks, None, 0, Path(d), ["stale", "rejected"], grace_s=5.0)
        ledger.open_log(0)
        actor = SimpleNamespace(identity=b"actor-0:1:x", actor_id="actor-0")
        steps = 300

        def one_step(v: int) -> None:
            dealt = ledger.credit_work(actor, 8, v)["deal"]
            eps = [Episode(trajectories=[], actor_id="actor-0", task=x.task, ticket=x.ticket) for x in dealt]
            for ep in eps:
                ledger.arrived(ep, v)
            ledger.after_step(eps, None, v)
            ledger.sweep({actor.identity}, v)

        t0 = time.perf_counter()
        for v in range(steps):
            one_step(v)
        per = (time.perf_counter() - t0) / steps
        t0 = time.perf_counter()
        ledger.save(Path(d))
        save_s = time.perf_counter() - t0
        ledger.close()
    print(
        f"ledger, one quick-start step (8 tasks dealt, delivered, trained): {per * 1e6:.0f} us; "
        f"its checkpoint part (fsync the record, write the state): {save_s * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
