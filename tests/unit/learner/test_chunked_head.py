"""Issue 61: the learner at a real vocabulary's size. The chunked output layer (train.logits_chunk_mb,
asyncrl.learner.training.chunked_head) gives today's log-probs, entropies and gradients within 1e-5, on
a random Llama with SmolLM2's 49,152-token vocabulary, padded and packed (shared prompts), at two
temperatures, with the logits split into many chunks (activation checkpointing in the backward pass);
a model whose forward changes its logits after the output layer falls back to full logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.learner.training.batch import collate, forward_rows
from asyncrl.learner.training.chunked_head import chunk_tokens, output_layer
from asyncrl.objectives.logprobs import entropy_from_logits
from asyncrl.types import Trajectory

VOCAB = 49_152


def _model(tied: bool = True, cls=LlamaForCausalLM, dtype=torch.float32):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    config._attn_implementation = "sdpa"
    return cls(config).to(dtype)


def _batch():
    rng = np.random.default_rng(5)
    rows = []
    for g, (plen, n) in enumerate([(9, 3), (5, 2), (12, 1)]):
        prompt = rng.integers(3, VOCAB, plen)
        for i in range(n):
            resp = rng.integers(3, VOCAB, int(rng.integers(2, 14)))
            ids = np.r_[prompt, resp].astype(np.int64)
            mask = np.r_[np.zeros(plen), np.ones(len(resp))]
            rows.append(
                Trajectory(
                    token_ids=ids,
                    loss_mask=mask,
                    behavior_logprobs=-0.5 * mask,
                    policy_version=0,
                    reward=float(i % 2),
                    group_id=f"g{g}",
                )
            )
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.25, 0.0])
    return collate(rows, adv, pad_id=0)


def _run(model, batch, chunk_mb, **kw):
    out = forward_rows(model, batch, with_entropy=True, logits_chunk_mb=chunk_mb, **kw)
    loss = -(out.logprobs * batch.advantages).sum() - 0.1 * (out.entropy * batch.response_mask).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return out, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packing,shared", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_entropies_and_gradients_equal_full_logits(packing, shared, temperature):
    batch = _batch()
    valid = batch.response_mask.bool()  # (the chunked head computes the trained targets only)
    model = _model(tied=not shared)  # both a tied and an untied output layer
    full, g_full = _run(model, batch, 0, temperature=temperature, packing=packing, shared_prefix=shared)
    chunk_mb = 0.75  # 4 target positions a chunk: the batch's ~100 targets in ~25 chunks
    assert chunk_tokens(output_layer(model), chunk_mb) == 4
    chunked, g_chunk = _run(model, batch, chunk_mb, temperature=temperature, packing=packing, shared_prefix=shared)
    for a, b in ((full.logprobs, chunked.logprobs), (full.entropy, chunked.entropy)):
        assert float((a - b).detach()[valid].abs().max()) <= 1e-5
    assert set(g_full) == set(g_chunk)
    for k in g_full:
        assert float((g_full[k] - g_chunk[k]).abs().max()) <= 1e-5, k
    head = output_layer(model).weight.grad
    assert head is not None and float(head.abs().max()) > 1e-4  # the output layer's gradient is in the comparison
    assert (chunked.slots, chunked.real_tokens, chunked.shared_rows) == (full.slots, full.real_tokens, full.shared_rows)


def test_without_a_graph_and_in_bfloat16():
    """bfloat16 logits: the log-probs as before (float32 from the bfloat16 logits); the entropy is now taken
    in float32 as well (full logits take it in bfloat16, 0.02-0.05 off on this model)."""
    batch = _batch()
    valid = batch.response_mask.bool()  # (the chunked head computes the trained targets only)
    model = _model(dtype=torch.bfloat16)
    with torch.no_grad():
        full = forward_rows(model, batch, with_entropy=True, packing=True, logits_chunk_mb=0)
        chunked = forward_rows(model, batch, with_entropy=True, packing=True, logits_chunk_mb=0.75)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    assert chunked.logprobs.dtype == torch.float32
    assert float((full.logprobs - chunked.logprobs)[valid].abs().max()) <= 1e-5
    assert float((entropy_from_logits(logits) - chunked.entropy)[valid].abs().max()) <= 1e-4


class _ScaledLlama(LlamaForCausalLM):
    """A model that changes its logits after the output layer (as soft-capping or a logit scale does)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def test_a_model_that_changes_its_logits_falls_back_to_full_logits():
    batch = _batch()
    valid = batch.response_mask.bool()  # (the chunked head computes the trained targets only)
    model = _model(cls=_ScaledLlama)
    with torch.no_grad():
        full = forward_rows(model, batch, with_entropy=True, logits_chunk_mb=0)
        with pytest.warns(UserWarning, match="changes the output layer's logits"):
            chunked = forward_rows(model, batch, with_entropy=True, logits_chunk_mb=0.75)
    assert torch.equal(full.logprobs[valid], chunked.logprobs[valid])
    assert "forward" not in output_layer(model).__dict__  # the output layer is itself again
