"""HFEngine: batched sampling, EOS and stop strings, behaviour log-probs, weight updates."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.config import SamplingConfig
from asyncrl.engine.base import Engine, Generation
from asyncrl.engine.hf import HFEngine, sample_top_p
from asyncrl.models.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _model(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    return LlamaForCausalLM(cfg)


@pytest.fixture()
def engine(tokenizer) -> HFEngine:
    return HFEngine(_model(tokenizer), tokenizer)


def _prompts(tokenizer, n: int) -> list[list[int]]:
    """Chat prompts of different lengths (so the batch is left-padded)."""
    out = []
    for i in range(n):
        q = f"{i * 7 % 100}+{i * 13 % 1000}="
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def _reference_logprobs(model, prompt: list[int], gen: np.ndarray, temperature: float) -> np.ndarray:
    """Unpadded full forward pass: log_softmax(logits / T) gathered at the generated tokens -> [L]."""
    ids = torch.tensor([prompt + gen.tolist()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.as_tensor(gen, dtype=torch.long)[:, None])[:, 0].numpy()


def test_engine_protocol_and_shapes(engine, tokenizer):
    assert isinstance(engine, Engine)
    prompts = _prompts(tokenizer, 5)
    gens = engine.generate(prompts, SamplingConfig(max_new_tokens=6), seed=1)
    assert len(gens) == 5
    for g in gens:
        assert isinstance(g, Generation)
        assert g.token_ids.dtype == np.int32 and g.logprobs.dtype == np.float32
        assert g.token_ids.shape == g.logprobs.shape and 1 <= len(g.token_ids) <= 6
        assert np.all(g.logprobs <= 0)
        assert g.text == tokenizer.decode(g.token_ids.tolist(), skip_special_tokens=True)
    assert engine.generate([], SamplingConfig()) == []


def test_seeded_generation_is_deterministic(engine, tokenizer):
    prompts, sp = _prompts(tokenizer, 8), SamplingConfig(max_new_tokens=8)
    a, b = engine.generate(prompts, sp, seed=7), engine.generate(prompts, sp, seed=7)
    c = engine.generate(prompts, sp, seed=8)
    assert all(np.array_equal(x.token_ids, y.token_ids) for x, y in zip(a, b))
    assert any(not np.array_equal(x.token_ids, y.token_ids) for x, y in zip(a, c))


def test_eos_ends_a_sequence(engine, tokenizer):
    eos = tokenizer.eos_token_id
    gens = engine.generate(_prompts(tokenizer, 64), SamplingConfig(max_new_tokens=24), seed=3)
    reasons = {g.finish_reason for g in gens}
    assert reasons == {"stop", "length"}  # a near-uniform model over 103 tokens hits EOS sometimes
    for g in gens:
        eos_at = np.flatnonzero(g.token_ids == eos)
        if g.finish_reason == "stop":
            assert eos_at.tolist() == [len(g.token_ids) - 1]  # EOS is last, nothing after it
        else:
            assert len(g.token_ids) == 24 and eos_at.size == 0


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_logprobs_match_full_forward(engine, tokenizer, temperature, top_p):
    prompts = _prompts(tokenizer, 12)
    sp = SamplingConfig(max_new_tokens=10, temperature=temperature, top_p=top_p)
    for prompt, g in zip(prompts, engine.generate(prompts, sp, seed=5)):
        ref = _reference_logprobs(engine.model, prompt, g.token_ids, temperature)
        np.testing.assert_allclose(g.logprobs, ref, atol=1e-4)


def _first_stop_cut(tokenizer, ids: np.ndarray, stop: str) -> int | None:
    """Smallest k such that the decoded first k tokens contain ``stop``."""
    for k in range(1, len(ids) + 1):
        if stop in tokenizer.decode(ids[:k].tolist(), skip_special_tokens=True):
            return k
    return None


@pytest.mark.parametrize("width", [1, 2])
def test_stop_string_truncates_right_after_it(engine, tokenizer, width):
    prompts, sp = _prompts(tokenizer, 16), SamplingConfig(max_new_tokens=12)
    free = engine.generate(prompts, sp, seed=11)
    donor = next(g for g in free if g.finish_reason == "length" and len(g.text) >= 6)
    stop = donor.text[3 : 3 + width]
    cut = engine.generate(prompts, sp.model_copy(update={"stop": [stop]}), seed=11)
    hit = 0
    for full, g in zip(free, cut):
        k = _first_stop_cut(tokenizer, full.token_ids, stop)
        if k is None:  # unaffected rows are identical
            assert np.array_equal(g.token_ids, full.token_ids) and g.finish_reason == full.finish_reason
            continue
        hit += 1
        assert g.finish_reason == "stop" and g.text.endswith(stop)
        np.testing.assert_array_equal(g.token_ids, full.token_ids[:k])
        np.testing.assert_allclose(g.logprobs, full.logprobs[:k], atol=1e-6)
    assert hit >= 1


def test_sample_top_p_keeps_the_nucleus():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(400, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample_top_p(logp, 0.4, gen).tolist()) == {0}
    assert set(sample_top_p(logp, 0.7, gen).tolist()) == {0, 1}
    assert set(sample_top_p(logp, 1.0, gen).tolist()) == {0, 1, 2}


def test_update_weights_changes_outputs_and_version(engine, tokenizer):
    prompts, sp = _prompts(tokenizer, 6), SamplingConfig(max_new_tokens=6)
    before = engine.generate(prompts, sp, seed=2)
    original = {k: v.clone() for k, v in engine.state_dict_for_sync().items()}
    other = _model(tokenizer, seed=123).state_dict()
    engine.update_weights({k: other[k] for k in original}, version=3)
    assert engine.version == 3
    after = engine.generate(prompts, sp, seed=2)
    assert any(not np.allclose(a.logprobs[:1], b.logprobs[:1]) for a, b in zip(before, after))
    engine.update_weights(original, version=4)  # restoring gives back the same samples
    again = engine.generate(prompts, sp, seed=2)
    assert engine.version == 4
    assert all(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(before, again))


def test_update_weights_rejects_bad_tensors(engine):
    weights = {k: v.clone() for k, v in engine.state_dict_for_sync().items()}
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=rf"shape mismatch for '{name}'"):
        engine.update_weights({**weights, name: torch.zeros(3, 3)}, version=1)
    with pytest.raises(ValueError, match="unknown parameter names"):
        engine.update_weights({**weights, "model.nope.weight": torch.zeros(1)}, version=1)
    with pytest.raises(ValueError, match="missing parameters"):
        engine.update_weights({k: v for k, v in weights.items() if k != name}, version=1)
    # 63.7: the engine checks values too, for callers that bypass the actor's check
    poisoned = weights[name].clone()
    poisoned[0, 0] = float("nan")
    with pytest.raises(ValueError, match=rf"weights tensor '{name}' holds 1 NaN or infinite value"):
        engine.update_weights({**weights, name: poisoned}, version=1)
    with pytest.raises(ValueError, match="weights are float32, bfloat16 or float16"):
        engine.update_weights({**weights, name: weights[name].to(torch.int32)}, version=1)
    assert engine.version == 0
    for k, v in engine.state_dict_for_sync().items():  # nothing was half-applied
        assert torch.equal(v, weights[k])


def test_update_weights_accepts_full_state_dict_with_tied_alias(engine, tokenizer):
    other = _model(tokenizer, seed=9).state_dict()  # includes lm_head.weight (tied)
    engine.update_weights(other, version=5)
    assert torch.equal(engine.model.lm_head.weight, other["model.embed_tokens.weight"])


def test_a_groups_shared_prompt_is_prefilled_once_and_its_logprobs_are_right(engine, tokenizer):
    """Three prompts, each sampled four times as a GRPO group is: the first forward runs the three
    distinct prompts only, and every sample's behaviour log-probs are a full forward's."""
    distinct = _prompts(tokenizer, 3)
    prompts = [p for p in distinct for _ in range(4)]
    seen = []
    hook = engine.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        gens = engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=6), seed=3)
    finally:
        hook.remove()
    assert seen[0][0] == 3 and all(s[0] == 12 for s in seen[1:])  # one prefill per distinct prompt
    assert len({tuple(g.token_ids) for g in gens}) > 3  # the copies sample on their own
    for prompt, g in zip(prompts, gens):
        np.testing.assert_allclose(g.logprobs, _reference_logprobs(engine.model, prompt, g.token_ids, 1.0), atol=1e-4)
