"""Issue 62: packed attention without a dense block mask (train.attention).

``flex``: one flat bin with shared prompts, its document mask a flex-attention BlockMask; torch runs
flex attention on a CPU without a backward, so here its forward is checked against the padded one
(log-probs, entropies) and its mask against the block mask it replaces, slot by slot. ``varlen``:
one flat bin of whole rows through torch's variable-length kernel, which is CUDA-only; on a CPU its
reference (one SDPA call per sequence, ``tests.support.plugins.cpu_varlen``) stands in for the
kernel, and everything around it (the flat bin, cu_seqlens, the registered attention function, the
switch of the model's implementation) gives the padded step's log-probs, gradients and update for
every aggregation mode, with a critic and with LoRA adapters. Sliding windows, GQA, and the choice
of path (auto, refusals in one line) too. The kernels themselves run in bench/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from asyncrl.config import ConfigError, load_config
from asyncrl.learner.training import attention
from asyncrl.learner.training.attention import FLEX_BLOCK, choose, document_mask, measure, sliding_window_of
from asyncrl.learner.training.batch import first_trained, forward_rows
from asyncrl.learner.training.packing import cu_seqlens, pack_rows
from asyncrl.learner.training.trainer import PolicyTrainer
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.objectives.aggregation import LOSS_AGG_MODES
from tests.support.plugins import cpu_varlen
from tests.unit.learner.test_packing import REFERENCE, VOCAB, _batch, _model, _same

TOL = 1e-5


def _gqa_model(window: int | None = None):
    """A tiny model with 4 query heads over 2 key/value heads; ``window``: a Qwen2 whose second layer
    attends within a sliding window."""
    torch.manual_seed(0)
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    if window is None:
        config = LlamaConfig(**kw, attn_implementation="sdpa")
        return LlamaForCausalLM(config).float()
    config = Qwen2Config(
        **kw, use_sliding_window=True, sliding_window=window, max_window_layers=1, attn_implementation="sdpa"
    )
    return Qwen2ForCausalLM(config).float()


def _compare(model_fn, path: str, shared: bool, grads: bool, temperature: float = 1.0):
    batch = _batch()
    valid = batch.attention_mask[:, 1:].bool()
    results = {}
    for packing in ("padded", path):
        model = model_fn()
        with torch.set_grad_enabled(grads):
            out = forward_rows(model, batch, temperature, with_entropy=True, packing=packing, shared_prefix=shared)
            if grads:
                (-(out.logprobs * batch.advantages).sum() - 0.01 * (out.entropy * batch.response_mask).sum()).backward()
        results[packing] = (out, {k: p.grad.clone() for k, p in model.named_parameters()} if grads else {})
        assert model.config._attn_implementation == "sdpa"  # the switch is undone after the forward
    (ref, g0), (got, g1) = results["padded"], results[path]
    for a, b in ((ref.logprobs, got.logprobs), (ref.entropy, got.entropy)):
        assert float((a - b).detach()[valid].abs().max()) <= TOL
    for k in g0:
        assert float((g0[k] - g1[k]).abs().max()) <= TOL, k
    assert not grads or max(float(g.abs().max()) for g in g0.values()) > 1e-3
    return ref, got


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("model_fn", [_model, _gqa_model], ids=["mha", "gqa"])
def test_the_flex_forward_equals_the_padded_one(shared, model_fn):
    _, got = _compare(model_fn, "flex", shared, grads=False, temperature=0.7)
    assert got.slots % FLEX_BLOCK == 0 and got.slots < 2 * FLEX_BLOCK  # one flat bin, rounded to a block
    assert (got.shared_rows > 0) == shared


@pytest.mark.parametrize("model_fn", [_model, _gqa_model], ids=["mha", "gqa"])
def test_the_varlen_forward_and_gradients_equal_the_padded_ones(model_fn):
    with cpu_varlen():
        ref, got = _compare(model_fn, "varlen", shared=True, grads=True)  # (varlen never shares a prompt)
    assert got.shared_rows == 0 and got.slots == ref.real_tokens  # every row's tokens, no padding at all


def test_sliding_window_layers_are_kept_by_flex_and_varlen_and_the_dense_mask_is_refused():
    """A Qwen2 whose second layer attends within 6 positions, rows of up to 37 tokens."""
    model = _gqa_model(window=6)
    assert sliding_window_of(model) == 6 and sliding_window_of(_gqa_model()) is None
    _compare(lambda: _gqa_model(window=6), "flex", shared=True, grads=False)
    with cpu_varlen():
        _compare(lambda: _gqa_model(window=6), "varlen", shared=False, grads=True)
    with pytest.raises(ValueError, match="train.attention=mask: the model has sliding-window layers"):
        choose("mask", True, model, "cpu")
    assert choose("auto", True, model, "cpu") == ("padded", [])  # auto on a CPU: HF's own sliding window


def test_the_flex_document_mask_is_the_block_mask_it_replaces():
    """Slot by slot, the flat bin's mask lets each token see exactly its row's earlier tokens (a suffix
    its prompt's copy), as the bins' dense block mask does."""
    from torch.nn.attention.flex_attention import create_mask

    batch = _batch()
    lengths = batch.attention_mask.sum(1)
    packed = pack_rows(batch.input_ids, lengths, starts=first_trained(batch), flat=True, multiple=FLEX_BLOCK)
    W = packed.shape[1]
    dense = create_mask(document_mask(packed, None), None, None, W, W, device="cpu")[0, 0]
    assert packed.shape == (1, W) and W % FLEX_BLOCK == 0 and packed.attention is None
    for b, n in enumerate(lengths.tolist()):
        slots = packed.token_index[b, :n]
        expect = torch.zeros(n, W, dtype=torch.bool)
        for i in range(n):
            expect[i, slots[: i + 1]] = True
        assert torch.equal(dense[slots], expect), b
    assert packed.shared_rows >= 5  # one copy of each prompt in the whole micro-batch


def test_cu_seqlens_are_the_rows_and_a_shared_layout_is_refused():
    batch = _batch()
    lengths = batch.attention_mask.sum(1)
    packed = pack_rows(batch.input_ids, lengths, varlen=True)
    cu, longest = cu_seqlens(packed)
    sizes = (cu[1:] - cu[:-1]).tolist()
    assert cu.dtype == torch.int32 and int(cu[-1]) == packed.shape[1] == int(lengths.sum())
    assert sorted(sizes) == sorted(lengths.tolist()) and longest == int(lengths.max())
    for b, n in enumerate(lengths.tolist()):  # each row one sequence, its positions from 0
        start = int(packed.token_index[b, 0])
        assert start in cu.tolist() and int(cu[cu.tolist().index(start) + 1]) == start + n
        assert torch.equal(packed.position_ids[0, start : start + n], torch.arange(n))
    padded = pack_rows(batch.input_ids, lengths, varlen=True, flat=True, multiple=int(lengths.sum()) + 5)
    cu, _ = cu_seqlens(padded)
    assert int(cu[-1]) == padded.shape[1] == int(lengths.sum()) + 5 and int(cu[-2]) == int(
        lengths.sum()
    )  # the padding: its own
    shared = pack_rows(batch.input_ids, lengths, starts=first_trained(batch), flat=True)
    with pytest.raises(ValueError, match="no shared prompts"):
        cu_seqlens(shared)


def _trained(overrides, model_fn=_model, batch_fn=_batch):
    cfg = load_config(None, ["train.lr=1e-3", "train.max_grad_norm=1e6", *overrides])
    model = model_fn()
    if cfg.model.lora is not None:
        from asyncrl.models.lora import with_adapters

        model = with_adapters(model, cfg.model, seed=0)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    trainer = PolicyTrainer(model, build_char_tokenizer(), cfg.train, 1.0, critic_cfg=cfg.critic, model_cfg=cfg.model)
    result = trainer.step(batch_fn(), version=1)
    params = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
    return params, grads, result, trainer


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_a_varlen_trainer_step_in_micro_batches_equals_one_padded_pass(agg):
    base = [f"train.loss_agg_mode={agg}", "train.loss_scale_norm=16", "train.kl_coef=0.05", "train.entropy_coef=0.01"]
    ref = _trained([*base, *REFERENCE])
    with cpu_varlen():
        got = _trained([*base, "train.attention=varlen", "train.micro_batch_tokens=24"])
    _same(ref[:3], got[:3], TOL)
    assert got[3].attention == "varlen" and got[2].stats["learner/micro_batches"] > 3
    assert got[2].stats["learner/padding_share"] == 0.0


def test_varlen_with_a_critic_and_lora_adapters_equals_the_padded_step():
    critic = ["train.advantage.estimator=gae", "critic.lr=1e-3", "critic.max_grad_norm=1e6", "model.lora.rank=4"]
    ref = _trained([*critic, *REFERENCE])
    with cpu_varlen():
        got = _trained([*critic, "train.attention=varlen", "train.micro_batch_tokens=24"])
    _same(ref[:3], got[:3], TOL)
    assert got[3].critic.attention == "varlen"
    for key in ("critic/value_loss", "critic/value_mean", "critic/grad_norm"):
        assert got[2].stats[key] == pytest.approx(ref[2].stats[key], rel=1e-5, abs=1e-6), key


def test_the_path_is_chosen_by_device_and_a_path_that_cannot_run_says_why():
    model = _model()
    assert choose("auto", True, model, "cpu") == ("mask", [])
    assert choose("auto", False, model, "cpu") == ("padded", [])  # train.packing=false
    assert choose("padded", True, model, "cpu") == ("padded", [])
    with pytest.raises(ValueError, match=r"train.attention=varlen: torch's varlen_attn is a CUDA kernel"):
        choose("varlen", True, model, "cpu")
    with pytest.raises(ValueError, match=r"train.attention=flex: torch runs flex attention's backward on CUDA only"):
        choose("flex", True, model, "cpu")
    with pytest.raises(ConfigError, match="train.attention=varlen"):  # the trainer's one line
        _trained(["train.attention=varlen"])
    with pytest.raises(Exception, match="train.attention"):
        load_config(None, ["train.attention=dense"])


def test_auto_on_cuda_measures_the_candidates_and_keeps_the_fastest(monkeypatch):
    """On CUDA (faked here: the availability of each path) auto times each candidate twice and keeps
    the fastest; one that fails is left out; with train.deterministic the first available, unmeasured."""

    def fake(path, model, device, training=True):
        return None if path in ("varlen", "flex") else "no"

    monkeypatch.setattr(attention, "available", fake)
    model = _model()
    assert choose("auto", True, model, "cuda") == (None, ["varlen", "flex", "padded"])
    assert choose("auto", True, model, "cuda", deterministic=True) == ("varlen", [])
    calls = []

    def run(path):
        calls.append(path)
        if path == "varlen":
            raise RuntimeError("no kernel image")
        if path == "padded":
            torch.ones(300, 300) @ torch.ones(300, 300)

    best, times = measure(["varlen", "flex", "padded"], run)
    assert best == "flex" and times["varlen"] != times["varlen"] and calls.count("flex") == 2


def test_gradient_checkpointing_gives_the_same_step_and_keeps_to_mask_or_padded():
    """64.8: train.gradient_checkpointing (transformers' non-reentrant checkpointing of each layer): the
    same gradients and update; the packed paths whose layout lives only through the forward are refused."""
    ref = _trained([*REFERENCE])
    got = _trained(["train.gradient_checkpointing=true", "train.micro_batch_tokens=24"])
    _same(ref[:3], got[:3], TOL)
    assert got[3].model.is_gradient_checkpointing and got[3].attention == "mask"
    with pytest.raises(ValueError, match="gradient_checkpointing recomputes the layers"):
        choose("varlen", True, _model(), "cpu", recompute=True)
