"""Runs you can reproduce: train.deterministic, provenance.json, and an asynchronous run replayed bit for
bit from its episode archive (log.archive_episodes, asyncrl replay). Real learner and actor processes."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import read_jsonl, run_cli

pytestmark = pytest.mark.slow

# timings differ between two runs of anything; every other figure must not
TIMING = re.compile(r"(^t$|_s$|_per_s$|_ms_(mean|max)$|per_s)")
# the task ledger's counts of tasks dealt again depend on message timing (an actor that says hello twice
# before its welcome), not on what is trained; mismatch/lagged_* is measured within a share of step time
NOT_TRAINING = re.compile(r"^(ledger/|mismatch/lagged_)")
# learning signal on a barely trained model: the entropy bonus moves the weights whatever the rewards
# and small sums, which it sometimes gets right (rewards that differ within a group: advantages)
COMMON = ("eval.every=0", "log.progress=false", "train.entropy_coef=0.01", "checkpoint.keep=10", "tasks.max_operand=3")


def _weights(run, step: int) -> dict:
    return load_file(run / "checkpoints" / f"step_{step:08d}" / "model" / "model.safetensors")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _no_deprecation(res, run) -> None:
    text = res.stdout + res.stderr + "".join(p.read_text() for p in run.glob("actor-*.log"))
    found = [line for line in text.splitlines() if re.search(r"FutureWarning|DeprecationWarning|is deprecated", line)]
    assert not found, found[:3]


def test_two_deterministic_synchronous_runs_are_identical(tmp_path, tiny_overrides):
    runs = []
    for name in ("first", "second"):
        res = run_cli(
            "run",
            "-c",
            "configs/quickstart.yaml",
            *tiny_overrides,
            *COMMON,
            f"run_root={tmp_path}",
            f"name={name}",
            "train.total_steps=8",
            "checkpoint.every=4",
            "buffer.max_staleness=0",
            "train.deterministic=true",
            timeout=600,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        _no_deprecation(res, tmp_path / name)
        runs.append(tmp_path / name)
    a, b = (read_jsonl(r / "metrics.jsonl") for r in runs)
    assert len(a) == len(b) == 8
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if not (TIMING.search(k) or NOT_TRAINING.search(k))} == {
            k: v for k, v in y.items() if not (TIMING.search(k) or NOT_TRAINING.search(k))
        }
    for step in (4, 8):
        assert _same(_weights(runs[0], step), _weights(runs[1], step))
    assert not _same(_weights(runs[0], 4), _weights(runs[0], 8)), "the weights did not move: nothing was compared"
    # provenance: recorded at the start; a resume on another setup says what differs
    prov = json.loads((runs[0] / "provenance.json").read_text())
    assert prov["packages"]["torch"] == torch.__version__ and prov["python"] and prov["cpu"]
    prov["packages"]["torch"] = "0.0.1"
    (runs[0] / "provenance.json").write_text(json.dumps(prov))
    res = run_cli(
        "run",
        "-c",
        "configs/quickstart.yaml",
        *tiny_overrides,
        *COMMON,
        f"run_root={tmp_path}",
        "name=first",
        "train.total_steps=10",
        "checkpoint.every=4",
        "buffer.max_staleness=0",
        "train.deterministic=true",
        "checkpoint.resume=true",
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"torch 0.0.1 -> {torch.__version__}" in res.stderr + res.stdout
    after = json.loads((runs[0] / "provenance.json").read_text())
    assert after["resumes"][0]["differences"] == [f"torch 0.0.1 -> {torch.__version__}"]


def test_an_async_run_replays_bit_for_bit(tmp_path, tiny_overrides):
    """2 actors, staleness bound 2, 30 steps: the replay's weights equal the run's at every checkpoint;
    another loss trains the same episodes to the end, labelled; a damaged record is reported."""
    res = run_cli(
        "run",
        "-c",
        "configs/quickstart.yaml",
        *tiny_overrides,
        *COMMON,
        f"run_root={tmp_path}",
        "name=a",
        "train.total_steps=30",
        "checkpoint.every=10",
        "actor.num=2",
        "buffer.max_staleness=2",
        "log.archive_episodes=true",
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "a"
    metrics = read_jsonl(run / "metrics.jsonl")
    assert max(m["staleness_max"] for m in metrics) >= 1, "no step trained stale data: the run was not asynchronous"
    assert len(list((run / "archive").glob("step_*.arc"))) == 30
    res = run_cli("replay", str(run), timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "identical bit for bit to the run's at every checkpoint: steps [10, 20, 30]" in res.stdout
    report = json.loads((tmp_path / "a-replay" / "replay.json").read_text())
    assert report["identical"] is True and [c["step"] for c in report["checkpoints"]] == [10, 20, 30]
    assert _same(
        load_file(tmp_path / "a-replay" / "checkpoints" / "step_00000030" / "model" / "model.safetensors"),
        _weights(run, 30),
    )
    assert not _same(_weights(run, 10), _weights(run, 30))
    # what if: another loss on the same episodes
    assert any(m["reward_mean"] > 0 for m in metrics), "no reward: every loss would train the same"
    res = run_cli(
        "replay", str(run), "train.policy_loss=cispo", "train.advantage.estimator=rloo", "--to", "20", timeout=600
    )
    assert res.returncode == 0, res.stderr[-2000:]
    what_if = json.loads((tmp_path / "a-whatif" / "replay.json").read_text())
    assert what_if["label"] == "what-if: train.policy_loss=cispo train.advantage.estimator=rloo"
    assert what_if["steps"] == 20
    assert [c["step"] for c in what_if["checkpoints"]] == [10, 20] and not what_if["checkpoints"][-1]["identical"]
    assert len(read_jsonl(tmp_path / "a-whatif" / "metrics.jsonl")) == 20
    # a damaged record is reported, never skipped
    victim = run / "archive" / "step_00000005.arc"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    res = run_cli("replay", str(run), "--name", "again", timeout=600)
    assert res.returncode == 2 and "damaged archive record" in res.stderr and "step_00000005.arc" in res.stderr, (
        res.stderr
    )
