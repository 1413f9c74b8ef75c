"""The token trace (issue 67): per token, what the loss saw (the learner's log-prob before the update,
the behaviour weight and whether the correction capped or masked it, the loss's clip, the staleness
bound's cut, versions, roles), and the UI's Tokens view drawn from it."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncrl.analysis import RunStore
from asyncrl.app import tokens as T
from asyncrl.config import load_config
from asyncrl.learner.trace import TokenTrace, pick_rows
from asyncrl.learner.training.batch import collate
from asyncrl.learner.training.trainer import PolicyTrainer
from asyncrl.models.tokenizer import build_char_tokenizer
from tests.unit.learner.test_packing import _model, _rows

LOG = SimpleNamespace(sample_every=1, trace_rows=100, sample_max_tokens=512)
MULTI_TURN, REPLAYED = 8, 9  # _rows: the row with environment tokens, the replayed row


def _traced(overrides: list[str], plant=None):
    """The trace of every row of _rows after one step of a trainer with ``overrides``; ``plant(batch,
    learner_logp)`` may change the batch (behaviour log-probs, the staleness cut) before the step."""
    cfg = load_config(None, ["train.lr=1e-2", *overrides])
    model = _model()
    trainer = PolicyTrainer(model, build_char_tokenizer(), cfg.train, 1.0)
    rows = _rows()
    rewards = torch.tensor([r.reward for r in rows])
    batch = collate(rows, rewards - rewards.mean(), pad_id=0)
    before = trainer.logprobs(model, batch)
    if plant is not None:
        plant(batch, before)
    trace = TokenTrace(trainer, model, build_char_tokenizer(), LOG)
    traced = trace.before(batch, version=0)
    trainer.step(batch, version=0)
    episodes = [SimpleNamespace(id=f"ep{i}", actor_id="actor-0", trajectories=[r]) for i, r in enumerate(rows)]
    return trace.record(batch, traced, episodes), rows, before, batch


def _gen(row: dict, key: str) -> list:
    return [x for x, r in zip(row[key], row["role"]) if r in ("generated", "replayed")]


def test_pick_rows_spreads_over_the_batch():
    assert pick_rows(10, 3) == [0, 4, 9] and pick_rows(3, 8) == [0, 1, 2] and pick_rows(0, 4) == []
    assert pick_rows(5, 1) == [0] and len(pick_rows(100, 8)) == 8


def test_the_trace_holds_the_learner_logprobs_before_the_update_versions_and_roles():
    trace, rows, before, batch = _traced([])
    assert len(trace) == len(rows)
    for b, (row, traj) in enumerate(zip(trace, rows)):
        n = len(traj.token_ids)
        assert row["num_tokens"] == n == len(row["tokens"]) == len(row["role"]) and row["offset"] == 0
        gen = [j for j in range(n) if row["role"][j] in ("generated", "replayed")]
        for j in gen:  # the pre-update forward, and the version that made the token
            assert row["learner"][j] == pytest.approx(float(before[b, j - 1]), abs=1e-4)
            assert row["version"][j] == int(traj.versions_per_token()[j])
            assert row["behaviour"][j] == pytest.approx(float(traj.behavior_logprobs[j]), abs=1e-4)
        assert all(row[k][j] is None for j in range(n) if j not in gen for k in ("version", "learner", "weight"))
        assert row["advantage"] == pytest.approx(float(batch.row_advantages[b]), abs=1e-5)
    assert trace[0]["version"][-2:] == [1, 1] and 0 in trace[0]["version"]  # made across an in-flight update
    # the multi-turn row: prompt, trained, the environment's tokens, trained again
    roles = trace[MULTI_TURN]["role"]
    assert roles[:7] == ["prompt"] * 7 and roles[7:] == ["generated"] * 3 + ["environment"] * 2 + ["generated"] * 3
    assert set(trace[REPLAYED]["role"]) == {"prompt", "replayed"} and trace[REPLAYED]["is_replay"]


def test_the_trace_flags_capped_masked_clipped_and_dropped_tokens():
    far = {}

    def plant(batch, logp):  # one token the engine found far less likely than the learner does (rho = e^4)
        b, t = 0, int((batch.response_mask[0] > 0).nonzero()[0])
        batch.behavior_logprobs[b, t] = logp[b, t] - 4.0
        far["at"] = (b, t + 1)

    trace, *_ = _traced(["train.is_cap=2.0"], plant)
    b, j = far["at"]
    assert trace[b]["is_capped"][j] == 1 and trace[b]["weight"][j] == pytest.approx(2.0)
    assert sum(sum(_gen(r, "is_capped")) for r in trace) == 1  # (the others are within the cap)
    trace, *_ = _traced(["train.is_cap=2.0", "train.is_cap_mode=mask"], plant)
    assert trace[b]["is_masked"][j] == 1 and trace[b]["weight"][j] == 0.0

    # the ratio against the behaviour policy itself (no proximal recompute): PPO clips it when the
    # advantage pushes the ratio further out
    def plant_ratio(batch, logp):
        plant(batch, logp)
        batch.advantages[0] = batch.advantages[0].abs() + 1.0

    trace, *_ = _traced(["train.recompute_proximal=false"], plant_ratio)
    assert trace[b]["ratio"][j] == pytest.approx(float(np.exp(4.0)), rel=1e-3) and trace[b]["clipped"][j] == 1

    # the staleness bound's cut: tokens of version 0 out of the loss at version 2 with bound 1
    def plant_stale(batch, logp):
        batch.token_versions[:] = 0
        batch.token_versions[1] = 2
        batch.truncate_stale(2, 1)

    trace, *_ = _traced([], plant_stale)
    assert set(_gen(trace[0], "dropped")) == {1} and set(_gen(trace[1], "dropped")) == {0}


def test_the_tokens_view_draws_a_traced_row():
    trace, rows, *_ = _traced(["train.is_cap=2.0"])
    store = RunStore()
    store.add_events([{"kind": "token_trace", "step": 3, "t": 1.0, "rows": trace}])
    assert T.has_traces(store) and not T.has_traces(RunStore())
    choices = T.choices(store)
    assert len(choices) == len(rows) and choices[0][1] == "3:0"
    html = T.tokens_html(store, f"3:{MULTI_TURN}")
    assert html.count("data-role=") == len(trace[MULTI_TURN]["tokens"])
    assert html.count('data-role="environment"') == 2 and html.count('data-role="generated"') == 6
    assert "traced row 9 of 10" in html and 'id="token-trace-table"' in html
    html = T.tokens_html(store, "3:0")  # lag = (step - 1) - version: versions 0 and 1 at step 3
    assert "version 0 (lag 2)" in html and "version 1 (lag 1)" in html
    assert "no token traces" in T.tokens_html(RunStore(), None)
