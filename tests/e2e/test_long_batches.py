"""Real models make slow batches and slow steps (issue 61): a batch that takes minutes keeps its
credits, and a stop in the middle of a long step keeps the steps done before it.

Real ``asyncrl`` processes on loopback (``tests.peer_attacks.LiveRun``); the actor's engine is the real
HF engine on a model whose forward passes are slowed down (``tests.plugins_for_tests:slow_hf_engine``),
so a batch takes five times ``wire.credit_timeout_s`` while its tokens come one step at a time."""

from __future__ import annotations

import pytest

from tests.conftest import SMALL_RUN
from tests.peer_attacks import LiveRun

pytestmark = pytest.mark.slow

CREDIT_TIMEOUT_S = 3.0
STEP_S = 1.5  # one decode step: a batch of 10 tokens takes 15 s, five credit timeouts


def test_a_batch_five_times_the_credit_timeout_keeps_its_credits(tmp_path, tiny_overrides, monkeypatch):
    monkeypatch.setenv("ASYNCRL_TEST_STEP_S", str(STEP_S))
    run = LiveRun(tmp_path, "slow", [*tiny_overrides, *SMALL_RUN, "train.total_steps=100000", "wire.lease_s=30",
                                     f"wire.credit_timeout_s={CREDIT_TIMEOUT_S}", "sampling.max_new_tokens=10",
                                     "engine.type=tests.plugins_for_tests:slow_hf_engine"])
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
