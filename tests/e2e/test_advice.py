"""What to change, on two real runs whose answer is known (issue 67): actors slowed down (every
forward of the engine waits) make the run actor-bound; a learner given eight passes over four
mini-batches a step makes it learner-bound. The advice read from each run's own files says so."""

from __future__ import annotations

import pytest
import yaml

from asyncrl.analysis.advice import advise
from tests.conftest import SMALL_RUN as COMMON
from tests.conftest import read_jsonl, run_cli, subprocess_env

pytestmark = pytest.mark.slow


def _advice(tmp_path, tiny_overrides, name: str, extra: list[str], env: dict | None = None):
    res = run_cli(
        "run",
        "-c",
        "configs/quickstart.yaml",
        *tiny_overrides,
        *COMMON,
        f"run_root={tmp_path}",
        f"name={name}",
        "train.total_steps=30",
        *extra,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / name
    events = read_jsonl(run / "events.jsonl")
    config = yaml.safe_load((run / "config.yaml").read_text())
    return advise(read_jsonl(run / "metrics.jsonl"), [e for e in events if e["kind"] == "actor_status"], config)


def test_slow_actors_are_actor_bound_and_a_slow_learner_is_learner_bound(tmp_path, tiny_overrides):
    env = {**subprocess_env(), "ASYNCRL_TEST_STEP_S": "0.05"}
    slow_actor = _advice(
        tmp_path, tiny_overrides, "slow-actor", ["engine.type=tests.support.plugins:slow_hf_engine"], env
    )
    assert slow_actor.verdict == "actor-bound", (slow_actor.lines, slow_actor.numbers)
    slow_learner = _advice(tmp_path, tiny_overrides, "slow-learner", ["train.ppo_epochs=8", "train.mini_batches=4"])
    assert slow_learner.verdict == "learner-bound", (slow_learner.lines, slow_learner.numbers)
    assert slow_actor.numbers["learner_wait_share"] > slow_learner.numbers["learner_wait_share"]
    assert slow_actor.numbers["actor_idle_share"] < slow_learner.numbers["actor_idle_share"]
