"""Bad input from users: every case is one clear line naming the file, field or function, nothing is
left half-written, and broken reward functions are recorded rather than fatal."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from asyncrl.config import load_config
from asyncrl.envs.base import make_env
from asyncrl.envs.guard import EnvFailure, TooManyFailures
from asyncrl.envs.tasks import describe_heldout, split_tasks
from asyncrl.learner.training.trainer import PolicyTrainer
from asyncrl.models.tiny import build_char_tokenizer
from asyncrl.types import Episode, Task, Trajectory
from tests.conftest import ROOT, kill_tree, read_jsonl, run_cli, start_cli, subprocess_env

TASK = Task(id="t1", prompt=[{"role": "user", "content": "1+1="}], answer=2)
REPLY = [{"role": "assistant", "content": "2"}]


# ---- start-up: one line, nothing written --------------------------------------------------------


def _refused(tmp_path, *args: str, command: str = "run") -> str:
    """Run ``asyncrl COMMAND`` expecting a start-up refusal; returns its one-line message."""
    res = run_cli(command, f"run_root={tmp_path / 'runs'}", "name=bad", *args, cwd=ROOT, timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "runs").exists(), "a run directory was written before the check"
    return res.stderr.strip()


def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: 1e-5\n  batch_tasks: [1, 2\nsampling:\n  n: 4\n")
    msg = _refused(tmp_path, "-c", str(bad))
    assert msg.startswith(f"asyncrl run: {bad}:4:") and "YAML syntax error" in msg


@pytest.mark.parametrize(
    "content, expected",
    [
        (
            b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "caf\xe9", "answer": 3}\n',
            r"tasks\.jsonl:2: not UTF-8 \(byte 0xe9",
        ),
        (b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2="}\n', r"tasks\.jsonl:2: no 'answer'"),
        (b'{"prompt": "1+1=", "answer": 2}\n{"question": "2+2=", "answer": 4}\n', r"tasks\.jsonl:2: no field 'prompt'"),
        (b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2=", "answer": 4\n', r"tasks\.jsonl:2: not valid JSON"),
        (
            b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "' + b"x" * 2_000_000 + b'", "answer": 1}\n',
            r"tasks\.jsonl:2: record of 2,000,0\d\d bytes, more than tasks\.max_record_bytes",
        ),
    ],
    ids=["not-utf8", "no-answer", "no-prompt", "bad-json", "huge-record"],
)
def test_a_bad_task_file_is_refused_before_anything_starts(tmp_path, content, expected):
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(content)
    msg = _refused(tmp_path, "tasks.type=file", f"tasks.path={path}")
    assert __import__("re").search(expected, msg), msg


def test_a_missing_task_file_and_a_too_long_prompt_are_one_line(tmp_path):
    assert "does not exist" in _refused(tmp_path, "tasks.type=file", f"tasks.path={tmp_path / 'nope.jsonl'}")
    path = tmp_path / "long.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": "1+" * (10 * i) + "1=", "answer": i + 1}) + "\n" for i in range(30)
        )
    )
    msg = _refused(tmp_path, "tasks.type=file", f"tasks.path={path}", "tasks.max_prompt_tokens=40")
    assert "its prompt is" in msg and "tasks.max_prompt_tokens" in msg and "task q" in msg
    # the default limit: the embedded model's 128 positions minus sampling.max_new_tokens
    assert "the model's context (128)" in _refused(tmp_path, "tasks.type=file", f"tasks.path={path}")


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["env.reward=tests.support.plugins:no_such_reward"],
            "env.reward: module 'tests.support.plugins' has no attribute",
        ),
        (["env.type=nosuchpkg.envs:Env"], "env.type: cannot import module 'nosuchpkg.envs'"),
        (["algorithm=grpoo"], "algorithm: unknown algorithm 'grpoo'"),
        (["algo.foo=1"], "algorithm grpo takes no algo.* settings, got algo.foo"),
        (["-c", "configs/rlcr.yaml", "algo.lamda_conf=1"], "unknown key 'algo.lamda_conf'"),
        (["train.policy_loss=ppo2"], "'train.policy_loss': unknown policy loss 'ppo2'; valid names: cispo, gspo, ppo"),
        (
            ["train.advantage.estimator=vtrace"],
            "'train.advantage.estimator': unknown advantage estimator 'vtrace'; valid names: gae, grpo, reinforce_pp, reinforce_pp_baseline, rloo",
        ),
    ],
    ids=["reward-attr", "env-module", "algorithm", "grpo-algo-key", "rlcr-algo-key", "loss-name", "estimator-name"],
)
def test_config_mistakes_are_caught_before_the_model_is_built(tmp_path, args, expected):
    t0 = time.time()
    msg = _refused(tmp_path, *args)
    assert expected in msg, msg
    assert time.time() - t0 < 90  # no model build (minutes) happened first


# ---- reward functions at run time ----------------------------------------------------------------


def _env(reward: str, **over):
    cfg = load_config(None, [f"env.reward={reward}", *(f"env.{k}={v}" for k, v in over.items())])
    return make_env(cfg.env)


@pytest.mark.parametrize(
    "reward, expected",
    [
        (
            "tests.support.plugins:broken_reward",
            "env.reward tests.support.plugins:broken_reward (evaluate, task t1) raised KeyError: 'answer'",
        ),
        (
            "tests.unit.commands.test_bad_input:nan_reward",
            "nan_reward returned nan for score 'reward'; expected a finite float",
        ),
        (
            "tests.unit.commands.test_bad_input:string_reward",
            "env.reward tests.unit.commands.test_bad_input:string_reward returned '1.0' (str); expected a finite float",
        ),
        ("tests.unit.commands.test_bad_input:dict_without_reward", "returned a dict without 'reward' (['score'])"),
    ],
    ids=["raises", "nan", "string", "no-reward-key"],
)
def test_a_bad_reward_is_one_failure_naming_the_function_and_the_task(reward, expected):
    env = _env(reward)
    with pytest.raises(EnvFailure) as err:
        env.evaluate(TASK, REPLY)
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert env.failures == 1 and env.calls == 1


def nan_reward(task, response):
    return math.nan


def string_reward(task, response):
    return "1.0"


def dict_without_reward(task, response):
    return {"score": 1.0}


def test_a_reward_that_never_returns_times_out():
    env = _env("tests.support.plugins:hanging_reward", call_timeout_s=0.5)
    t0 = time.time()
    with pytest.raises(EnvFailure, match=r"no result after 0.5 s \(env.call_timeout_s\)"):
        env.evaluate(TASK, REPLY)
    assert time.time() - t0 < 10


def test_too_many_failures_stop_an_actor_with_the_last_error():
    env = _env("tests.support.plugins:broken_reward", max_failure_rate=0.5)
    for _ in range(20):
        with pytest.raises(EnvFailure):
            env.evaluate(TASK, REPLY)
    with pytest.raises(TooManyFailures, match="20 of the last 20 calls .* failed .*last error: .*KeyError"):
        env.evaluate(TASK, REPLY)
    learner_side = make_env(
        load_config(None, ["env.reward=tests.support.plugins:broken_reward"]).env, stop_on_failures=False
    )
    for _ in range(25):  # evaluation records failures and never stops
        with pytest.raises(EnvFailure):
            learner_side.evaluate(TASK, REPLY)


@pytest.mark.slow
def test_a_run_with_a_flaky_reward_trains_and_records_the_failures(tmp_path, tiny_overrides):
    res = run_cli(
        "run",
        "-c",
        "configs/quickstart.yaml",
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=flaky",
        "env.reward=tests.support.plugins:flaky_reward",
        "train.total_steps=4",
        "train.batch_tasks=4",
        "actor.tasks_per_batch=4",
        "sampling.n=4",
        "sampling.max_new_tokens=4",
        "eval.size=16",
        "eval.every=2",
        "log.progress=false",
        "checkpoint.every=0",
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = read_jsonl(tmp_path / "flaky" / "metrics.jsonl")
    assert [m["version"] for m in metrics] == [1, 2, 3, 4]
    assert sum(m["env/failures"] for m in metrics) > 0  # recorded, and training went on
    events = read_jsonl(tmp_path / "flaky" / "events.jsonl")
    failed = [f for e in events if e["kind"] == "episode" for f in e["decision"].get("failures", [])]
    assert failed and all("flaky_reward" in f for f in failed), failed[:3]
    assert any("raised RuntimeError" in f for f in failed) or any("nan" in f for f in failed)
    evals = [e for e in events if e["kind"] == "eval"]
    assert evals and all(e["failures"] > 0 for e in evals), evals
    for e in events:  # no NaN reached the trained trajectories
        if e["kind"] == "episode":
            assert all(t["reward"] is not None and math.isfinite(t["reward"]) for t in e["trajectories"])


@pytest.mark.slow
def test_a_failed_actor_is_named_on_the_console_in_the_summary_and_at_a_retry(tmp_path, tiny_overrides):
    """42.3: the console said ``actor-0 exited with code 3; see ...`` and the summary ``stopped by a
    stop signal``; the cause was only in the actor's log. Now one console line names the actor and
    its error, the learner's summary gives it as the stop reason (exit code 1), and a retry under the
    same name is refused saying how the run ended."""
    args = [
        "run",
        "-c",
        "configs/quickstart.yaml",
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=broken",
        "env.reward=tests.support.plugins:broken_reward",
        "train.total_steps=50",
        "eval.size=4",
        "eval.every=0",
        "log.progress=false",
        "checkpoint.every=0",
    ]
    res = run_cli(*args, cwd=ROOT, timeout=400)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    said = [x for x in out.splitlines() if x.startswith("[asyncrl] actor-0 failed (exit code 3)")]
    assert len(said) == 1 and "KeyError" in said[0] and "actor-0.log" in said[0], out[-3000:]
    assert "stopped by a stop signal" not in out
    stop = [e for e in read_jsonl(tmp_path / "broken" / "events.jsonl") if e["kind"] == "learner_stop"][-1]
    assert stop["reason"].startswith("actor-0 failed (exit code 3)") and "KeyError" in stop["reason"]
    again = run_cli(*args, cwd=ROOT, timeout=120)
    assert again.returncode != 0 and "it ended: actor-0 failed (exit code 3)" in again.stdout + again.stderr


@pytest.mark.slow
def test_a_hanging_reward_does_not_block_a_stop(tmp_path, tiny_overrides):
    proc = start_cli(
        "run",
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=hang",
        "env.reward=tests.support.plugins:hanging_reward",
        "env.call_timeout_s=600",
        "train.total_steps=50",
        "eval.size=4",
        "log.progress=false",
        "checkpoint.every=0",
        log=tmp_path / "hang.log",
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (tmp_path / "hang" / "events.jsonl").exists():
            assert proc.poll() is None, (tmp_path / "hang.log").read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # the learner's first evaluation is now waiting on the reward
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        assert code == 128 + signal.SIGTERM, (tmp_path / "hang.log").read_text()[-3000:]
    finally:
        kill_tree(proc)


@pytest.mark.slow
def test_a_hanging_reward_stops_the_run_with_one_line_and_the_learner_keeps_answering(tmp_path, tiny_overrides):
    """25.6: with env.call_timeout_s=5 and a reward that sleeps for ever, the learner's evaluation
    blocked its loop (0 steps in 240 s, its actor saw it silent for 84 s). Now the learner answers
    its actors while it waits, gives the evaluation up once its first calls all timed out, and the
    run stops with one line saying the reward hangs."""
    res = run_cli(
        "run",
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=hung",
        "env.reward=tests.support.plugins:hanging_reward",
        "env.call_timeout_s=2",
        "eval.size=8",
        "eval.hung_after=4",
        "actor.learner_timeout_s=3",
        "actor.heartbeat_s=0.5",
        "train.total_steps=50",
        "log.progress=false",
        "checkpoint.every=0",
        timeout=400,
    )
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [x for x in res.stderr.splitlines() if "timed out" in x and "hangs" in x]
    assert lines and "hanging_reward" in lines[0] and "env.call_timeout_s=2" in lines[0], res.stderr[-3000:]
    events = read_jsonl(tmp_path / "hung" / "events.jsonl")
    assert [e["kind"] for e in events if e["kind"] == "eval_hung"] == ["eval_hung"]
    actor_log = (tmp_path / "hung" / "actor-0.log").read_text()
    assert "no word from the learner" not in actor_log, actor_log[-2000:]  # answered while evaluating


# ---- the learner never applies a non-finite update --------------------------------------------


def test_a_batch_with_a_non_finite_loss_is_skipped_not_applied():
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.config import TrainConfig

    tok = build_char_tokenizer()
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=64,
        )
    )
    trainer = PolicyTrainer(model, tok, TrainConfig(), temperature=1.0)
    ids = np.array(tok.encode("<|user|>1+1=<|end|><|assistant|>2<|end|>"), dtype=np.int32)
    mask = np.zeros(len(ids), np.uint8)
    mask[-2:] = 1
    trajs = [
        Trajectory(ids, mask, np.where(mask, -1.0, 0.0).astype(np.float32), 0, reward=r, group_id="g")
        for r in (0.0, 1.0)
    ]
    trajs[0].behavior_logprobs[-1] = np.nan  # a poisoned behaviour log-prob
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = trainer.step(trainer.make_batch([Episode(trajectories=trajs)])).stats
    assert stats["skipped_nonfinite"] == 1.0 and not math.isfinite(stats["loss"])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a NaN update was applied"
    assert not trainer.optimizer.state  # AdamW never stepped


# ---- held-out means held out -------------------------------------------------------------------


def test_held_out_tasks_are_never_in_the_training_stream(tmp_path):
    from asyncrl.envs.tasks import task_stream

    cfg = load_config(None, ["tasks.type=file", "tasks.path=examples/countdown_tasks.jsonl", "tasks.eval_size=200"])
    train, held = split_tasks(cfg.tasks)
    assert len(held) == 20 and len(train) == 180  # tasks.holdout_fraction 0.1 of 200
    stream = task_stream(cfg.tasks, seed=5)
    seen = {next(stream).id for _ in range(2000)}
    assert seen == {t.id for t in train} and not seen & {t.id for t in held}
    assert "20 of 200 tasks carved from examples/countdown_tasks.jsonl" in describe_heldout(cfg.tasks, held, train)

    arith = load_config(None, [])
    _, held = split_tasks(arith.tasks)
    stream = task_stream(arith.tasks, seed=1)
    assert not {next(stream).id for _ in range(5000)} & {t.id for t in held}

    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"prompt": "3+4=", "answer": 7}) + "\n")
    cfg = load_config(
        None, ["tasks.type=file", "tasks.path=examples/countdown_tasks.jsonl", f"tasks.eval_path={eval_file}"]
    )
    train, held = split_tasks(cfg.tasks)
    assert len(train) == 200 and [t.answer for t in held] == [7]
    assert f"from {eval_file} (tasks.eval_path)" in describe_heldout(cfg.tasks, held, train)


def test_the_console_script_finds_plugins_in_the_working_directory(tmp_path):
    """``asyncrl`` installed as a console script does not put the working directory on sys.path
    (``python -m`` does): plugins named by import path must still resolve from it, as the README's
    countdown example does from the repository root."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    script = shutil.which("asyncrl", path=str(Path(sys.executable).parent))
    assert script, f"no asyncrl console script beside {sys.executable} (pip install -e . makes it)"
    res = subprocess.run(
        [
            script,
            "run",
            f"run_root={tmp_path}",
            "env.type=examples.countdown:RetryEnv",
            "env.reward=examples.countdown:reward",
            "tasks.type=file",
            "tasks.path=nope.jsonl",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "cannot import" not in res.stderr, res.stderr
    assert "nope.jsonl does not exist" in res.stderr  # the plugins resolved; the next check spoke


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs a read-only /sys (Linux)")
@pytest.mark.parametrize("command", ["run", "learn"])
def test_an_unwritable_run_dir_stops_in_one_line_without_tracebacks(tmp_path, command):
    """25.8: an unwritable run dir printed an atexit traceback after the one-line stop."""
    res = run_cli(
        command, "-c", str(ROOT / "configs" / "quickstart.yaml"), "run_root=/sys/kernel/asyncrl-unwritable", timeout=120
    )
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr[-3000:]
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "cannot write the run directory /sys/kernel/asyncrl-unwritable" in lines[0], lines


@pytest.mark.parametrize("address", ["ipc://", "tcp://127.0.0.1:5555", "ipc://relative/sock"])
def test_an_unusable_weights_address_is_one_line(tmp_path, address):
    """63.7: ``asyncrl serve --weights-address ipc://`` gave an AttributeError traceback."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl",
            "serve",
            "-c",
            "configs/quickstart.yaml",
            "--connect",
            f"ipc://{tmp_path}/control",
            "--weights-address",
            address,
        ],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "expected ipc:// and the absolute path" in lines[0], res.stderr
