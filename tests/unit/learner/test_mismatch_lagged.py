"""Mismatch every step (issue 66): tokens an older version generated are measured against that
version's weights (kept by the learner), so ``mismatch/*`` is logged while the actors are behind;
behaviour log-probs that the kept weights produce measure zero, those of other weights do not."""

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.learner.training.mismatch import LaggedMismatch, merge_mismatch
from asyncrl.learner.training.trainer import PolicyTrainer
from asyncrl.models.tokenizer import build_char_tokenizer
from tests.unit.learner.test_packing import _batch, _model


def test_lagged_tokens_are_measured_against_the_version_that_made_them():
    cfg = load_config(None, ["train.lr=1e-2"])
    model = _model()
    trainer = PolicyTrainer(model, build_char_tokenizer(), cfg.train, 1.0)
    lagged = LaggedMismatch(trainer, model, keep=2, rows=16)
    v0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    lagged.remember(0, v0, copied=True)
    batch = _batch()
    batch.token_versions = torch.zeros_like(batch.token_versions)  # every token made by version 0
    batch.behavior_logprobs = trainer.logprobs(model, batch) * (batch.response_mask > 0)  # the engine's at v0
    trainer.step(_batch(), version=0)  # the learner moves on to version 1
    assert not all(torch.equal(v0[n], p) for n, p in model.named_parameters())
    got = lagged.measure(batch, version=1)
    assert got["mismatch/lagged_tokens"] == float(((batch.response_mask > 0) & (batch.exp_mask == 0)).sum())
    assert got["mismatch/lagged_kl"] < 1e-9 and got["mismatch/lagged_logprob_abs_diff_max"] < 1e-5
    # behaviour log-probs from other weights (the current ones) are told apart
    batch.behavior_logprobs = trainer.logprobs(model, batch) * (batch.response_mask > 0)
    assert lagged.measure(batch, version=1)["mismatch/lagged_kl"] > 1e-6
    # no kept version for these tokens: nothing measured (and nothing merged)
    assert lagged.measure(batch, version=0) == {} and merge_mismatch({}, {}) == {}
    merged = merge_mismatch({"mismatch/tokens": 0.0}, got)
    assert (
        merged["mismatch/kl"] == got["mismatch/lagged_kl"]
        and merged["mismatch/tokens"] == got["mismatch/lagged_tokens"]
    )
    both = merge_mismatch(
        {
            "mismatch/tokens": 10.0,
            "mismatch/kl": 1.0,
            "mismatch/logprob_abs_diff_mean": 1.0,
            "mismatch/logprob_abs_diff_max": 2.0,
        },
        {**got, "mismatch/lagged_tokens": 30.0, "mismatch/lagged_kl": 0.0},
    )
    assert both["mismatch/kl"] == pytest.approx(0.25) and both["mismatch/tokens"] == 40.0


def test_the_measurement_keeps_within_its_share_of_the_step_time():
    cfg = load_config(None, [])
    model = _model()
    trainer = PolicyTrainer(model, build_char_tokenizer(), cfg.train, 1.0)
    lagged = LaggedMismatch(trainer, model, keep=1, rows=4, budget=0.1)
    lagged.remember(0, {n: p.detach().clone() for n, p in model.named_parameters()}, copied=True)
    batch = _batch()
    batch.token_versions = torch.zeros_like(batch.token_versions)
    measured = 0
    for _ in range(40):
        if lagged.due():
            assert lagged.spent <= 0.1 * lagged.stepped  # a measurement starts only within the budget
            measured += bool(lagged.measure(batch, version=1))
        lagged.note_step(0.001)  # steps of 1 ms: a 4-row forward (well over 0.1 ms) fits only now and then
    assert 1 <= measured < 40 and lagged.spent > 0
