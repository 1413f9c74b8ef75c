"""Rollout routing replay (R3, ``model.routing_replay``; issue 68): the Hugging Face engine records
each token's experts in a real transformers mixture-of-experts model (Qwen2-MoE, randomly
initialised, tiny), the routes travel in the episode message, the learner checks them, and its
forward (padded and packed) uses them with gate weights from its own router logits."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from asyncrl.config import SamplingConfig, load_config
from asyncrl.engine.hf import HFEngine
from asyncrl.engine.routing import RoutingRecorder, replay_routing, routers, routing_limits
from asyncrl.learner.ingest.peers import EpisodeValidator
from asyncrl.learner.ingest.server import Arrival, Limits
from asyncrl.learner.training.batch import collate, forward_rows
from asyncrl.models.tiny import tiny_moe
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.prompts import render_tokens
from asyncrl.types import Episode, Trajectory
from asyncrl.wire.codec import decode, decode_episode, encode_episode
from tests.unit.learner.test_packing import _model

LAYERS, EXPERTS, TOP_K = 3, 8, 2


def _moe(seed: int = 0, norm: bool = True) -> torch.nn.Module:
    return tiny_moe(len(build_char_tokenizer()), LAYERS, EXPERTS, TOP_K, seed=seed, norm_topk_prob=norm)


def _rows(model, dtype=torch.float32, n: int = 3) -> list[Trajectory]:
    """Completions of three prompts (n samples each, so the shared-prefill path records too) by the
    engine in ``dtype``, as trajectories with the recorded routes."""
    tok = build_char_tokenizer()
    engine = HFEngine(copy.deepcopy(model).to(dtype), tok, record_routing=True)
    prompts = [render_tokens(tok, [{"role": "user", "content": q}]) for q in ("12+7=?", "3+45=?", "99+1 is?")]
    batch = [p for p in prompts for _ in range(n)]
    gens = engine.generate(batch, SamplingConfig(n=n, temperature=1.0, max_new_tokens=8), seed=1)
    rows = []
    for p, g in zip(batch, gens):
        assert g.routing.shape == (len(p) + len(g.token_ids), LAYERS * TOP_K) and g.routing.dtype == np.int16
        assert (g.routing[-1] == -1).all() and (g.routing[:-1] >= 0).all() and (g.routing < EXPERTS).all()
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


def _own_routes(model, batch) -> torch.Tensor:
    rec = RoutingRecorder(model)
    with torch.no_grad(), rec.recording():
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        return rec.take().view(*batch.input_ids.shape, -1)


@pytest.mark.parametrize("packing", ["padded", "mask", "flex"])
def test_the_learner_replays_the_engines_routes_and_its_logprobs(packing):
    """float32 engine and learner: the recorded routes are the learner's own top-k, and the
    replayed forward gives the engine's log-probs (padded and both packed layouts)."""
    model = _moe()
    rows = _rows(model)
    batch = collate(rows, torch.zeros(len(rows)), pad_id=0)
    assert batch.routing.shape == (*batch.input_ids.shape, LAYERS * TOP_K)
    own = _own_routes(model, batch)
    real = batch.routing >= 0
    agree = (
        own.view(*own.shape[:2], LAYERS, TOP_K).sort(-1).values
        == batch.routing.view(*own.shape[:2], LAYERS, TOP_K).sort(-1).values
    )
    assert bool(agree.view(*own.shape[:2], -1)[real].all())
    with torch.no_grad():
        out = forward_rows(model, batch, packing=packing)
    on = batch.response_mask > 0
    assert torch.allclose(out.logprobs[on], batch.behavior_logprobs[on], atol=1e-4)


def _family(name: str, norm: bool) -> torch.nn.Module:
    """A tiny random model of another transformers mixture-of-experts family."""
    import transformers

    common = dict(
        vocab_size=len(build_char_tokenizer()),
        hidden_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=256,
    )
    torch.manual_seed(4)
    if name == "mixtral":  # (always renormalises)
        cfg = transformers.MixtralConfig(intermediate_size=32, num_local_experts=EXPERTS, **common)
        return transformers.MixtralForCausalLM(cfg).eval()
    if name == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=32, num_experts=EXPERTS, norm_topk_prob=norm, **common
        )
        return transformers.Qwen3MoeForCausalLM(cfg).eval()
    return _moe(seed=2, norm=norm)


@pytest.mark.parametrize(
    "family, norm", [("qwen2_moe", True), ("qwen2_moe", False), ("qwen3_moe", False), ("mixtral", True)]
)
def test_replay_forces_the_recorded_experts_with_the_learners_gate_weights(family, norm):
    """Routes unlike the router's own choice are the ones used; each gate weight is the learner's
    softmax over the recorded experts, renormalised when the model renormalises (norm_topk_prob;
    Mixtral always does)."""
    model = _family(family, norm)
    assert len(routers(model)) == LAYERS
    ids = torch.randint(3, 40, (2, 9))
    own = _own_routes(model, type("B", (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)})())
    forced = ((own.long() + 3) % EXPERTS).view(-1, LAYERS * TOP_K)  # every choice moved: k distinct experts
    seen: dict[int, tuple] = {}

    def spy(i, seen=seen):
        return lambda m, a, out: seen.__setitem__(i, out)

    with torch.no_grad(), replay_routing(model, forced):
        handles = [r.register_forward_hook(spy(i)) for i, r in enumerate(routers(model))]
        model(input_ids=ids, use_cache=False)
        for h in handles:
            h.remove()
    for i in range(LAYERS):
        logits, scores, indices = seen[i]
        want = forced[:, i * TOP_K : (i + 1) * TOP_K]
        assert torch.equal(indices.long(), want)
        probs = torch.softmax(logits.float(), -1).gather(-1, want)
        expected = probs / probs.sum(-1, keepdim=True) if norm else probs
        assert torch.allclose(scores.float(), expected, atol=1e-6)


@pytest.mark.parametrize("packing", ["padded", "mask", "flex"])
def test_replay_narrows_a_low_precision_engines_mismatch(packing):
    """A bfloat16 engine and a float32 learner route some tokens differently; replaying the
    engine's routes brings the learner's log-probs closer to the engine's (bench/bench_routing.py
    measures it at size)."""
    model = _moe(seed=3)
    rows = _rows(model, dtype=torch.bfloat16, n=6)
    batch = collate(rows, torch.zeros(len(rows)), pad_id=0)
    on = batch.response_mask > 0
    kept = batch.routing
    with torch.no_grad():
        replayed = forward_rows(model, batch, packing=packing).logprobs
        batch.routing = None
        plain = forward_rows(model, batch, packing=packing).logprobs
    own = _own_routes(model, batch)
    flips = (
        own.view(*own.shape[:2], LAYERS, TOP_K).sort(-1).values
        != kept.view(*own.shape[:2], LAYERS, TOP_K).sort(-1).values
    ).any(-1)
    assert bool(flips[kept.view(*own.shape[:2], LAYERS, TOP_K)[..., 0] >= 0].any())  # some tokens route otherwise
    gap_plain = (plain - batch.behavior_logprobs)[on].abs().mean()
    gap_replay = (replayed - batch.behavior_logprobs)[on].abs().mean()
    assert gap_replay < gap_plain


def test_routes_travel_in_the_episode_message_and_the_learner_checks_them():
    model = _moe()
    rows = _rows(model, n=1)
    ep = Episode(trajectories=rows, actor_id="actor-0")
    frames = encode_episode(ep)
    msg = decode(frames)
    back = decode_episode(msg)
    for a, b in zip(rows, back.trajectories):
        assert np.array_equal(a.routing, b.routing)
    width, experts = routing_limits(model, True)
    assert (width, experts) == (LAYERS * TOP_K, EXPERTS) and routing_limits(model, False) == (0, 0)

    def check(routing_rows, limits_routing=(width, experts)):
        trajs = [
            Trajectory(**{**{f: getattr(r, f) for f in Trajectory.__struct_fields__ if f != "id"}, "routing": x})
            for r, x in zip(rows, routing_rows)
        ]
        frames = encode_episode(Episode(trajectories=trajs, actor_id="actor-0"))
        msg = decode(frames)
        lim = Limits(1 << 20, 1 << 16, 8, 256, *limits_routing)
        return EpisodeValidator(vocab_size=len(build_char_tokenizer()), limits=lim).check(
            Arrival(decode_episode(msg), frames, msg.arrays), 0
        )

    assert check([r.routing for r in rows]) is None
    bad = [r.routing.copy() for r in rows]
    bad[1][2, 0] = EXPERTS
    reason, why = check(bad)
    assert reason == "routing" and f"in [0, {EXPERTS})" in why
    reason, why = check([r.routing[:, :-1].copy() for r in rows])
    assert reason == "routing" and f"expected {width}" in why
    reason, why = check([r.routing for r in rows], (0, 0))
    assert reason == "routing" and "replays none" in why
    with pytest.raises(ValueError, match="2-D"):
        Trajectory(
            token_ids=np.zeros(3, np.int32),
            loss_mask=np.zeros(3, np.uint8),
            behavior_logprobs=np.zeros(3, np.float32),
            policy_version=0,
            routing=np.zeros(3, np.int16),
        )


def test_routing_replay_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="no mixture-of-experts routers"):
        HFEngine(_model(), build_char_tokenizer(), record_routing=True)
    with pytest.raises(ValueError, match="routing_replay needs engine.type=hf and actor.weight_update=batch"):
        load_config(None, ["model.routing_replay=true", "actor.weight_update=inflight"])
    with pytest.raises(ValueError, match="entries per token"):
        with replay_routing(_moe(), torch.zeros(4, 3, dtype=torch.long)):
            pass
