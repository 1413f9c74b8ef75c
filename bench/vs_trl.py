"""asyncrl against TRL's GRPOTrainer on the same CPU, model, task and settings, for the same wall time.

    pip install -e '.[bench]'                     # TRL (and matplotlib) for this script
    .venv/bin/python bench/vs_trl.py --minutes 5  # both, one after the other; table + PNG
    .venv/bin/python bench/vs_trl.py --minutes 3 --pairs quickstart raw1m raw4m copy48  # four task/model pairs

``--pairs`` races each named task/model pair (``PAIRS`` below: the quick start; the same task on a
model warm-started on raw, template-free prompts, at 1M and 4M parameters; copying strings of up to
40 characters with up to 48 new tokens) and ends with one table of all.

Both train the embedded quick-start model (``configs/quickstart.yaml``) on its task (two-digit
addition, the same training stream without the held-out problems) with the same settings: prompts
and completions per step (``train.batch_tasks`` x ``sampling.n``), ``sampling.max_new_tokens``,
temperature, learning rate (constant), AdamW betas and weight decay, gradient clipping, PPO clip,
no KL, group-normalised advantages, and token-mean loss aggregation (TRL's ``loss_type="dapo"``:
the sum over every completion token of the batch divided by their number). asyncrl runs as
``asyncrl run`` (learner and actor processes, the config's staleness bound), TRL in one process;
each in a fresh process, stopped after ``--minutes`` of training.

Fairness: both get the same tokens per step; each runs at its best thread setting for the machine
(asyncrl: one torch thread per process, ``auto``; TRL: torch's default, one thread per core, which
was faster than one thread; ``--threads``); TRL logs every 10 steps (``--trl-logging-steps``).
Both are timed from their first to their last optimizer step, after model loading and warm-up.

Printed for both: completions trained per second (between the first and the last optimizer step),
mean batch reward per minute of training, and held-out greedy accuracy of the final weights on the
quick start's held-out problems, computed here for both with the same code
(:class:`asyncrl.learner.evaluate.Evaluator`). ``--png`` (default ``runs/vs_trl/vs_trl.png``):
batch reward over wall time for both.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# task/model pairs raced by ``--pairs``: (config, overrides for both systems, what it is)
PAIRS: dict[str, tuple[str, list[str], str]] = {
    "quickstart": (
        "configs/quickstart.yaml",
        [],
        "two-digit addition, embedded 1.05M Llama, chat prompts (9 tokens), 6 new tokens",
    ),
    "raw1m": (
        "configs/quickstart.yaml",
        ["model.embedded.prompt_format=raw"],
        "two-digit addition, 1.05M Llama warm-started on raw prompts (6 tokens, no template), 6 new tokens",
    ),
    "raw4m": (
        "configs/quickstart.yaml",
        [
            "model.embedded.prompt_format=raw",
            "model.embedded.hidden_size=256",
            "model.embedded.intermediate_size=1024",
            "model.embedded.num_heads=8",
        ],
        "two-digit addition, 4.2M Llama (width 256, 8 heads), raw prompts, 6 new tokens",
    ),
    "copy48": (
        "examples/longtail.yaml",
        ["tasks.kwargs.long_share=0.5", "sampling.max_new_tokens=48"],
        "copy a string (half of them 24-40 characters), 1.05M Llama, chat prompts, up to 48 new tokens",
    ),
    "smollm2": (
        "examples/smollm2.yaml",
        [],
        "sums of two numbers 0-29 after two worked examples, SmolLM2-135M-Instruct (a real pretrained chat "
        "model, 49k vocabulary), up to 24 new tokens",
    ),
}


def _cfg(args):
    from asyncrl.config import load_config

    return load_config(str(args.config), args.set)


def heldout_accuracy(cfg, model, tokenizer) -> float:
    from asyncrl.learner.evaluate import Evaluator

    return float(Evaluator(cfg, tokenizer).maybe_run(model, 0, force=True)["accuracy"])


def per_minute(points: list[tuple[float, float]]) -> list[float]:
    """Mean reward of the steps in each minute since the first step; ``points`` are (t, reward)."""
    if not points:
        return []
    t0 = points[0][0]
    bins: dict[int, list[float]] = {}
    for t, r in points:
        bins.setdefault(int((t - t0) // 60), []).append(r)
    return [statistics.fmean(bins[k]) for k in sorted(bins)]


def summary(name: str, steps: list[tuple[float, int, float]], accuracy: float) -> dict:
    """``steps``: (time, completions, batch reward) per optimizer step."""
    span = steps[-1][0] - steps[0][0] if len(steps) > 1 else float("nan")
    done = sum(c for _, c, _ in steps[1:])  # completions trained after the first step's timestamp
    return {
        "name": name,
        "steps": len(steps),
        "completions": sum(c for _, c, _ in steps),
        "completions_per_s": done / span if span > 0 else None,
        "reward_per_minute": per_minute([(t, r) for t, _, r in steps]),
        "heldout_accuracy": accuracy,
        "curve": [(t - steps[0][0], r) for t, _, r in steps],
    }


# -- TRL -----------------------------------------------------------------------------------------


def trl_worker(args) -> None:
    """TRL's GRPOTrainer with the asyncrl config's settings; prints one JSON line."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.envs.base import get_reward_fn, scores_from
    from asyncrl.envs.tasks import task_stream
    from asyncrl.models.loading import load_model, load_tokenizer, resolve_model_path
    from asyncrl.prompts import render_tokens

    cfg = _cfg(args)
    torch.manual_seed(cfg.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(cfg.model, seed=cfg.seed)
    tokenizer = load_tokenizer(path, cfg.tasks.prompt_format)
    model = load_model(path, cfg.model.dtype)
    stream = task_stream(cfg.tasks, cfg.seed)
    tasks = {}
    rows = []
    for _ in range(args.trl_prompts):
        task = next(stream)
        # TRL tokenizes a text prompt with add_special_tokens=False: keep the template's special tokens
        # in the text so that it sees the same token ids as asyncrl's actor
        ids = render_tokens(tokenizer, task.prompt)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if tokenizer(text, add_special_tokens=False)["input_ids"] != ids:
            raise SystemExit(f"the prompt {text!r} does not tokenize back to the actor's ids {ids}")
        tasks[task.id] = task
        rows.append({"prompt": text, "task_id": task.id})
    reward_fn = get_reward_fn(cfg.env.reward)

    def reward(prompts, completions, task_id, **_):
        return [scores_from(reward_fn(tasks[i], c))["reward"] for i, c in zip(task_id, completions)]

    t = cfg.train
    targs = GRPOConfig(
        output_dir=str(Path(args.run_root) / "trl"),
        per_device_train_batch_size=t.batch_tasks * cfg.sampling.n,
        num_generations=cfg.sampling.n,
        max_completion_length=cfg.sampling.max_new_tokens,
        temperature=cfg.sampling.temperature,
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        adam_beta1=t.betas[0],
        adam_beta2=t.betas[1],
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        epsilon=t.clip_low,
        epsilon_high=t.clip_high,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        use_cpu=True,
        max_steps=10**7,
        logging_steps=args.trl_logging_steps,
        report_to="none",
        save_strategy="no",
        seed=cfg.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    log: list[tuple[float, int, float]] = []
    minutes = args.minutes

    class Clock(TrainerCallback):
        """Each optimizer step's end time (TRL calls on_step_end before on_log); a logged reward (the
        mean of the last ``logging_steps`` steps) goes to the steps since the previous log."""

        logged = 0  # steps in ``log`` that have their reward

        def on_log(self, _args, state, control, logs=None, **_):
            if logs and "reward" in logs:
                log[self.logged :] = [(tt, c, float(logs["reward"])) for tt, c, _ in log[self.logged :]]
                self.logged = len(log)

        def on_step_end(self, _args, state, control, **_):
            log.append((time.time(), t.batch_tasks * cfg.sampling.n, None))
            if time.time() - log[0][0] >= minutes * 60:
                control.should_training_stop = True

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=targs,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    log[:] = [row for row in log if row[2] is not None]  # steps after the last log carry no reward
    acc = heldout_accuracy(cfg, trainer.model, tokenizer)
    print("RESULT " + json.dumps(summary("TRL GRPOTrainer", log, acc)), flush=True)


# -- asyncrl -------------------------------------------------------------------------------------


def run_asyncrl(args) -> dict:
    """``asyncrl run`` for ``--minutes`` of training (stopped with SIGINT: it checkpoints), then the
    held-out accuracy of the checkpoint it saved."""
    from asyncrl.models.loading import load_model, load_tokenizer
    from asyncrl.rundir.layout import latest_checkpoint

    cfg = _cfg(args)
    name = "asyncrl"
    run_dir = Path(args.run_root) / name
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "run",
        "-c",
        str(args.config),
        "--overwrite",
        f"name={name}",
        f"run_root={args.run_root}",
        "log.progress=false",
        "train.total_steps=10000000",
        "eval.every=0",
        "checkpoint.every=0",
        *args.set,
    ]
    with open(Path(args.run_root) / f"{name}.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        first = None
        while proc.poll() is None:
            if first is None and metrics.exists() and metrics.stat().st_size:
                first = time.time()
            if first is not None and time.time() - first >= args.minutes * 60:
                os.killpg(proc.pid, signal.SIGINT)  # the learner checkpoints and everything stops
                proc.wait(timeout=120)
                break
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [(m["t"], int(m.get("batch_trajectories", 0)), float(m["reward_mean"])) for m in rows]
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise SystemExit(f"asyncrl left no checkpoint in {run_dir}; see {Path(args.run_root) / (name + '.log')}")
    tokenizer = load_tokenizer(ckpt / "model", cfg.tasks.prompt_format)
    acc = heldout_accuracy(cfg, load_model(ckpt / "model", cfg.model.dtype), tokenizer)
    return summary("asyncrl", steps, acc)


def run_trl(args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--trl-worker",
        "--minutes",
        str(args.minutes),
        "--config",
        str(args.config),
        "--run-root",
        args.run_root,
        "--trl-logging-steps",
        str(args.trl_logging_steps),
        *(["--threads", str(args.threads)] if args.threads else []),
        *(["--set", *args.set] if args.set else []),
    ]
    with open(Path(args.run_root) / "trl.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=out, text=True, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=args.minutes * 60 + 900)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the TRL run failed (exit {proc.returncode}); see {Path(args.run_root) / 'trl.log'}")
    return json.loads(lines[-1][len("RESULT ") :])


def report(results: list[dict], png: Path) -> None:
    print("| system | steps | completions/s | reward per minute | held-out accuracy |\n|---|---|---|---|---|")
    for r in results:
        rpm = ", ".join(f"{x:.2f}" for x in r["reward_per_minute"])
        cps = r["completions_per_s"]
        print(f"| {r['name']} | {r['steps']} | {cps:.0f} | {rpm} | {r['heldout_accuracy']:.3f} |")
    if len(results) == 2 and all(r["completions_per_s"] for r in results):
        a, b = results
        print(f"{a['name']} / {b['name']}: completions/s {a['completions_per_s'] / b['completions_per_s']:.2f}x")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        pts = r["curve"]
        k = max(1, len(pts) // 60)  # a running mean over ~1/60 of the run
        ys = [statistics.fmean(y for _, y in pts[max(0, i - k + 1) : i + 1]) for i in range(len(pts))]
        ax.plot([t / 60 for t, _ in pts], ys, label=f"{r['name']} (held-out {r['heldout_accuracy']:.2f})")
    ax.set_xlabel("minutes of training")
    ax.set_ylabel("batch reward (running mean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"plot: {png}")


def race(args) -> list[dict]:
    """asyncrl then TRL (or ``--only`` one) on ``args.config`` / ``args.set``; table and PNG."""
    Path(args.run_root).mkdir(parents=True, exist_ok=True)
    results = []
    if args.only != "trl":
        results.append(run_asyncrl(args))
        print(f"asyncrl: {results[-1]['steps']} steps, held-out {results[-1]['heldout_accuracy']:.3f}", flush=True)
    if args.only != "asyncrl":
        results.append(run_trl(args))
        print(f"TRL: {results[-1]['steps']} steps, held-out {results[-1]['heldout_accuracy']:.3f}", flush=True)
    report(results, args.png or Path(args.run_root) / "vs_trl.png")
    return results


def race_pairs(args) -> None:
    """Each of ``--pairs`` in turn (its own run root, table and PNG); then one table of all."""
    root, user_set, rows = Path(args.run_root), list(args.set), []
    for name in args.pairs:
        config, overrides, what = PAIRS[name]
        args.config, args.set = ROOT / config, [*overrides, *user_set]
        args.run_root, args.png = str(root / name), None
        print(f"== {name}: {what}", flush=True)
        rows.append({"pair": name, "what": what, "results": race(args)})
        (root / "pairs.json").write_text(json.dumps(rows))
    print(
        "| pair | asyncrl completions/s | TRL completions/s | ratio | asyncrl held-out | TRL held-out |\n"
        "|---|---|---|---|---|---|"
    )
    for row in rows:
        by = {r["name"]: r for r in row["results"]}
        a, t = by.get("asyncrl"), by.get("TRL GRPOTrainer")
        if a and t and a["completions_per_s"] and t["completions_per_s"]:
            print(
                f"| {row['pair']} | {a['completions_per_s']:.0f} | {t['completions_per_s']:.0f} | "
                f"{a['completions_per_s'] / t['completions_per_s']:.2f}x | {a['heldout_accuracy']:.3f} | "
                f"{t['heldout_accuracy']:.3f} |"
            )
    print(f"results: {root / 'pairs.json'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="training wall time for each system")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    ap.add_argument(
        "--pairs",
        nargs="+",
        choices=sorted(PAIRS),
        default=None,
        help="race these task/model pairs one after the other (instead of --config)",
    )
    ap.add_argument("--only", choices=["asyncrl", "trl"], help="run just one of the two")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for TRL (default: torch's choice)")
    ap.add_argument("--run-root", default=str(ROOT / "runs" / "vs_trl"))
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--set", nargs="*", default=[], help="key=value overrides of the config, for both")
    ap.add_argument(
        "--trl-logging-steps",
        type=int,
        default=10,
        help="TRL's logging_steps (its per-log overhead is paid every k steps; every step cost it "
        "10%% of its throughput on the quick-start pair)",
    )
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trl-prompts", type=int, default=20_000, help=argparse.SUPPRESS)
    args = ap.parse_args()
    Path(args.run_root).mkdir(parents=True, exist_ok=True)
    if args.trl_worker:
        return trl_worker(args)
    if args.pairs:
        return race_pairs(args)
    race(args)


if __name__ == "__main__":
    main()
