"""The learner's shared-prefix forward (train.shared_prefix): a prompt's completions run the prompt
once, and the log-probs, entropies and gradients equal the plain forward's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from asyncrl.config import EmbeddedModelConfig, load_config
from asyncrl.learner.training.batch import collate, compute_logprobs, shared_prefix_plan
from asyncrl.models.tiny import embedded_llama_config
from asyncrl.types import Trajectory

VOCAB = 40


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = EmbeddedModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    return LlamaForCausalLM(embedded_llama_config(cfg, VOCAB)).float()


def _traj(prompt, response, group, mask=None, reward=0.0) -> Trajectory:
    ids = np.r_[prompt, response].astype(np.int64)
    loss = np.r_[np.zeros(len(prompt)), np.ones(len(response)) if mask is None else mask]
    return Trajectory(token_ids=ids, loss_mask=loss, behavior_logprobs=-0.5 * loss, policy_version=0,
                      reward=reward, group_id=group)


def _mixed_batch():
    """Three prompts of different lengths with 4, 3 and 1 completions of different lengths, one a
    multi-turn row (trained, environment, trained tokens), different rewards."""
    rng = np.random.default_rng(3)
    rows = []
    for g, (plen, n) in enumerate([(7, 4), (4, 3), (9, 1)]):
        prompt = rng.integers(3, VOCAB, plen)
        for i in range(n):
            rows.append(_traj(prompt, rng.integers(3, VOCAB, int(rng.integers(1, 7))), f"g{g}", reward=float(i % 2)))
    prompt = rows[0].token_ids[:7]
    rows.append(_traj(prompt, rng.integers(3, VOCAB, 8), "g0", mask=np.r_[np.ones(3), np.zeros(2), np.ones(3)]))
    return collate(rows, torch.tensor([r.reward - 0.5 for r in rows]), pad_id=0)


def test_the_plan_groups_rows_by_their_prompt():
    batch = _mixed_batch()
    plan = shared_prefix_plan(batch)
    assert plan is not None
    assert plan.prefix_ids.shape == (3, 9)  # three distinct prompts, the longest of 9 tokens
    assert plan.group.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 0]
    assert plan.start.tolist() == [7, 7, 7, 7, 4, 4, 4, 9, 7]  # each row's first trained token
    assert plan.prefix_mask.sum(1).tolist() == [7, 4, 9]


def test_no_plan_when_nothing_is_shared_or_a_row_trains_nothing():
    rng = np.random.default_rng(0)
    unique = [_traj(rng.integers(3, VOCAB, 6), rng.integers(3, VOCAB, 3), str(i)) for i in range(4)]
    assert shared_prefix_plan(collate(unique, torch.zeros(4), 0)) is None
    prompt = rng.integers(3, VOCAB, 6)
    rows = [_traj(prompt, rng.integers(3, VOCAB, 3), "a") for _ in range(3)]
    rows.append(_traj(prompt, rng.integers(3, VOCAB, 3), "a", mask=np.zeros(3)))  # nothing trained
    assert shared_prefix_plan(collate(rows, torch.zeros(4), 0)) is None
    assert shared_prefix_plan(collate(rows[:3], torch.zeros(3), 0)) is not None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefix_forward_equals_the_plain_forward(temperature):
    batch = _mixed_batch()
    valid = batch.attention_mask[:, 1:].bool()  # every real target position, prompt ones included
    results = {}
    for shared in (False, True):
        model = _model()
        logp, ent = compute_logprobs(model, batch, temperature, with_entropy=True, shared_prefix=shared)
        loss = -(logp * batch.advantages).sum() - 0.01 * (ent * batch.response_mask).sum()
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        results[shared] = (logp.detach()[valid], ent.detach()[valid], grads)
    (lp0, e0, g0), (lp1, e1, g1) = results[False], results[True]
    assert torch.allclose(lp0, lp1, atol=1e-5, rtol=0), (lp0 - lp1).abs().max()
    assert torch.allclose(e0, e1, atol=1e-5, rtol=0), (e0 - e1).abs().max()
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-5, rtol=1e-4), (k, (g0[k] - g1[k]).abs().max())
    assert max(g.abs().max() for g in g0.values()) > 1e-3  # the gradients compared are not all zero


def test_a_trainer_step_with_and_without_shared_prefix_gives_the_same_weights():
    from asyncrl.learner.training.trainer import PolicyTrainer
    from asyncrl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    after = {}
    for shared in (False, True):
        cfg = load_config(None, [f"train.shared_prefix={str(shared).lower()}", "train.lr=1e-3",
                                 "train.max_grad_norm=1e6"])
        model = _model()
        trainer = PolicyTrainer(model, tok, cfg.train, 1.0)
        assert trainer.shared_prefix is shared
        stats = trainer.step(_mixed_batch(), keep_rows=True, version=0).stats
        after[shared] = ({k: p.detach().clone() for k, p in model.named_parameters()}, stats)
    (p0, s0), (p1, s1) = after[False], after[True]
    assert max((p0[k] - p1[k]).abs().max() for k in p0) < 1e-5
    assert max((p0[k] - _model().state_dict()[k]).abs().max() for k in p0) > 1e-4  # the step moved them
    assert s0["entropy"] == pytest.approx(s1["entropy"], abs=1e-5)
