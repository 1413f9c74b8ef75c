"""asyncrl measured on a CUDA GPU (issue 50): the learner's padded and packed step at Qwen2.5-0.5B
shapes, weight sync through CUDA IPC, and the quick start with the learner and the HF engine on
the GPU.

    python bench/bench_gpu.py packing [--rows 64] [--max-len 2048] [--steps 3] [--json FILE]
    python bench/bench_gpu.py ipc [--updates 100] [--host-updates 10] [--shape qwen0.5b|tiny] [--json FILE]
    python bench/bench_gpu.py quickstart [--steps 60] [--sync zmq ipc] [--json FILE]
    python bench/bench_gpu.py realmodel --gguf FILE [--steps 20] [--device cuda] [--dtype bfloat16] [--json FILE]
    python bench/bench_gpu.py table --results DIR

``packing``: a model with Qwen2.5-0.5B's shapes (random weights, bf16, SDPA attention) trains one
:class:`PolicyTrainer` step per batch of ``--rows`` rows (groups of 8 sharing a prompt of 32-256
tokens, responses of long-tailed lengths up to ``--max-len`` in all, rewards 0/1 at random), padded
(``train.packing=false``, no rows left out) against each packed ``train.attention`` path (``mask``,
``flex``, ``varlen`` and ``auto``, rows without gradient left out); printed: the median step time
after one warm-up, the peak GPU memory, the padding share, the rows left out, the path taken and
the speed-up over padded. A path this machine cannot run is said, not timed.

``realmodel``: ``examples/smollm2.yaml`` (SmolLM2-135M-Instruct) on the GPU from its GGUF file.

``ipc``: the same model's weights (bf16, about 1 GB) published ``--updates`` times with
``sync.type: ipc`` to another process on the same GPU (``bench/ipc_child.py``, which copies each
version into tensors of its own and answers); printed: publish -> applied (the learner's ``frames``
to the child's answer, the copy into its weights included) as median / p90 / max, and the GPU
memory of both processes at the first and last update (a leak shows as growth). Then
``--host-updates`` more with ``sync.cuda_ipc=false`` (through the host segment) for comparison.

``quickstart``: ``asyncrl run -c configs/quickstart.yaml`` for ``--steps`` steps with
``train.device=cuda engine.device=cuda`` for each ``--sync`` transport; printed from its
``metrics.jsonl`` (the median over steps after the first 5): completions/s, the learner's step
time, and the mismatch between the engine's and the learner's log-probs.

Ratios and figures from one run on the card named in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

QWEN05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=1e6,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def card() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def build_model(shape: dict, device: str, dtype: str = "bfloat16"):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**shape, attn_implementation="sdpa")
    with torch.device(device):  # initialised where it runs (a 0.5B model's init is slow on a CPU)
        model = Qwen2ForCausalLM(config)
    return model.to(getattr(torch, dtype))


# --- packing ---------------------------------------------------------------------------------------


def synthetic_batch(rows: int, max_len: int, vocab: int, seed: int) -> list[dict]:
    """``rows`` rows in groups of 8: a shared prompt of 32-256 tokens, then a response whose length is
    log-normal (median 256) cut to ``max_len`` in all; reward 0/1 at random, the first group all 1
    (no advantage: its rows are left out when packed)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for g in range(rows // 8):
        prompt = rng.integers(3, vocab, int(rng.integers(32, 257))).tolist()
        for _ in range(8):
            n = max(8, int(min(max_len - len(prompt), rng.lognormal(np.log(256), 0.9))))
            out.append(
                {
                    "token_ids": prompt + rng.integers(3, vocab, n).tolist(),
                    "loss_mask": [0] * len(prompt) + [1] * n,
                    "behavior_logprobs": [0.0] * len(prompt) + (-rng.exponential(1.0, n)).tolist(),
                    "reward": 1.0 if g == 0 else float(rng.integers(0, 2)),
                    "group_id": f"g{seed}-{g}",
                }
            )
    return out


def bench_packing(args) -> dict:
    import torch
    from bench_packing import VARIANTS, _episodes

    from asyncrl.config import ConfigError, load_config
    from asyncrl.learner.training.packing import attention_kind
    from asyncrl.learner.training.trainer import PolicyTrainer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = QWEN05B if args.shape == "qwen0.5b" else TINY
    batches = [synthetic_batch(args.rows, args.max_len, shape["vocab_size"], seed) for seed in range(args.steps + 1)]
    lengths = [len(r["token_ids"]) for b in batches for r in b]
    print(
        f"packing: {card()}, {args.rows} rows/step, lengths median {statistics.median(lengths):.0f}, "
        f"max {max(lengths)}; {args.steps} timed steps after one warm-up",
        flush=True,
    )
    results = {}
    for variant in args.variants:
        overrides = [*VARIANTS["padded" if variant == "padded" else "packed"], f"train.attention={variant}"]
        cfg = load_config(None, [*overrides, f"train.device={device}", *args.overrides])
        model = build_model(shape, device)
        try:
            trainer = PolicyTrainer(model, SimpleNamespace(pad_token_id=0), cfg.train, 1.0)
        except ConfigError as e:  # a path this machine cannot run (varlen or flex off CUDA): said, not timed
            results[variant] = {"unavailable": str(e)}
            print(f"  {variant:7s} unavailable: {e}", flush=True)
            del model
            continue
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, stats = [], {}
        for version, raw in enumerate(batches):
            batch = trainer.make_batch(_episodes(raw))
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            stats = trainer.step(batch, version=version).stats
            if device == "cuda":
                torch.cuda.synchronize()
            if version:
                times.append(time.perf_counter() - t0)
        r = {
            "step_s": statistics.median(times),
            "step_s_all": times,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
            "padding_share": stats.get("learner/padding_share"),
            "rows_skipped": stats.get("learner/rows_skipped"),
            "micro_batches": stats.get("learner/micro_batches"),
            "forward_tokens": stats.get("learner/forward_tokens"),
            "path": trainer.attention,
            "model_attention": attention_kind(model),
        }
        results[variant] = r
        print(
            f"  {variant:7s} step {r['step_s'] * 1e3:8.1f} ms  peak {r['peak_gib'] or 0:6.2f} GiB  padding "
            f"{r['padding_share']}  rows skipped {r['rows_skipped']}  micro-batches {r['micro_batches']}  "
            f"path {r['path']}",
            flush=True,
        )
        del trainer, model
        if device == "cuda":
            torch.cuda.empty_cache()
    padded = results.get("padded", {}).get("step_s")
    for variant, r in list(results.items()):
        if padded and r.get("step_s"):
            r["speedup_vs_padded"] = padded / r["step_s"]
            print(f"  {variant}/padded: {r['speedup_vs_padded']:.2f}x faster step", flush=True)
    return results


# --- ipc -------------------------------------------------------------------------------------------


def _publish_series(model, n: int, cuda_ipc: bool, first_version: int, directory: str) -> dict:
    import torch
    from ipc_child import read_answer, write_frames

    from asyncrl.weights.ipc import IpcPublisher

    state = {k: v.detach() for k, v in model.named_parameters()}
    publisher = IpcPublisher(SimpleNamespace(dir=directory, cuda_ipc=cuda_ipc))
    child = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "ipc_child.py"), directory],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=False,
    )
    cuda = next(iter(state.values())).is_cuda
    latencies, answers, errors = [], [], []
    alloc_learner = []
    try:
        for i in range(n):
            version = first_version + i
            with torch.no_grad():
                next(iter(state.values())).add_(1e-3)  # a new version (the first tensor changes)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            write_frames(child.stdin, publisher.frames(state, version))
            answer = read_answer(child)
            latencies.append(time.perf_counter() - t0)
            if "error" in answer:
                errors.append(answer["error"])
            answers.append(answer)
            if cuda:
                alloc_learner.append(torch.cuda.memory_allocated())
            if (i + 1) % 25 == 0:
                print(f"    {i + 1}/{n} updates", flush=True)
    finally:
        child.stdin.close()
        child.wait(timeout=120)
        publisher.close()
    ms = sorted(1e3 * s for s in latencies)
    ok = [a for a in answers if "error" not in a]
    out = {
        "cuda_ipc": cuda_ipc,
        "updates": n,
        "errors": errors[:5],
        "n_errors": len(errors),
        "publish_to_applied_ms": {
            "first": 1e3 * latencies[0],
            "median": statistics.median(ms[1:] or ms),
            "p90": ms[int(0.9 * (len(ms) - 1))],
            "max": ms[-1],
        },
        "child_apply_ms_median": 1e3 * statistics.median(a["apply_s"] for a in ok) if ok else None,
        "child_device": ok[0]["device"] if ok else None,
    }
    if cuda and ok and "allocated" in ok[0]:  # (the child's GPU memory: only where it received on the GPU)
        out["child_allocated_mib"] = {"first": ok[0]["allocated"] / 2**20, "last": ok[-1]["allocated"] / 2**20}
        out["device_free_mib"] = {"first": ok[0]["free"] / 2**20, "last": ok[-1]["free"] / 2**20}
        out["learner_allocated_mib"] = {"first": alloc_learner[0] / 2**20, "last": alloc_learner[-1] / 2**20}
    return out


def bench_ipc(args) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = QWEN05B if args.shape == "qwen0.5b" else TINY
    model = build_model(shape, device)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"ipc: {card()}, {nbytes / 2**20:.0f} MiB of bf16 weights", flush=True)
    results = {"bytes": nbytes}
    with tempfile.TemporaryDirectory(prefix="asyncrl-ipc-") as directory:
        for label, n, cuda_ipc in (("cuda_ipc", args.updates, True), ("host", args.host_updates, False)):
            if n <= 0:
                continue
            r = _publish_series(model, n, cuda_ipc, 1 if cuda_ipc else 100_000, directory)
            results[label] = r
            lat = r["publish_to_applied_ms"]
            print(
                f"  {label:8s} {n} updates: publish -> applied median {lat['median']:.1f} ms, p90 {lat['p90']:.1f}, "
                f"max {lat['max']:.1f}, first {lat['first']:.1f}; child copy {r['child_apply_ms_median']} ms; "
                f"errors {r['n_errors']}; child GPU memory {r.get('child_allocated_mib')}, device free "
                f"{r.get('device_free_mib')}, learner {r.get('learner_allocated_mib')}",
                flush=True,
            )
        left = sorted(os.listdir(directory))
    results["segments_left"] = left
    print(f"  segments left behind: {left}", flush=True)
    return results


# --- quickstart ------------------------------------------------------------------------------------


def bench_quickstart(args) -> dict:
    results = {}
    root = Path(tempfile.mkdtemp(prefix="asyncrl-gpu-runs-"))
    for sync in args.sync:
        name = f"qs-{sync}"
        cmd = [
            sys.executable,
            "-m",
            "asyncrl",
            "run",
            "-c",
            str(ROOT / "configs" / "quickstart.yaml"),
            f"train.total_steps={args.steps}",
            "train.device=cuda",
            "engine.device=cuda",
            f"sync.type={sync}",
            f"run_root={root}",
            f"name={name}",
            "log.progress=false",
            "eval.every=0",
            "checkpoint.every=0",
            "--overwrite",
            *args.overrides,
        ]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
        wall = time.perf_counter() - t0
        metrics = (
            [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
            if (root / name / "metrics.jsonl").exists()
            else []
        )
        later = metrics[5:] or metrics

        def med(key):
            vals = [m[key] for m in later if key in m]
            return statistics.median(vals) if vals else None

        r = {
            "rc": res.returncode,
            "wall_s": wall,
            "steps": len(metrics),
            "samples_per_s": med("samples_per_s"),
            "tokens_per_s": med("tokens_per_s"),
            "train_s": med("train_s"),
            "wait_s": med("wait_s"),
            "mismatch_abs_mean": med("mismatch/logprob_abs_diff_mean"),
            "mismatch_abs_max": med("mismatch/logprob_abs_diff_max"),
            "mismatch_kl": med("mismatch/kl"),
            "applied_ms_mean": med("sync/applied_ms_mean"),
            "reward_mean_last": later[-1].get("reward_mean") if later else None,
        }
        if res.returncode != 0:
            r["tail"] = res.stdout[-1500:] + res.stderr[-2500:]
        results[sync] = r
        print(
            f"  quickstart sync={sync}: rc {r['rc']}, {r['steps']} steps in {wall:.1f} s; completions/s "
            f"{r['samples_per_s']}, learner step {r['train_s']} s, mismatch |dlogp| mean {r['mismatch_abs_mean']} "
            f"max {r['mismatch_abs_max']}, sync applied {r['applied_ms_mean']} ms",
            flush=True,
        )
        if res.returncode != 0:
            print(r["tail"], flush=True)
    return results


def bench_realmodel(args) -> dict:
    """``examples/smollm2.yaml`` on ``--device`` from the GGUF file ``--gguf`` (converted once into a model
    cache of its own): the learner's first step, its step time, completions/s, the attention path auto
    took and held-out accuracy before and after ``--steps`` steps."""
    root = Path(tempfile.mkdtemp(prefix="asyncrl-gpu-real-"))
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "run",
        "-c",
        str(ROOT / "examples" / "smollm2.yaml"),
        "model.preset=null",
        f"model.path={args.gguf}",
        f"model.embedded.cache_dir={root / 'cache'}",
        f"model.dtype={args.dtype}",
        f"train.device={args.device}",
        f"engine.device={args.device}",
        f"train.total_steps={args.steps}",
        f"eval.every={args.steps}",
        "checkpoint.every=0",
        f"run_root={root}",
        "name=real",
        "log.progress=false",
        "--overwrite",
        *args.overrides,
    ]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    wall = time.perf_counter() - t0
    run = root / "real"

    def read(f):
        return [json.loads(x) for x in (run / f).read_text().splitlines()] if (run / f).exists() else []

    metrics, events = read("metrics.jsonl"), read("events.jsonl")
    evals = [e for e in events if e.get("kind") == "eval"]
    start = next((e["t"] for e in events if e.get("kind") == "learner_start"), None)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted(run.glob("**/*.log"))) + res.stdout
    chosen = [line.split("] ", 1)[-1] for line in logs.splitlines() if "train.attention=auto" in line]
    later = metrics[2:] or metrics
    r = {
        "rc": res.returncode,
        "wall_s": wall,
        "steps": len(metrics),
        "dtype": args.dtype,
        "first_step_s": metrics[0]["t"] - start if metrics and start else None,
        "train_s": statistics.median([m["train_s"] for m in later]) if later else None,
        "samples_per_s": statistics.median([m["samples_per_s"] for m in later if "samples_per_s" in m] or [0]) or None,
        "heldout": [e.get("accuracy") for e in evals],
        "attention": chosen[-1] if chosen else None,
    }
    if res.returncode != 0:
        r["tail"] = res.stdout[-1500:] + res.stderr[-2500:]
        print(r["tail"], flush=True)
    print(
        f"  real model ({args.dtype} on {args.device}): rc {r['rc']}, {r['steps']} steps in {wall:.0f} s, first step "
        f"{r['first_step_s']} s after the learner started, learner step {r['train_s']} s, completions/s "
        f"{r['samples_per_s']}, held-out {r['heldout']}; {r['attention']}",
        flush=True,
    )
    return r


def table(args) -> dict:
    """One table of every result file in ``--results`` (JSON written by the other subcommands)."""
    rows = []
    for path in sorted(Path(args.results).glob("*.json")):
        data = json.loads(path.read_text())
        card_name = data.pop("card", "")
        if not any(isinstance(v, dict) for v in data.values()):  # one result (realmodel)
            data = {"run": data}
        for key, r in data.items():
            if not isinstance(r, dict):
                continue
            if "unavailable" in r:
                rows.append((path.stem, key, "unavailable", r["unavailable"][:70]))
                continue
            figures = {
                k: r.get(k)
                for k in (
                    "step_s",
                    "peak_gib",
                    "speedup_vs_padded",
                    "path",
                    "samples_per_s",
                    "train_s",
                    "first_step_s",
                    "heldout",
                    "attention",
                    "mismatch_abs_mean",
                    "applied_ms_mean",
                    "rc",
                )
                if r.get(k) is not None
            }
            shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
            rows.append((path.stem, key, card_name, shown))
    width = max([len(a) + len(b) for a, b, _, _ in rows] or [0]) + 3
    for a, b, c, d in rows:
        print(f"{(a + ' / ' + b):{width}s} {c:10.10s} {d}")
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("packing")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--shape", choices=["qwen0.5b", "tiny"], default="qwen0.5b")
    p.add_argument(
        "--variants",
        nargs="+",
        default=["padded", "mask", "flex", "varlen", "auto"],
        choices=["padded", "mask", "flex", "varlen", "auto"],
        help="train.attention paths",
    )
    p.add_argument(
        "-o",
        dest="overrides",
        action="append",
        default=[],
        help="a config override for every variant (-o train.micro_batch_tokens=4096), repeatable",
    )
    p = sub.add_parser("ipc")
    p.add_argument("--updates", type=int, default=100)
    p.add_argument("--host-updates", type=int, default=10)
    p.add_argument("--shape", choices=["qwen0.5b", "tiny"], default="qwen0.5b")
    p = sub.add_parser("quickstart")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sync", nargs="+", default=["zmq", "ipc"])
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("overrides", nargs="*")
    p = sub.add_parser("realmodel")
    p.add_argument("--gguf", required=True, help="the SmolLM2 GGUF file (bench/gpu_check.sh joins its two parts)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("overrides", nargs="*")
    p = sub.add_parser("table")
    p.add_argument("--results", required=True, help="a folder of the JSON files the other subcommands wrote")
    for p in sub.choices.values():
        p.add_argument("--json", type=Path)
    args = ap.parse_args()
    result = {
        "packing": bench_packing,
        "ipc": bench_ipc,
        "quickstart": bench_quickstart,
        "realmodel": bench_realmodel,
        "table": table,
    }[args.what](args)
    if args.what == "table":
        return
    result["card"] = card()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
