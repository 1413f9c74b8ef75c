"""Environments, rewards, task sources and plugins."""

from __future__ import annotations

import random

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.envs.arithmetic import arithmetic_reward, make_problem
from asyncrl.envs.base import make_env, normalize_answer
from asyncrl.envs.tasks import load_task_file, task_stream
from asyncrl.types import Task


def test_arithmetic_reward():
    task = Task(id="t", prompt=[], answer=46)
    assert arithmetic_reward(task, "46") == 1.0
    assert arithmetic_reward(task, " 46 ") == 1.0
    assert arithmetic_reward(task, "46x") == 0.0
    assert arithmetic_reward(task, "047") == 0.0
    assert arithmetic_reward(task, "") == 0.0


def test_arithmetic_tasks_are_reproducible():
    cfg = load_config(None).tasks
    a = [make_problem(random.Random(3), cfg).id for _ in range(1)]
    b = [make_problem(random.Random(3), cfg).id for _ in range(1)]
    assert a == b
    t = make_problem(random.Random(0), cfg)
    assert t.prompt[0]["content"] == f"{t.metadata['a']}+{t.metadata['b']}="
    assert t.answer == t.metadata["a"] + t.metadata["b"]


def test_normalize_answer():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"


def test_task_file_and_plugin(tmp_path):
    cfg = load_config(
        None,
        [
            "tasks.type=file",
            "tasks.path=examples/countdown_tasks.jsonl",
            "env.type=examples.countdown:RetryEnv",
            "env.reward=examples.countdown:reward",
        ],
    )
    stream = task_stream(cfg.tasks, seed=0)
    task = next(stream)
    assert task.prompt[0]["role"] == "user" and isinstance(task.answer, int)
    env = make_env(cfg.env)
    assert env.evaluate(task, [{"role": "assistant", "content": str(task.answer)}])["reward"] == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1="}\n')
    with pytest.raises(ValueError, match="no field 'prompt'"):
        load_task_file(str(bad), cfg.tasks)
    bad.write_text('{"prompt": "1+1="\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not valid JSON"):
        load_task_file(str(bad), cfg.tasks)


def test_unknown_plugin_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot import module 'nosuchpkg.envs'"):
        make_env(load_config(None, ["env.type=nosuchpkg.envs:Env"]).env)
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        make_env(load_config(None, ["env.reward=nope"]).env)
    with pytest.raises(ConfigError, match="unknown key 'env.rewrd'"):
        load_config(None, ["env.rewrd=x"])
    with pytest.raises(ConfigError, match="'sampling.temperature'"):
        load_config(None, ["sampling.temperature=-1"])


# ---- reasoning-gym (tasks.type=reasoning_gym) ----


def test_reasoning_gym_heldout_never_overlaps_training():
    pytest.importorskip("reasoning_gym", reason="the envs extra (pip install -e '.[envs]') is not installed")
    from asyncrl.config import load_config
    from asyncrl.envs.base import make_env
    from asyncrl.envs.tasks import split_tasks

    # a small problem space (one-digit sums of two terms): a training draw of 3000 repeats held-out questions
    cfg = load_config(
        None,
        [
            "tasks.type=reasoning_gym",
            "tasks.eval_size=40",
            "tasks.kwargs={datasets: "
            "{basic_arithmetic: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}, size: 3000}",
        ],
    )
    train, heldout = split_tasks(cfg.tasks)
    held = {t.prompt[0]["content"] for t in heldout}
    assert len(heldout) == 40 and not held & {t.prompt[0]["content"] for t in train}
    assert len(train) < 3000  # the repeats were removed, not kept
    assert split_tasks(cfg.tasks)[1] == heldout  # deterministic
    env = make_env(cfg.env)  # env.reward defaults to the datasets' own scorer
    t = train[0]
    assert (
        env.evaluate(t, [*t.prompt, {"role": "assistant", "content": f"so <answer>{t.answer}</answer>"}])["reward"]
        == 1.0
    )
    assert env.evaluate(t, [*t.prompt, {"role": "assistant", "content": "<answer>no</answer>"}])["reward"] == 0.0


def test_reasoning_gym_config_errors_are_one_line():
    pytest.importorskip("reasoning_gym", reason="the envs extra is not installed")
    from asyncrl.config import ConfigError, load_config
    from asyncrl.envs.tasks import split_tasks

    for kwargs, match in [
        ("{datasets: no_such_dataset}", "has no dataset 'no_such_dataset'"),
        ("{datasets: {basic_arithmetic: {bogus: 1}}}", "refused its config"),
        ("{size: 10}", "needs tasks.kwargs.datasets"),
        ("{datasets: leg_counting, sizes: 3}", "unknown key"),
    ]:
        with pytest.raises(ConfigError, match=match):
            split_tasks(load_config(None, ["tasks.type=reasoning_gym", f"tasks.kwargs={kwargs}"]).tasks)
