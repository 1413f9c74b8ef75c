"""Rollout routing replay (R3, ``model.routing_replay``): how far the learner's log-probs of sampled
tokens are from the engine's, with and without replaying the engine's expert choices.

A small randomly initialised mixture-of-experts model from transformers (Qwen2-MoE: ``--layers``
layers of ``--experts`` experts, top-``--top-k``, ``--hidden`` wide) samples completions of the
quick start's addition prompts through asyncrl's Hugging Face engine, in ``--engine-dtype``
(bfloat16: an inference engine's usual precision), recording each token's experts. The learner's
forward (float32, the trainer's own ``forward_rows``, padded and packed) then scores the same tokens
with its own routing and with the recorded routing. Printed per setting: the mean and largest
``|log pi_learner - log pi_behaviour|`` over generated tokens, the share of tokens more than 0.1 apart,
the mean k3 KL estimate, and the share of (token, layer) routing decisions where the learner's own
top-k differs from the engine's.

    .venv/bin/python bench/bench_routing.py                       # defaults: 64 prompts x 4 samples
    .venv/bin/python bench/bench_routing.py --engine-dtype float32 --seeds 3
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics

import numpy as np
import torch

from asyncrl.config import SamplingConfig, load_config
from asyncrl.engine.hf import HFEngine
from asyncrl.engine.routing import RoutingRecorder, routers
from asyncrl.envs.arithmetic import arithmetic_tasks
from asyncrl.learner.training.batch import collate, forward_rows
from asyncrl.models.tiny import tiny_moe
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.prompts import render_tokens
from asyncrl.types import Trajectory


def sample(model, tok, dtype: str, prompts: int, n: int, seed: int):
    engine = HFEngine(copy.deepcopy(model).to(getattr(torch, dtype)), tok, record_routing=True)
    tasks = list(itertools.islice(arithmetic_tasks(load_config(None, ["tasks.ops=[+]"]).tasks, seed), prompts))
    ids = [render_tokens(tok, [dict(m) for m in t.prompt]) for t in tasks]
    batch = [p for p in ids for _ in range(n)]
    gens = engine.generate(batch, SamplingConfig(n=n, temperature=1.0, max_new_tokens=8), seed=seed)
    rows = []
    for p, g in zip(batch, gens):
        rows.append(
            Trajectory(
                token_ids=np.r_[p, g.token_ids].astype(np.int32),
                loss_mask=np.r_[np.zeros(len(p)), np.ones(len(g.token_ids))].astype(np.uint8),
                behavior_logprobs=np.r_[np.zeros(len(p)), g.logprobs].astype(np.float32),
                policy_version=0,
                routing=g.routing,
            )
        )
    return rows


def measure(model, rows, replay: bool, packing: str) -> dict[str, float]:
    for r in rows:
        if not replay:
            r.routing, r.metadata["kept"] = None, r.routing
        elif r.routing is None:
            r.routing = r.metadata.pop("kept")
    batch = collate(rows, torch.zeros(len(rows)), pad_id=0)
    rec = RoutingRecorder(model)
    with torch.no_grad(), rec.recording():
        out = forward_rows(model, batch, packing=packing)
    on = batch.response_mask > 0
    gap = (out.logprobs - batch.behavior_logprobs)[on].double()
    log_ratio = -gap  # log(pi_behaviour / pi_learner) at behaviour samples
    return {
        "mean_abs": float(gap.abs().mean()),
        "max_abs": float(gap.abs().max()),
        "share_over_0.1": float((gap.abs() > 0.1).double().mean()),
        "k3_kl": float((log_ratio.exp() - 1 - log_ratio).mean()),
    }


def flips(model, rows) -> float:
    """The share of (generated token, routed layer) decisions where the learner's own top-k set is
    not the engine's recorded one (float32 learner, padded forward)."""
    for r in rows:
        if r.routing is None:
            r.routing = r.metadata.pop("kept")
    batch = collate(rows, torch.zeros(len(rows)), pad_id=0)
    rec = RoutingRecorder(model)
    with torch.no_grad(), rec.recording():
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        own = rec.take().view(*batch.input_ids.shape, -1)
    k = int(routers(model)[0].top_k)
    B, T, W = batch.routing.shape
    mine = own.view(B, T, W // k, k).sort(-1).values
    theirs = batch.routing.view(B, T, W // k, k).sort(-1).values
    recorded = (batch.routing.view(B, T, W // k, k) >= 0).all(-1)
    gen = torch.zeros(B, T, dtype=torch.bool)
    gen[:, 1:] = batch.response_mask > 0
    sel = recorded & gen[..., None]
    return float(((mine != theirs).any(-1) & sel).sum() / sel.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--init", type=float, default=0.2, help="initializer_range (larger: sharper, more varied routing)")
    ap.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    tok = build_char_tokenizer()
    results: dict[str, list[dict]] = {}
    flip: list[float] = []
    for seed in range(args.seeds):
        model = tiny_moe(
            len(tok), args.layers, args.experts, args.top_k, args.hidden, seed, args.init, norm_topk_prob=True
        )
        rows = sample(model, tok, args.engine_dtype, args.prompts, args.n, seed)
        flip.append(flips(model, rows))
        for packing in ("padded", "mask"):
            for replay in (False, True):
                name = f"{'replay' if replay else 'own routing'}, {packing}"
                results.setdefault(name, []).append(measure(model, rows, replay, packing))
        print(f"seed {seed}: {len(rows)} completions, routing differs on {flip[-1]:.4f} of token-layer decisions")
    print(
        f"\nengine {args.engine_dtype}, learner float32; Qwen2-MoE {args.layers} layers x {args.experts} experts, "
        f"top-{args.top_k}, width {args.hidden}; {args.seeds} seeds x {args.prompts} prompts x {args.n} samples"
    )
    print(f"routing decisions that differ without replay: {statistics.fmean(flip):.4f} (per seed {flip})")
    keys = ["mean_abs", "max_abs", "share_over_0.1", "k3_kl"]
    print("| learner forward | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, rs in results.items():
        print(f"| {name} | " + " | ".join(f"{statistics.fmean(r[k] for r in rs):.3g}" for k in keys) + " |")


if __name__ == "__main__":
    main()
