"""Where the quick start's time goes: py-spy samples of the learner and the actor during a live run,
grouped into pipeline stages.

    pip install -e '.[bench]'                                      # py-spy
    .venv/bin/python bench/profile_quickstart.py [--seconds 30] [--warm-steps 30] [--set key=value ...]

Starts ``asyncrl run -c configs/quickstart.yaml`` (learner and actor processes), waits until
``--warm-steps`` optimizer steps are logged, then records both processes' main threads with py-spy
(``--idle``: waiting counts, so each table adds up to the wall time) for ``--seconds``, stops the run
(SIGINT; killed if it does not stop) and prints for each process the share of its wall time per stage
(the first rule in ``STAGES`` that matches a sampled stack, innermost frame first) and the functions
with the most samples of their own. The optimizer steps per second during the window come from
``metrics.jsonl``. Raw py-spy stacks are kept in ``--out`` (default ``runs/profile``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (stage, a regex over one frame's "function (file:line)") -- checked innermost frame first, so the
# most specific stage wins: a zmq poll inside the actor's control handler is "wait for the learner"
STAGES: dict[str, list[tuple[str, str]]] = {
    "learner": [
        ("wait for episodes (poll)", r"^Poller\.poll|^Socket\.poll"),
        ("decode + validate", r"^decode|^decode_episode|^EpisodeValidator|^_take_episode"),
        ("WAL append + fsync", r"^EpisodeQueue\.(add|sync)|^WriteAheadLog|^Peers\._write"),
        ("ack + credits", r"^LearnerServer\.(ack|grant_credits|send_control)"),
        ("batch: advantages + collate", r"^PolicyTrainer\.make_batch|^collate|compute_advantages|^grpo_advantages"),
        (
            "optimizer + clip",
            r"^(AdamW|Optimizer)\.|^_single_tensor_adam|^_multi_tensor_adam|^_fused_adam|clip_grad_norm",
        ),
        ("backward", r"backward|^_engine_run_backward"),
        (
            "forward (log-probs, loss)",
            r"^forward_rows|^compute_logprobs|^PolicyTrainer\._(minibatch|micro)_step|policy_loss",
        ),
        ("packing + micro-batch plan", r"^pack_rows|^_tensors|^plan_micro_batches"),
        ("publish weights", r"^Learner\.publish"),
        ("evaluation", r"^Evaluator\."),
        ("checkpoint", r"^Learner\.checkpoint|save_checkpoint"),
        ("metrics + events", r"^Telemetry\.|^RunLog\.|^JsonlWriter"),
    ],
    "actor": [
        ("wait for the learner (credits, weights)", r"^Poller\.poll|^Socket\.poll"),
        ("apply weights", r"^Actor\.apply_weights|update_weights|load_state_dict"),
        (
            "model forward",
            r"^(LlamaForCausalLM|LlamaModel|Qwen2ForCausalLM|Module)\.(forward|_call_impl|_wrapped_call_impl)",
        ),
        ("sampling + engine loop", r"^HFEngine\.|^_sample|^VLLMEngine\."),
        ("environment + reward", r"^GuardedEnv\.|reward"),
        ("encode + send episodes", r"^encode|^Actor\.(send|_send)|send_multipart"),
        ("trajectory assembly", r"^Conversation\.|^scored_trajectories|^start_conversations|^run_conversations"),
    ],
}


def _stacks(path: Path) -> list[tuple[list[str], int]]:
    """The main thread's stacks (outermost first) and their sample counts from py-spy's raw output."""
    out = []
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if not any(f.startswith("_run_module_as_main") for f in frames):
            continue  # another thread: torch workers, the heartbeat
        start = next(i for i, f in enumerate(frames) if f.startswith("_run_module_as_main"))
        out.append((frames[start:], int(n)))
    return out


def classify(frames: list[str], rules: list[tuple[str, str]]) -> str:
    for frame in reversed(frames):  # innermost first
        for stage, pattern in rules:
            if re.search(pattern, frame):
                return stage
    return "other (Python)"


def report(role: str, path: Path, top: int) -> None:
    stacks = _stacks(path)
    total = sum(n for _, n in stacks)
    if not total:
        print(f"{role}: no samples of the main thread in {path}")
        return
    by_stage: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    for frames, n in stacks:
        by_stage[classify(frames, STAGES[role])] += n
        own[re.sub(r" \((.*):\d+\)$", r" (\1)", frames[-1])] += n
    print(f"\n{role} ({total} samples of its main thread)\n\n| stage | share of wall time |\n|---|---|")
    for stage, n in by_stage.most_common():
        print(f"| {stage} | {100 * n / total:.1f}% |")
    print(f"\n{role}: functions with the most samples of their own\n")
    for fn, n in own.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {fn}")


def _pids(run_dir: Path, launcher_pid: int) -> dict[str, int]:
    """The learner's pid (its pid file) and the first actor's (a child of the launcher running serve)."""
    out = {}
    lock = run_dir / "learner.pid"
    if lock.exists():
        out["learner"] = int(lock.read_text().split()[0])
    ps = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(launcher_pid)], capture_output=True, text=True)
    for line in ps.stdout.splitlines():
        pid, _, cmd = line.strip().partition(" ")
        if " serve " in f" {cmd} ":
            out.setdefault("actor", int(pid))
        elif " learn " in f" {cmd} ":
            out.setdefault("learner", int(pid))
    return out


def _steps(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="py-spy recording window")
    ap.add_argument("--warm-steps", type=int, default=30, help="steps logged before recording starts")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "profile")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--set", nargs="*", default=[], help="key=value overrides of the config")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        raise SystemExit("py-spy is not installed: pip install -e '.[bench]'")
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = args.out / "run"
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "run",
        "-c",
        str(args.config),
        "--overwrite",
        "name=run",
        f"run_root={args.out}",
        "log.progress=false",
        "train.total_steps=10000000",
        "eval.every=0",
        "checkpoint.every=0",
        *args.set,
    ]
    with open(args.out / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    spies: list[subprocess.Popen] = []
    try:
        deadline = time.time() + 600
        while len(_steps(run_dir / "metrics.jsonl")) < args.warm_steps:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(
                    f"the run stopped or did not train {args.warm_steps} steps; see {args.out / 'run.log'}"
                )
            time.sleep(0.5)
        pids = _pids(run_dir, proc.pid)
        if set(pids) != {"learner", "actor"}:
            raise SystemExit(f"could not find the learner and actor processes (found {pids})")
        before = len(_steps(run_dir / "metrics.jsonl"))
        t0 = time.time()
        for role, pid in pids.items():
            spies.append(
                subprocess.Popen(
                    [
                        spy,
                        "record",
                        "--pid",
                        str(pid),
                        "--duration",
                        str(int(args.seconds)),
                        "--idle",
                        "--nonblocking",
                        "--format",
                        "raw",
                        "--rate",
                        "200",
                        "-o",
                        str(args.out / f"{role}.txt"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                )
            )
        for s in spies:
            s.wait(timeout=args.seconds + 120)
        rows = _steps(run_dir / "metrics.jsonl")
        window = [r for r in rows[before:] if r["t"] <= t0 + args.seconds]
        trajs = sum(r.get("batch_trajectories", 0) for r in window)
        print(
            f"window: {args.seconds:.0f} s, {len(window)} optimizer steps ({len(window) / args.seconds:.2f}/s), "
            f"{trajs / args.seconds:.0f} completions/s; "
            f"learner train_s {sum(r['train_s'] for r in window):.1f} s, wait_s {sum(r['wait_s'] for r in window):.1f} s"
        )
        if window:
            st = [r.get("staleness_mean", 0.0) for r in window]
            print(f"staleness of trained episodes: mean {sum(st) / len(st):.2f}")
    finally:
        for s in spies:
            if s.poll() is None:
                s.kill()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for role in ("learner", "actor"):
        path = args.out / f"{role}.txt"
        if path.exists():
            report(role, path, args.top)


if __name__ == "__main__":
    main()
