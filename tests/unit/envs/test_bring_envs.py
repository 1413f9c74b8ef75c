"""Environments people already have: verifiers (v1) environments and reasoning-gym tasks, through the
actor's OpenAI-compatible endpoint (asyncrl.envs.verifiers_env) and asyncrl's own loop."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.envs.base import make_env
from asyncrl.envs.tasks import split_tasks
from asyncrl.rollout.workflow import RolloutContext, get_workflow
from tests.conftest import read_jsonl, run_cli

pytest.importorskip("verifiers.v1", reason="the envs extra (pip install -e '.[envs]') is not installed")
pytest.importorskip("reasoning_gym", reason="the envs extra (pip install -e '.[envs]') is not installed")

SINGLE = "asyncrl.testing.verifiers_tasksets:AddTaskset"
MULTI = [
    "env.kwargs.taskset=asyncrl.testing.verifiers_tasksets:ToolAddTaskset",
    "env.kwargs.tool_parser=asyncrl.testing.verifiers_tasksets:add_call_parser",
    "env.max_turns=3",
]


def _rollouts(random_engine, tok, *overrides):
    cfg = load_config(None, ["env.type=verifiers", "sampling.n=2", "sampling.max_new_tokens=6", *overrides])
    train, heldout = split_tasks(cfg.tasks)
    env = make_env(cfg.env)
    return get_workflow("grpo", cfg).rollout(train[:3], RolloutContext(random_engine, tok, env, cfg, "a0", 1)), env, cfg


def test_verifiers_dataset_and_rubric(random_engine, tok):
    episodes, env, cfg = _rollouts(random_engine, tok, f"env.kwargs.taskset={SINGLE}")
    assert cfg.tasks.type == "verifiers"
    train, heldout = split_tasks(cfg.tasks)
    assert len(train) + len(heldout) == 40 and not {t.id for t in train} & {t.id for t in heldout}
    rows = [t for ep in episodes for t in ep.trajectories]
    assert len(rows) == 6 and all(not ep.decision for ep in episodes)
    for t in rows:  # the rubric's reward and metric, as named scores
        assert set(t.scores) == {"reward", "vf/correct", "vf/reply_chars"}
        assert t.scores["vf/reply_chars"] == len(t.text.strip()) and t.metadata["turns"] == 1
    # the rubric scores a right answer 1, a wrong one 0 (the verifiers Task's own @vf.reward)
    task = train[0]
    vtask = env.vtask(task)
    right = asyncio.run(env.score(vtask, [*task.prompt, {"role": "assistant", "content": vtask.data.answer}]))
    wrong = asyncio.run(env.score(vtask, [*task.prompt, {"role": "assistant", "content": "x"}]))
    assert right["reward"] == right["vf/correct"] == 1.0 and wrong["reward"] == 0.0


@pytest.mark.bwrap  # (the OS sandbox: make test-fast leaves it out)
def test_verifiers_multi_turn_tool_calls_are_one_trajectory(random_engine, tok):
    episodes, env, _ = _rollouts(random_engine, tok, *MULTI)
    rows = [t for ep in episodes for t in ep.trajectories]
    assert len(rows) == 6 and all(not ep.decision for ep in episodes)
    multi = [t for t in rows if t.metadata["turns"] > 1]
    assert multi, [t.metadata for t in rows]
    for t in multi:
        mask = t.loss_mask.tolist()
        spans = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
        assert spans == t.metadata["turns"]  # one generated span per model call, tool turns between are masked
        assert t.scores["vf/tool_calls"] >= t.metadata["turns"] - 1
        # the tool results the model saw are in the row (a call after the last model call is not); counted in
        # the tokens the model did not generate (a random model may sample <|user|> itself)
        given = tok.decode([i for i, m in zip(t.token_ids.tolist(), mask) if not m])
        assert given.count("<|user|>") == 1 + t.metadata["turns"] - 1  # the prompt, then tool turns


def test_the_readme_verifiers_command_draws_the_tasksets_tasks():
    """41.9 / 42: the README's command (the quick start's config, which sets tasks.type: arithmetic, plus
    env.type=verifiers) drew arithmetic tasks and the actor stopped on the first one. Now the taskset's
    tasks are the run's, named on either side; another task source is refused in one line."""
    from asyncrl.envs.tasks import task_stream

    for where in ("env", "tasks"):
        cfg = load_config("configs/quickstart.yaml", ["env.type=verifiers", f"{where}.kwargs.taskset={SINGLE}"])
        assert cfg.tasks.type == "verifiers" and cfg.tasks.kwargs["taskset"] == cfg.env.kwargs["taskset"] == SINGLE
        task = next(task_stream(cfg.tasks, 0))
        assert task.id.startswith("vf:") and make_env(cfg.env).vtask(task) is not None
    with pytest.raises(ValueError, match="draws its tasks from its taskset"):
        load_config(
            "configs/quickstart.yaml",
            ["env.type=verifiers", f"env.kwargs.taskset={SINGLE}", "tasks.type=reasoning_gym"],
        )


def test_verifiers_config_errors_are_one_line():
    with pytest.raises(ConfigError, match="needs its taskset: env.kwargs.taskset="):
        make_env(load_config(None, ["env.type=verifiers"]).env)
    with pytest.raises(ConfigError, match="not a verifiers Taskset"):
        make_env(
            load_config(
                None, ["env.type=verifiers", "env.kwargs.taskset=asyncrl.testing.verifiers_tasksets:AddTask"]
            ).env
        )
    with pytest.raises(ConfigError, match="refused it"):
        make_env(
            load_config(
                None, ["env.type=verifiers", f"env.kwargs.taskset={SINGLE}", "env.kwargs.config={num_taskz: 3}"]
            ).env
        )
    with pytest.raises(ConfigError, match="runs with algorithm grpo"):
        load_config(None, ["env.type=verifiers", "algorithm=rlcr"])


@pytest.mark.slow
@pytest.mark.parametrize("source", ["verifiers_single_turn", "verifiers_multi_turn", "reasoning_gym"])
def test_runs_end_to_end(tmp_path, tiny_overrides, source):
    """`asyncrl run` (learner and actor processes) on a verifiers single-turn and multi-turn
    environment and on a reasoning-gym dataset: steps train, the held-out tasks are never trained on."""
    setup = {
        "verifiers_single_turn": ["env.type=verifiers", f"env.kwargs.taskset={SINGLE}", "tasks.holdout_fraction=0.2"],
        "verifiers_multi_turn": ["env.type=verifiers", *MULTI, "tasks.holdout_fraction=0.2"],
        "reasoning_gym": [
            "tasks.type=reasoning_gym",
            "tasks.eval_size=16",
            "sampling.max_new_tokens=6",
            "tasks.kwargs={datasets: {basic_arithmetic: {min_terms: 2, max_terms: 2, "
            "min_digits: 1, max_digits: 1}}, size: 400}",
        ],
    }[source]
    res = run_cli(
        "run",
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=r",
        "train.total_steps=2",
        "sampling.n=4",
        "actor.tasks_per_batch=4",
        "train.batch_tasks=4",
        "eval.size=8",
        "log.progress=false",
        "checkpoint.every=0",
        *setup,
        timeout=400,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    run = tmp_path / "r"
    assert [m["version"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    events = read_jsonl(run / "events.jsonl")
    trained = {e["task_id"] for e in events if e["kind"] == "episode"}
    evaluated = {s["task_id"] for e in events if e["kind"] == "eval" for s in e.get("samples", [])}
    assert trained and evaluated and not trained & evaluated
    prefix = "rg:basic_arithmetic:train:" if source == "reasoning_gym" else "vf:"
    assert all(t.startswith(prefix) for t in trained)
    rows = [t for e in events if e["kind"] == "episode" for t in e["trajectories"]]
    if source.startswith("verifiers"):  # the rubric's named scores came through the learner
        assert rows and all("vf/correct" in t["scores"] for t in rows)
    if source == "verifiers_multi_turn":
        assert any(t["scores"]["vf/tool_calls"] >= 1 for t in rows)


@pytest.fixture()
def openenv_server(monkeypatch):
    """The OpenEnv test environment served by OpenEnv's own server in a real process (no Docker)."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    pytest.importorskip("openenv.core", reason="the envs extra is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.openenv_env", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the OpenEnv server did not start"
            time.sleep(0.2)
        monkeypatch.setenv("ASYNCRL_TEST_OPENENV_URL", f"http://127.0.0.1:{port}")
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_openenv_environment_through_the_agent_path(random_engine, tok, openenv_server):
    import random

    from asyncrl.types import Task

    cfg = load_config(
        None,
        [
            "env.type=agent",
            "env.agent=tests.support.agents:openenv_add",
            "sampling.n=3",
            "sampling.max_new_tokens=3",
            "sampling.temperature=2.0",
        ],
    )
    tasks = [Task(id=f"oe:{i}", prompt=[{"role": "user", "content": "(the OpenEnv server asks)"}]) for i in range(4)]
    episodes = get_workflow("grpo", cfg).rollout(
        tasks, RolloutContext(random_engine, tok, make_env(cfg.env), cfg, "a0", 1)
    )
    assert all(not ep.decision for ep in episodes) and sum(len(ep.trajectories) for ep in episodes) == 12
    for i, ep in enumerate(episodes):
        rng = random.Random(i)
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        for t in ep.trajectories:
            # the row is the question the OpenEnv server asked, and its reward is the server's verdict
            assert f"<|user|>{a}+{b}=<|end|>" in tok.decode(t.token_ids.tolist())
            expected = 1.0 if t.text.strip() == str(a + b) else -len(t.text.strip()) / 100
            assert t.reward == pytest.approx(expected) and t.scores["openenv/steps"] == 1.0
        assert any(t.reward < 0 for t in ep.trajectories)  # the server's own reward came through
