"""The new-algorithm example (examples/best_of_n.py + examples/best_of_n.yaml): its rollout on the
scripted engine, its config errors, and two training steps of ``asyncrl run`` on the tiny model."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.engine.base import Engine
from asyncrl.envs.base import SingleTurnEnv
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.objectives.advantages import trajectory_advantages
from asyncrl.rollout import RolloutContext, get_workflow, workflow_class
from asyncrl.types import Task
from tests.conftest import ROOT, ScriptedEngine, read_jsonl, run_cli

CONFIG = str(ROOT / "examples" / "best_of_n.yaml")


def _rollout(replies, tasks, *overrides):
    tok = build_char_tokenizer()
    cfg = load_config(CONFIG, ["sampling.n=4", *overrides])
    engine = ScriptedEngine.per_call(tok, [replies], version=5)
    wf = get_workflow(cfg.algorithm, cfg)
    return wf.rollout(tasks, RolloutContext(engine, tok, SingleTurnEnv("arithmetic"), cfg, "actor-x", seed=1)), engine


def test_the_config_names_the_example_workflow():
    cfg = load_config(CONFIG)
    cls = workflow_class(cfg.algorithm)
    assert cls.__module__ == "examples.best_of_n" and cls is workflow_class("best_of_n")
    assert isinstance(ScriptedEngine(build_char_tokenizer(), lambda texts: []), Engine)


def test_rollout_keeps_the_best_correct_responses():
    tasks = [
        Task(id="a", prompt=[{"role": "user", "content": "2+3="}], answer=5),
        Task(id="b", prompt=[{"role": "user", "content": "1+1="}], answer=2),
    ]
    # one engine call for both tasks: 4 replies each, in task order
    replies = [("7", True), ("5", True), ("5", True), ("x", True), ("3", True), ("4", True), ("1", True), ("0", True)]
    (a, b), engine = _rollout(replies, tasks, "algo.keep=2")
    assert engine.calls == [8]
    assert a.decision["rewards"] == [0.0, 1.0, 1.0, 0.0] and a.decision["kept"] == [1, 2]
    assert [t.text for t in a.trajectories] == ["5", "5"] and all(t.advantage == 1.0 for t in a.trajectories)
    assert all(t.policy_version == 5 and t.group_id == a.id for t in a.trajectories)
    assert a.metrics["best_of_n/kept"] == 2.0 and a.metrics["best_of_n/sample_reward_mean"] == 0.5
    assert b.trajectories == [] and b.decision["kept"] == [] and b.policy_version == 5  # nothing correct
    # the learner's advantage step keeps the workflow's own advantages (a GRPO group of two equal
    # rewards alone would give 0)
    assert trajectory_advantages(a.trajectories, load_config(CONFIG).train.advantage).tolist() == [1.0, 1.0]


def test_min_reward_and_keep():
    tasks = [Task(id="a", prompt=[{"role": "user", "content": "2+3="}], answer=5)]
    replies = [("7", True), ("6", True), ("5", True), ("5", True)]
    (ep,), _ = _rollout(replies, tasks, "algo.min_reward=0.0", "algo.advantage=0.5")
    assert ep.decision["kept"] == [2] and [t.advantage for t in ep.trajectories] == [0.5]  # keep 1: the first best
    (ep,), _ = _rollout([("7", True)] * 4, tasks, "algo.min_reward=0.0", "algo.keep=3")
    assert ep.decision["kept"] == [0, 1, 2]  # all equal: the earliest samples


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"algo.keep \(9\) exceeds sampling.n \(8\)"):
        get_workflow("examples.best_of_n:BestOfNWorkflow", load_config(CONFIG, ["algo.keep=9"]))
    with pytest.raises(ConfigError, match="unknown key 'algo.top_k'"):
        get_workflow("examples.best_of_n:BestOfNWorkflow", load_config(CONFIG, ["algo.top_k=2"]))


@pytest.mark.slow
def test_asyncrl_run_trains_two_steps(tmp_path, tiny_overrides):
    steps, tasks, keep = 2, 2, 2
    overrides = [
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=bon",
        f"train.total_steps={steps}",
        f"actor.tasks_per_batch={tasks}",
        f"train.batch_tasks={tasks}",
        "sampling.n=4",
        "sampling.max_new_tokens=4",
        f"algo.keep={keep}",
        "algo.min_reward=0.0",  # the best, right or not
        "eval.size=4",
        "eval.every=0",
        "log.progress=false",
        "checkpoint.every=0",
        "actor.heartbeat_s=0.2",
    ]
    res = run_cli("run", "-c", CONFIG, *overrides, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = read_jsonl(tmp_path / "bon" / "metrics.jsonl")
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["batch_trajectories"] == tasks * keep and m["best_of_n/kept"] == keep for m in metrics)
    episodes = [e for e in read_jsonl(tmp_path / "bon" / "events.jsonl") if e["kind"] == "episode"]
    assert len(episodes) == steps * tasks
    for ep in episodes:
        assert ep["decision"]["kind"] == "best_of_n" and len(ep["decision"]["rewards"]) == 4
        assert len(ep["trajectories"]) == keep
