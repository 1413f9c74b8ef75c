"""Demo runs for the notebooks and tests: a real ``asyncrl run`` of an algorithm on the embedded
model, made once and reused while its settings are the same."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from .jsonl import quiet_records

__all__ = ["demo_run", "notebook_run", "TINY_MODEL_OVERRIDES", "RUN_ENV"]

PROJECT = Path(__file__).resolve().parents[2]  # the checkout: asyncrl/analysis/demo_runs.py
RUN_ENV = "ASYNCRL_RUN"  # the run a notebook reads when its RUN_DIR cell is left at None


def notebook_run(algorithm: str, run_dir: str | Path | None = None) -> Path:
    """The run directory a notebook reads: ``run_dir`` (its ``RUN_DIR`` cell, or papermill's
    ``-p RUN_DIR``), else the ``ASYNCRL_RUN`` environment variable, else the default demo run of
    ``algorithm`` under ``runs/`` (made once, then reused). A relative path is taken from the
    project root (not from ``notebooks/``, where Jupyter runs)."""
    chosen = run_dir or os.environ.get(RUN_ENV) or None
    if chosen is None:
        return demo_run(algorithm, run_root=PROJECT / "runs")
    path = Path(chosen).expanduser()
    path = (path if path.is_absolute() else PROJECT / path).resolve()
    if not path.is_dir():
        where = "RUN_DIR" if run_dir else RUN_ENV
        raise FileNotFoundError(
            f"{where}={chosen!r}: no run directory at {path} (a relative path is taken from the project root {PROJECT})"
        )
    return path


# ------------------------------------------------------------------------------------- demo runs
TINY_MODEL_OVERRIDES = [
    "model.embedded.hidden_size=32",
    "model.embedded.num_layers=1",
    "model.embedded.num_heads=2",
    "model.embedded.intermediate_size=64",
    "model.embedded.warmup_steps=20",
    "model.embedded.warmup_batch_size=16",
    "model.embedded.warmup_lr=3e-3",
]

# quick=True: a very small model and batches, a few steps: the shape of every view in seconds (tests)
_QUICK = {
    "grpo": (
        "configs/quickstart.yaml",
        ["train.batch_tasks=4", "actor.tasks_per_batch=4", "sampling.n=4", "eval.size=8", "eval.every=2"],
    ),
    "absolute_zero": (
        "configs/absolute_zero.yaml",
        [
            "model.embedded.warmstart_formats=[arithmetic]",
            "train.batch_tasks=4",
            "actor.tasks_per_batch=4",
            "train.lr=1e-3",
            "eval.size=8",
            "eval.every=2",
            "algo.mode=joint",
            "algo.proposer_update=group",
            "algo.questions_per_prompt=8",
            "algo.rollout_n=3",
            "algo.max_repropose_attempts=5",
            "algo.arithmetic.min_operators=0",
            "algo.learnability.safety.min_ratio=0",
            "algo.learnability.completion.min_ratio=0",
            "algo.learnability.completion.max_ratio=1",
        ],
    ),
    "rlcr": (
        "configs/rlcr.yaml",
        [
            "model.embedded.warmup_steps=5",
            "model.embedded.warmup_batch_size=8",
            "actor.tasks_per_batch=2",
            "train.batch_tasks=2",
            "eval.size=8",
            "eval.every=2",
            "algo.num_generations_answer=2",
            "algo.num_generations_confidence=2",
            "algo.answer_max_new_tokens=24",
            "algo.confidence_max_new_tokens=16",
        ],
    ),
}
# the notebooks' default demos: settings that learn within minutes on two CPU cores (overrides, steps)
_LEARNING = {
    "grpo": (["eval.every=25", "eval.size=100", "log.sample_every=10"], 100),
    "absolute_zero": (["eval.every=10", "eval.size=100", "log.sample_every=5"], 40),
    "rlcr": (
        [
            "model.embedded.warmup_steps=300",
            "model.embedded.warmup_batch_size=32",
            "actor.tasks_per_batch=4",
            "train.batch_tasks=4",
            "eval.size=100",
            "eval.every=10",
            "algo.num_generations_answer=4",
            "algo.num_generations_confidence=2",
            "train.lr=3e-4",
            "log.sample_every=5",
        ],
        40,
    ),
}


def demo_run(
    algorithm: str = "grpo",
    run_root: str | Path = "runs",
    name: str | None = None,
    steps: int | None = None,
    extra_overrides: list[str] | None = None,
    project_root: str | Path | None = None,
    reuse: bool = True,
    timeout: float = 3600,
    quick: bool = False,
) -> Path:
    """A real run of ``algorithm`` (grpo, absolute_zero, rlcr) with the embedded model (``asyncrl
    run`` in a subprocess); returns its run directory. By default the settings learn within minutes
    on two CPU cores (the embedded model is built once and cached); ``quick`` uses a very small
    model and a few steps instead (seconds: every view has data, nothing is learned). With
    ``reuse``, a finished run already there (a ``learner_stop`` event) is returned as is."""
    if algorithm not in _QUICK:
        raise ValueError(f"no demo run for algorithm {algorithm!r}; choose one of {sorted(_QUICK)}")
    root = Path(project_root) if project_root else PROJECT
    config, quick_overrides = _QUICK[algorithm]
    if quick:
        overrides, steps = [*TINY_MODEL_OVERRIDES, *quick_overrides], steps or 4
    else:
        overrides, default_steps = _LEARNING[algorithm]
        steps = steps or default_steps
    if not (root / config).exists():
        raise FileNotFoundError(f"{root / config} not found: pass project_root= (the asyncrl checkout)")
    name = name or f"demo-{algorithm}"
    run_dir = Path(run_root).resolve() / name
    args = [
        *overrides,
        f"run_root={Path(run_root).resolve()}",
        f"name={name}",
        f"train.total_steps={steps}",
        "log.progress=false",
        "checkpoint.every=0",
        "checkpoint.resume=false",
        "actor.heartbeat_s=0.5",
        *(["log.sample_every=1"] if quick else []),
        *(extra_overrides or []),
    ]
    marker = run_dir / ".asyncrl-demo"
    made_with = json.dumps({"made by": "asyncrl.analysis.demo_runs.demo_run", "config": config, "overrides": args})
    if (
        reuse
        and _read_text(marker) == made_with
        and any(r.get("kind") == "learner_stop" for r in quiet_records(run_dir / "events.jsonl"))
    ):
        return run_dir  # finished, with these very settings
    if run_dir.exists():
        if not marker.exists():
            raise FileExistsError(f"{run_dir} exists and is not a demo run; choose another name or run_root")
        shutil.rmtree(run_dir)  # unfinished, made with other settings, or not to be reused: start afresh
    run_dir.mkdir(parents=True)
    marker.write_text(made_with)
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl", "run", "-c", str(root / config), *args],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # its own process group: killed whole below
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # timed out or interrupted: the launcher and its children
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the demo run failed (exit {proc.returncode}):\n{out[-2000:]}\n{err[-2000:]}")
    return run_dir


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
