"""Issue 44: the learner without padding. Packed rows (train.packing, a prompt shared by its
completions with train.shared_prefix), micro-batches of a token budget with the gradients
accumulated (train.micro_batch_tokens), and rows that carry no gradient left out
(train.skip_zero_advantage) all give the padded one-pass forward's log-probs, entropies, losses and
gradients: a real tiny Llama, real forward and backward passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from asyncrl.config import EmbeddedModelConfig, load_config
from asyncrl.learner.training.batch import collate, forward_rows
from asyncrl.learner.training.micro_batches import plan_micro_batches
from asyncrl.learner.training.packing import pack_rows
from asyncrl.learner.training.trainer import PolicyTrainer
from asyncrl.models.tiny import embedded_llama_config
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.objectives.aggregation import LOSS_AGG_MODES
from asyncrl.types import Trajectory

VOCAB = 40


def _model(seed: int = 0, attention: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = EmbeddedModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    llama = embedded_llama_config(cfg, VOCAB)
    llama._attn_implementation = attention
    return LlamaForCausalLM(llama).float()


def _traj(prompt, response, group, mask=None, reward=0.0, **kw) -> Trajectory:
    ids = np.r_[prompt, response].astype(np.int64)
    loss = np.r_[np.zeros(len(prompt)), np.ones(len(response)) if mask is None else mask]
    return Trajectory(
        token_ids=ids,
        loss_mask=loss,
        behavior_logprobs=-0.5 * loss,
        policy_version=0,
        reward=reward,
        group_id=group,
        **kw,
    )


def _rows(equal_group: bool = False) -> list[Trajectory]:
    """Three prompts of different lengths with 4, 3 and 1 completions of very different lengths (one
    of 30 tokens), a multi-turn row (trained, environment, trained tokens), a replayed row with
    recorded log-probs, rows whose tokens come from two policy versions. ``equal_group``: the second
    prompt's completions all get the same reward (advantage 0: no gradient)."""
    rng = np.random.default_rng(3)
    rows = []
    for g, (plen, n) in enumerate([(7, 4), (4, 3), (9, 1)]):
        prompt = rng.integers(3, VOCAB, plen)
        for i in range(n):
            length = 30 if (g, i) == (0, 1) else int(rng.integers(1, 7))
            reward = 1.0 if equal_group and g == 1 else float(i % 2)
            rows.append(_traj(prompt, rng.integers(3, VOCAB, length), f"g{g}", reward=reward))
    prompt = rows[0].token_ids[:7]
    rows.append(_traj(prompt, rng.integers(3, VOCAB, 8), "g0", mask=np.r_[np.ones(3), np.zeros(2), np.ones(3)]))
    resp = rng.integers(3, VOCAB, 5)
    rec = np.r_[np.zeros(4), -rng.uniform(0.5, 2.0, 5)].astype(np.float32)
    rows.append(
        _traj(
            rows[4].token_ids[:4],
            resp,
            "g1",
            reward=0.0 if not equal_group else 1.0,
            is_replay=True,
            recorded_logprobs=rec,
        )
    )
    for t in rows[:3]:  # generated across an in-flight update: the last tokens by version 1
        t.token_versions = np.r_[np.zeros(len(t.token_ids) - 2), np.ones(2)].astype(np.int32)
    return rows


def _batch(equal_group: bool = False):
    rows = _rows(equal_group)
    rewards = torch.tensor([r.reward for r in rows])
    adv = torch.zeros(len(rows))
    for g in {r.group_id for r in rows}:  # a group mean baseline (GRPO without the std)
        ix = [i for i, r in enumerate(rows) if r.group_id == g]
        adv[ix] = rewards[ix] - rewards[ix].mean()
    return collate(rows, adv, pad_id=0)


def test_the_packed_layout_puts_every_row_where_it_says():
    batch = _batch()
    lengths = batch.attention_mask.sum(1)
    starts = (batch.response_mask > 0).float().argmax(1) + 1
    for shared in (False, True):
        packed = pack_rows(batch.input_ids, lengths, starts=starts if shared else None)
        R, W = packed.shape
        assert W == int(lengths.max())  # bins as wide as the longest row
        flat_ids, flat_pos = packed.input_ids.reshape(-1), packed.position_ids.reshape(-1)
        for b, n in enumerate(lengths.tolist()):
            slots = packed.token_index[b, :n]
            assert (slots >= 0).all() and (packed.token_index[b, n:] == -1).all()
            assert torch.equal(flat_ids[slots], batch.input_ids[b, :n])  # its tokens
            assert torch.equal(flat_pos[slots], torch.arange(n))  # at its own positions
            # each token sees exactly its row's earlier tokens
            seen = packed.attention.reshape(R, W, W)[slots // W, slots % W]
            r = int(slots[0] // W)
            assert (slots // W == r).all()
            expect = torch.zeros(n, W, dtype=torch.bool)
            for i in range(n):
                expect[i, slots[: i + 1] % W] = True
            assert torch.equal(seen, expect), (shared, b)
        if shared:  # the first prompt's 5 completions and the second's 3 (+ the replayed row) read one copy
            assert packed.shared_rows >= 5 and packed.slots_used < int(lengths.sum())
        else:
            assert packed.shared_rows == 0 and packed.slots_used == int(lengths.sum())
    flat = pack_rows(batch.input_ids, lengths, varlen=True)  # a flash kernel's layout: one flat bin, no mask
    assert flat.shape == (1, int(lengths.sum())) and flat.attention is None


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("temperature,attention", [(1.0, "sdpa"), (0.7, "sdpa"), (1.0, "eager")])
def test_the_packed_forward_equals_the_padded_one(shared, temperature, attention):
    """SDPA takes the block mask as booleans, eager attention as an additive mask."""
    batch = _batch()
    valid = batch.attention_mask[:, 1:].bool()  # every real target position, prompt ones included
    results = {}
    for packing in (False, True):
        model = _model(attention=attention)
        assert model.config._attn_implementation == attention
        out = forward_rows(model, batch, temperature, with_entropy=True, packing=packing, shared_prefix=shared)
        loss = -(out.logprobs * batch.advantages).sum() - 0.01 * (out.entropy * batch.response_mask).sum()
        loss.backward()
        results[packing] = (out, {k: p.grad.clone() for k, p in model.named_parameters()})
    (padded, g0), (packed, g1) = results[False], results[True]
    for a, b in ((padded.logprobs, packed.logprobs), (padded.entropy, packed.entropy)):
        assert float((a - b).detach()[valid].abs().max()) <= 1e-5
    for k in g0:
        assert float((g0[k] - g1[k]).abs().max()) <= 1e-5, k
    assert max(float(g.abs().max()) for g in g0.values()) > 1e-3  # the gradients compared are not all zero
    assert packed.slots < padded.slots and padded.padding_share > 0.5 > packed.padding_share
    assert (packed.real_tokens < padded.real_tokens) == shared  # a shared prompt is computed once


def _trained(overrides: list[str], batch_fn=_batch, steps: int = 1, keep_rows: bool = False):
    """One or more PolicyTrainer steps from the same weights; (parameters, gradients, last stats)."""
    cfg = load_config(None, ["train.lr=1e-3", "train.max_grad_norm=1e6", *overrides])
    model = _model()
    trainer = PolicyTrainer(model, build_char_tokenizer(), cfg.train, 1.0)
    for i in range(steps):
        result = trainer.step(batch_fn(i) if steps > 1 else batch_fn(), keep_rows=keep_rows, version=1)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return params, grads, result


def _same(a, b, tol: float):
    (p0, g0, _), (p1, g1, _) = a, b
    for k in p0:
        assert float((g0[k] - g1[k]).abs().max()) <= tol, ("grad", k)
        assert float((p0[k] - p1[k]).abs().max()) <= tol, ("param", k)
    assert max(float(g.abs().max()) for g in g0.values()) > 1e-4


REFERENCE = ["train.packing=false", "train.skip_zero_advantage=false", "train.micro_batch_tokens=100000"]


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_a_trainer_step_packed_and_in_micro_batches_equals_one_padded_pass(agg):
    base = [f"train.loss_agg_mode={agg}", "train.loss_scale_norm=16"]
    ref = _trained([*base, *REFERENCE])
    for variant in (
        ["train.packing=true", "train.shared_prefix=false"],  # packed, one pass
        ["train.packing=true"],  # packed with shared prompts
        ["train.packing=true", "train.micro_batch_tokens=20"],  # packed, about 8 micro-batches
        ["train.packing=false", "train.micro_batch_tokens=40"],
    ):  # padded micro-batches
        got = _trained([*base, *REFERENCE, *variant])
        _same(ref, got, 1e-5)
        assert got[2].stats["loss"] == pytest.approx(ref[2].stats["loss"], abs=1e-6)
        micro = got[2].stats["learner/micro_batches"]
        assert (
            micro > 3
            if "train.micro_batch_tokens=20" in variant or "train.micro_batch_tokens=40" in variant
            else micro == 1
        )


def test_side_terms_keep_rows_and_several_mini_batches_under_micro_batches():
    terms = ["train.kl_coef=0.05", "train.entropy_coef=0.01", "train.mini_batches=2", "train.ppo_epochs=2"]
    ref = _trained([*terms, *REFERENCE], keep_rows=True)
    got = _trained([*terms, "train.micro_batch_tokens=24"], keep_rows=True)
    _same(ref, got, 1e-5)
    valid = _batch().attention_mask[:, 1:].bool()
    for a, b in ((ref[2].row_logprobs, got[2].row_logprobs), (ref[2].row_entropy, got[2].row_entropy)):
        assert float((a - b)[valid].abs().max()) <= 1e-5
    for key in ("kl", "entropy"):
        assert got[2].stats[key] == pytest.approx(ref[2].stats[key], abs=1e-6)
    assert got[2].stats["learner/rows_skipped"] == 0  # KL and entropy terms read every row


def test_rows_that_carry_no_gradient_are_left_out_and_the_step_is_the_same():
    batch = _batch(equal_group=True)
    plan = plan_micro_batches(batch, 100000, packing=True, skip=True)
    assert plan.skipped == [4, 5, 6, 7, 9]  # the second prompt's completions, its replayed row, a group of one
    for agg in LOSS_AGG_MODES:
        base = [f"train.loss_agg_mode={agg}", "train.loss_scale_norm=16"]
        kept = _trained([*base, "train.skip_zero_advantage=false"], lambda: _batch(True))
        left = _trained([*base, "train.skip_zero_advantage=true"], lambda: _batch(True))
        _same(kept, left, 1e-6)
        assert left[2].stats["learner/rows_skipped"] == 5 and kept[2].stats["learner/rows_skipped"] == 0
        assert left[2].stats["learner/forward_tokens"] < kept[2].stats["learner/forward_tokens"]
    # a row a KL term reads is never left out; nor one whose log-probs are kept (experience replay)
    assert _trained(["train.kl_coef=0.05"], lambda: _batch(True))[2].stats["learner/rows_skipped"] == 0
    assert _trained([], lambda: _batch(True), keep_rows=True)[2].stats["learner/rows_skipped"] == 0


def test_a_batch_with_no_gradient_at_all_still_takes_adams_step_and_reports_its_metrics():
    """No row carries a gradient: the first micro-batch runs anyway (loss 0), so the step has its
    entropy and mismatch metrics, and AdamW moves the weights by its momentum as with every row run."""

    def batches(i):
        batch = _batch()
        if i == 1:
            batch.advantages.zero_()
        return batch

    kept = _trained(["train.skip_zero_advantage=false"], batches, steps=2)
    left = _trained(["train.skip_zero_advantage=true", "train.micro_batch_tokens=40"], batches, steps=2)
    stats = left[2].stats
    assert stats["learner/micro_batches"] == 1 and 0 < stats["learner/rows_skipped"] < 10  # the first one ran
    assert "entropy" in stats and "mismatch/logprob_abs_diff_mean" in stats  # rows 0-2 end with version-1 tokens
    assert stats["loss"] == 0.0
    for k in kept[0]:
        assert float((kept[0][k] - left[0][k]).abs().max()) <= 1e-6, k


def test_lora_adapters_train_the_same_in_micro_batches():
    """model.lora: the adapters' gradients and update, packed in micro-batches with rows left out,
    equal the padded one-pass step's (B drawn non-zero, so that A has gradients too)."""
    from asyncrl.models.lora import with_adapters

    def trained(overrides):
        cfg = load_config(None, ["model.lora.rank=4", "train.lr=1e-3", "train.max_grad_norm=1e6", *overrides])
        model = with_adapters(_model(), cfg.model, seed=0)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        trainer = PolicyTrainer(model, build_char_tokenizer(), cfg.train, 1.0)
        stats = trainer.step(_batch(equal_group=True), version=1).stats
        return {k: (p.detach().clone(), p.grad.clone()) for k, p in model.named_parameters() if p.requires_grad}, stats

    ref, _ = trained(REFERENCE)
    got, stats = trained(["train.micro_batch_tokens=20"])
    assert stats["learner/micro_batches"] > 2 and stats["learner/rows_skipped"] == 5
    assert ref.keys() == got.keys() and all("lora_" in k for k in ref)
    for k in ref:
        for a, b in zip(ref[k], got[k]):
            assert float((a - b).abs().max()) <= 1e-5, k
    assert min(float(g.abs().max()) for _, g in ref.values()) > 0
