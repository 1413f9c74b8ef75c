"""Real models make slow batches and slow steps (issue 61): a batch that takes minutes keeps its
credits, and a stop in the middle of a long step keeps the steps done before it.

Real ``asyncrl`` processes on loopback (``asyncrl.testing.peer_attacks.LiveRun``); the actor's engine is the real
HF engine on a model whose forward passes are slowed down (``tests.support.plugins:slow_hf_engine``),
so a batch takes five times ``wire.credit_timeout_s`` while its tokens come one step at a time."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from asyncrl.rundir.layout import checkpoint_dir
from asyncrl.rundir.record_file import read_frame_records
from asyncrl.testing.peer_attacks import LiveRun
from asyncrl.wire.codec import decode, decode_episode
from tests.conftest import ROOT, SMALL_RUN, cli, descendants, kill_tree, read_jsonl, run_cli, subprocess_env

pytestmark = pytest.mark.slow

CREDIT_TIMEOUT_S = 3.0
STEP_S = 1.5  # one decode step: a batch of 10 tokens takes 15 s, five credit timeouts


def test_a_batch_five_times_the_credit_timeout_keeps_its_credits(tmp_path, tiny_overrides, monkeypatch):
    monkeypatch.setenv("ASYNCRL_TEST_STEP_S", str(STEP_S))
    run = LiveRun(
        tmp_path,
        "slow",
        [
            *tiny_overrides,
            *SMALL_RUN,
            "train.total_steps=100000",
            "wire.lease_s=30",
            f"wire.credit_timeout_s={CREDIT_TIMEOUT_S}",
            "sampling.max_new_tokens=10",
            "engine.type=tests.support.plugins:slow_hf_engine",
        ],
    )
    try:
        run.actor("actor-0", 0)
        assert run.wait_version(2, 600) is not None, run.log_tail(lines=20)
        batches = [m["train_s"] + m["wait_s"] for m in run.metrics()[1:2]]  # step 2 waited a whole batch
        assert batches and batches[0] > 3 * CREDIT_TIMEOUT_S, (batches, run.log_tail(lines=10))
        assert not run.events("credits_reclaimed"), run.events("credits_reclaimed")[:3]
        log = (run.logs / "slow-learner.log").read_text(errors="replace")
        assert "credits_reclaimed" not in log and "no_progress" not in log, log[-2000:]
    finally:
        run.stop()


LOSS_S = 2.5  # per micro-batch of one row: a step of 16 rows takes 40 s, more than asyncrl run's 30 s grace


def test_a_stop_in_the_middle_of_a_long_step_saves_the_last_step_and_its_episodes(tmp_path, tiny_overrides):
    """Ctrl-C while a step that takes longer than asyncrl run's grace is in progress: the learner gives
    the step up, checkpoints the last step it completed with the step's episodes back in its buffer, and
    says so; a resume trains those very episodes. During the long step the learner still answers its actor. (Before: the launcher killed the learner after 30 s,
    and with no checkpoint yet a resume started from step 0.)"""
    env = {**subprocess_env(), "ASYNCRL_TEST_LOSS_S": str(LOSS_S)}
    args = [
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        *SMALL_RUN,
        f"run_root={tmp_path}",
        "name=stop",
        "train.total_steps=100000",
        "train.micro_batch_tokens=16",
        "train.skip_zero_advantage=false",
        "train.policy_loss=tests.support.plugins:slow_ppo_loss",
    ]
    log = tmp_path / "stop.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cli("run", *args), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    kids: set[int] = set()
    try:
        deadline = time.time() + 600
        while not read_jsonl(tmp_path / "stop" / "metrics.jsonl") and time.time() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        kids = descendants(proc.pid)
        time.sleep(3 * LOSS_S)  # well into step 2 (it takes 16 x LOSS_S)
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=300)
        stop_s = time.time() - t0
        text = log.read_text()
        assert code == 130, text[-3000:]
        assert "resume would start from step 0" not in text, text[-3000:]
        assert "stopping: checkpoint of step 1 written" in text and "the step in progress was given up" in text, text[
            -3000:
        ]
        assert stop_s < 16 * LOSS_S - 3 * LOSS_S, (stop_s, text[-2000:])  # it did not wait for the step to end
        assert [e["step"] for e in read_jsonl(tmp_path / "stop" / "metrics.jsonl")] == [1]
        actor_log = (tmp_path / "stop" / "actor-0.log").read_text(errors="replace")
        assert "no word from the learner" not in actor_log, actor_log[-2000:]  # a 40 s step still answers it
        saved = checkpoint_dir(tmp_path / "stop", 1)
        held = {decode_episode(decode(r)).id for r in read_frame_records(saved / "buffer.bin", strict=True)}
        assert len(held) >= 4, held  # step 2's four episodes at least, back in the buffer
    finally:
        kill_tree(proc, kids)
    # the resume trains them (no slow loss now)
    done = run_cli("run", *args, "train.total_steps=3", "train.policy_loss=ppo", "--resume", timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    trained = {
        e["episode_id"]
        for e in read_jsonl(tmp_path / "stop" / "events.jsonl")
        if e.get("kind") == "episode" and e["step"] >= 2
    }
    assert held <= trained, sorted(held - trained)
