"""Learner maths against numbers worked out by hand (verl's core_algos formulas, AReaL's decoupled PPO)."""

import math

import pytest
import torch

from asyncrl.objectives.advantages import ADV_ESTIMATORS, compute_grpo_advantages
from asyncrl.objectives.aggregation import agg_loss
from asyncrl.objectives.corrections import behavior_importance_weight
from asyncrl.objectives.logprobs import entropy_from_logits, kl_penalty, logprobs_from_logits
from asyncrl.objectives.losses import POLICY_LOSSES, LossConfig, PolicyLossInputs, compute_policy_loss

D = torch.float64
EPS = 1e-6


def t(x):
    return torch.tensor(x, dtype=D)


def approx(x, rel=1e-6, abs=1e-9):
    return pytest.approx(x, rel=rel, abs=abs)


def policy_loss(logp, old, adv, mask, behavior_weight=None, exp_mask=None, **cfg):
    """The registered PPO loss on typed inputs and a LossConfig built from ``cfg``."""
    return compute_policy_loss(PolicyLossInputs(logp, old, adv, mask, behavior_weight, exp_mask), LossConfig(**cfg))


# ---------------------------------------------------------------------------- advantages


def test_grpo_one_group_by_hand():
    # mean = 3/4 = 0.75; deviations [0.25, -0.75, 0.25, 0.25]
    # sum of squares = 3 * 0.0625 + 0.5625 = 0.75; unbiased var = 0.75 / 3 = 0.25; std = 0.5
    adv = compute_grpo_advantages(t([1.0, 0.0, 1.0, 1.0]), ["g"] * 4, norm_by_std=True)
    s = 0.5 + EPS
    assert adv.tolist() == approx([0.25 / s, -0.75 / s, 0.25 / s, 0.25 / s])
    assert adv.tolist() == approx([0.5, -1.5, 0.5, 0.5], rel=1e-5)


def test_grpo_two_interleaved_groups():
    # group a: [1, 0] -> mean 0.5, std = sqrt((0.25 + 0.25) / 1) = 0.70710678 -> +-0.5 / 0.7071 = +-0.7071
    # group b: [2, 4, 6] -> mean 4, std = sqrt((4 + 0 + 4) / 2) = 2 -> [-1, 0, 1]
    adv = compute_grpo_advantages(t([1.0, 2.0, 0.0, 4.0, 6.0]), ["a", "b", "a", "b", "b"])
    sa, sb = math.sqrt(0.5) + EPS, 2.0 + EPS
    assert adv.tolist() == approx([0.5 / sa, -2 / sb, -0.5 / sa, 0.0, 2 / sb])


def test_grpo_singleton_group_gets_zero():
    # verl would give the lone trajectory A = R = 5 (its mean 0, std 1 convention for groups of
    # one); here it is 0, and the pair is normalised as usual.
    adv = compute_grpo_advantages(t([1.0, 0.0, 5.0]), ["a", "a", "lone"])
    s = math.sqrt(0.5) + EPS
    assert adv.tolist() == approx([0.5 / s, -0.5 / s, 0.0])


def test_grpo_without_std_and_constant_group():
    # Dr.GRPO: A = R - mean = [1 - 0.75, 0 - 0.75, ...]
    adv = compute_grpo_advantages(t([1.0, 0.0, 1.0, 1.0]), ["g"] * 4, norm_by_std=False)
    assert adv.tolist() == approx([0.25, -0.75, 0.25, 0.25])
    # all equal: 0 / (0 + eps) = 0, not NaN
    assert compute_grpo_advantages(t([1.0, 1.0]), ["g", "g"]).tolist() == [0.0, 0.0]


def test_registry_lookup_and_errors():
    assert ADV_ESTIMATORS.get("grpo") is compute_grpo_advantages
    assert POLICY_LOSSES.get("ppo") is compute_policy_loss
    with pytest.raises(KeyError, match="grpo"):
        ADV_ESTIMATORS.get("nope")
    with pytest.raises(ValueError, match="ppo"):
        POLICY_LOSSES.get("nope")


# ---------------------------------------------------------------------------- aggregation

LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 10 / 4),  # (1 + 2 + 3 + 4) / 4 tokens
        ("seq-mean-token-sum", 5.0),  # sums [6, 4] -> mean 5
        ("seq-mean-token-mean", 3.0),  # means [6/3, 4/1] = [2, 4] -> mean 3
        ("seq-mean-token-sum-norm", 10 / 3),  # 10 / norm, norm = 3
    ],
)
def test_agg_modes_ragged_mask(mode, expected):
    assert agg_loss(t(LOSS), t([[1, 1, 1], [1, 0, 0]]), mode, norm=3).item() == approx(expected)


def test_agg_explicit_norm_and_empty_rows():
    mask = t([[1, 1, 1], [1, 0, 0]])
    assert agg_loss(t(LOSS), mask, "seq-mean-token-sum-norm", norm=5).item() == approx(10 / 5)
    empty_row = t([[1, 1, 1], [0, 0, 0]])
    # the empty second row is left out of the seq means: [6] -> 6 and [2] -> 2
    assert agg_loss(t(LOSS), empty_row, "seq-mean-token-sum").item() == approx(6.0)
    assert agg_loss(t(LOSS), empty_row, "seq-mean-token-mean").item() == approx(2.0)
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(t(LOSS), mask, "bogus")
    # the divisor is a constant, never the padded width (3 here): without one, an error, not 10 / 3
    with pytest.raises(ValueError, match="needs a constant divisor"):
        agg_loss(t(LOSS), mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="needs a constant divisor"):
        LossConfig(loss_agg_mode="seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_all_zero_mask_is_zero_with_grad(mode):
    x = t(LOSS).requires_grad_()
    loss = agg_loss(x, torch.zeros(2, 3, dtype=D), mode, norm=3)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(x.grad, torch.zeros(2, 3, dtype=D))


# ---------------------------------------------------------------------------- PPO

# ratio, advantage, expected per-token loss with clip_low 0.2, clip_high 0.28, c = 3:
BRANCHES = [
    (1.25, 1.0, -1.25),  # inside [0.8, 1.28] thanks to clip-higher: unclipped -A r
    (1.5, 1.0, -1.28),  # max(-1.5, -1.28) = -1.28: clipped high
    (0.5, -1.0, 0.8),  # max(0.5, 0.8) = 0.8: clipped low; min(0.8, 3) keeps it
    (4.0, -1.0, 3.0),  # max(4, 1.28) = 4 unclipped, then dual clip min(4, 3 * 1) = 3
    (0.5, 1.0, -0.5),  # positive A, low ratio: max(-0.5, -0.8) = -0.5, unclipped
    (1.2, -1.0, 1.2),  # inside the range: 1.2
    (10.0, 5.0, None),  # masked out: must not count anywhere
]


def _branch_tensors():
    ratio = t([[r for r, _, _ in BRANCHES]])
    adv = t([[a for _, a, _ in BRANCHES]])
    mask = t([[1, 1, 1, 1, 1, 1, 0]])
    old = torch.full_like(ratio, -1.0)
    logp = (old + ratio.log()).requires_grad_()
    return logp, old, adv, mask


def test_ppo_each_branch_by_hand():
    logp, old, adv, mask = _branch_tensors()
    loss, stats = policy_loss(logp, old, adv, mask)
    # (-1.25 - 1.28 + 0.8 + 3.0 - 0.5 + 1.2) / 6 = 1.97 / 6
    assert loss.item() == approx(1.97 / 6)
    assert stats["pg_loss"] == approx(1.97 / 6)
    assert stats["clipfrac"] == approx(2 / 6)  # tokens 1 and 2
    assert stats["dual_clip_frac"] == approx(1 / 6) and stats["clipfrac_lower"] == approx(1 / 6)
    assert stats["ratio_mean"] == approx((1.25 + 1.5 + 0.5 + 4 + 0.5 + 1.2) / 6)  # 8.95 / 6
    assert (stats["ratio_min"], stats["ratio_max"]) == (approx(0.5), approx(4.0))
    # mean(old - new) = -ln(1.25 * 1.5 * 0.5 * 4 * 0.5 * 1.2) / 6 = -ln(2.25) / 6
    assert stats["approx_kl"] == approx(-math.log(2.25) / 6)
    loss.backward()
    # dL/dlogp = -A r / 6 on unclipped tokens, 0 where a clip bound (a constant) was taken
    assert logp.grad[0].tolist() == approx([-1.25 / 6, 0, 0, 0, -0.5 / 6, 1.2 / 6, 0])


def test_ppo_symmetric_clip_clips_what_clip_higher_keeps():
    logp, old, adv, mask = _branch_tensors()
    one = t([[1, 0, 0, 0, 0, 0, 0]])
    loss, stats = policy_loss(logp, old, adv, one, clip_high=0.2)
    assert loss.item() == approx(-1.2)  # max(-1.25, -1.2)
    assert stats["clipfrac"] == 1.0


def test_behavior_weight_and_cap():
    old = t([[0.0, 0.0, 0.0, 0.0]]).requires_grad_()
    behav = t([[0.0, -math.log(2), -math.log(10), math.log(2)]])
    w = behavior_importance_weight(old, behav, cap=5.0)
    # exp(old - behav) = [1, 2, 10 -> capped at 5, 0.5]
    assert w[0].tolist() == approx([1.0, 2.0, 5.0, 0.5])
    assert not w.requires_grad


def test_behavior_weight_scales_token_losses():
    # ratio 1, A = 1: per-token -1, weighted [-1, -2], token-mean -1.5
    z = torch.zeros(1, 2, dtype=D)
    loss, _ = policy_loss(
        z.clone().requires_grad_(),
        z,
        torch.ones(1, 2, dtype=D),
        torch.ones(1, 2, dtype=D),
        behavior_weight=t([[1.0, 2.0]]),
    )
    assert loss.item() == approx(-1.5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_zero_staleness_decoupled_equals_plain_ppo(mode):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g, dtype=D) * 3
    new = old + torch.randn(3, 5, generator=g, dtype=D) * 0.4
    adv = torch.randn(3, 1, generator=g, dtype=D).expand(3, 5).contiguous()
    mask = (torch.rand(3, 5, generator=g) > 0.3).to(D)
    w = behavior_importance_weight(old, old.clone(), cap=5.0)  # behaviour == proximal
    assert torch.equal(w, torch.ones_like(w))
    a, b = new.clone().requires_grad_(), new.clone().requires_grad_()
    plain, _ = policy_loss(a, old, adv, mask, loss_agg_mode=mode, agg_norm=5.0)
    decoupled, _ = policy_loss(b, old, adv, mask, loss_agg_mode=mode, agg_norm=5.0, behavior_weight=w)
    plain.backward()
    decoupled.backward()
    assert torch.equal(plain, decoupled)
    assert torch.equal(a.grad, b.grad)


def _replay_batch():
    # row 0 on-policy: p = [0.6, 0.55] vs proximal [0.4, 0.5] -> ratios [1.5, 1.1]
    # row 1 replayed: p = [0.3, 0.5] vs recorded [0.2, 0.2] -> ratios [1.5, 2.5]
    #   (its proximal equals p, so without the recorded log-probs the ratio would be 1)
    logp = t([[0.6, 0.55], [0.3, 0.5]]).log().requires_grad_()
    prox = t([[0.4, 0.5], [0.3, 0.5]]).log()
    recorded = torch.stack([torch.zeros(2, dtype=D), t([0.2, 0.2]).log()])
    exp_mask = t([[0, 0], [1, 1]])
    old = torch.where(exp_mask > 0, recorded, prox)  # replayed tokens: the recorded policy is the old one
    return logp, old, torch.ones(2, 2, dtype=D), torch.ones(2, 2, dtype=D), exp_mask


def test_off_policy_tokens_use_recorded_ratio_and_off_clip():
    logp, old, adv, mask, exp_mask = _replay_batch()
    loss, s = policy_loss(logp, old, adv, mask, exp_mask=exp_mask, off_clip_high=1.0)
    # on: [max(-1.5, -1.28), -1.1] = [-1.28, -1.1]; off (upper bound 2.0): [-1.5, max(-2.5, -2.0)]
    assert loss.item() == approx((-1.28 - 1.1 - 1.5 - 2.0) / 4)
    assert s["on_pg_loss"] == approx((-1.28 - 1.1) / 2)
    assert s["off_pg_loss"] == approx((-1.5 - 2.0) / 2)
    assert (s["on_clipfrac"], s["off_clipfrac"], s["clipfrac"]) == (0.5, 0.5, 0.5)
    assert (s["off_ratio_mean"], s["off_ratio_min"], s["off_ratio_max"]) == (approx(2.0), approx(1.5), approx(2.5))
    assert s["off_token_ratio"] == 0.5
    loss.backward()
    # d/dlogp = -A r / 4 where unclipped: on [clipped, -1.1/4]; off [-1.5/4, clipped]
    assert logp.grad.tolist() == [approx([0.0, -1.1 / 4]), approx([-1.5 / 4, 0.0])]


def test_on_policy_tokens_unaffected_by_replayed_rows():
    logp, old, adv, mask, exp_mask = _replay_batch()
    _, mixed = policy_loss(logp, old, adv, mask, exp_mask=exp_mask, off_clip_high=1.0)
    alone, _ = policy_loss(logp[:1], old[:1], adv[:1], mask[:1])
    assert mixed["on_pg_loss"] == approx(alone.item())
    # without off_clip_high the replayed ratios 1.5 and 2.5 both clip at the normal 1.28
    _, s = policy_loss(logp, old, adv, mask, exp_mask=exp_mask)
    assert s["off_pg_loss"] == approx(-1.28) and s["off_clipfrac"] == 1.0


def test_off_policy_reshape_p_div_p():
    logp, old, adv, mask, exp_mask = _replay_batch()
    loss, s = policy_loss(logp, old, adv, mask, exp_mask=exp_mask, off_policy_reshape="p_div_p_0.1")
    # f(r) = r / (r + 0.1), unclipped: f(1.5) = 1.5/1.6 = 0.9375, f(2.5) = 2.5/2.6 = 0.9615385
    assert s["off_pg_loss"] == approx(-(0.9375 + 2.5 / 2.6) / 2)
    assert s["off_clipfrac"] == 0.0
    assert loss.item() == approx((-1.28 - 1.1 - 0.9375 - 2.5 / 2.6) / 4)
    loss.backward()
    # d f / d logp = 0.1 r / (r + 0.1)^2: 0.15 / 2.56 and 0.25 / 6.76, times -A / 4
    assert logp.grad[1].tolist() == approx([-0.15 / 2.56 / 4, -0.25 / 6.76 / 4])
    with pytest.raises(ValueError, match="p_div_p_0.1"):
        policy_loss(logp, old, adv, mask, exp_mask=exp_mask, off_policy_reshape="bogus")


# ---------------------------------------------------------------------------- KL, entropy


def test_kl_k1_k3_by_hand():
    logp, ref = t([math.log(0.5), math.log(0.25), -30.0]), t([math.log(0.25), math.log(0.5), 0.0])
    # k1 = logp - ref: [ln 2, -ln 2, -30]
    assert kl_penalty(logp, ref, "k1").tolist() == approx([math.log(2), -math.log(2), -30.0])
    # k3 with d = ref - logp: d = -ln2 -> 0.5 + ln2 - 1; d = ln2 -> 2 - ln2 - 1; d = 30 -> clamp 10
    k3 = kl_penalty(logp, ref, "k3").tolist()
    assert k3 == approx([0.5 + math.log(2) - 1, 2 - math.log(2) - 1, 10.0])
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(logp, ref, "k9")


def test_entropy_and_logprobs_from_logits():
    logits = t([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -1e9, -1e9]]])  # [1, 2, 4]
    # uniform over 4: ln 4; [0.25, 0.75]: 0.25 ln 4 + 0.75 ln(4/3)
    ent = entropy_from_logits(logits)[0].tolist()
    assert ent == approx([math.log(4), 0.25 * math.log(4) + 0.75 * math.log(4 / 3)])
    lp = logprobs_from_logits(logits, torch.tensor([[2, 1]]))[0].tolist()
    assert lp == approx([math.log(0.25), math.log(0.75)])


def test_logprobs_half_precision_matches_float32():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 7, (2, 3), generator=torch.Generator().manual_seed(2))
    bf = logits.to(torch.bfloat16)
    ref = torch.log_softmax(bf.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    got = logprobs_from_logits(bf, labels)
    assert got.dtype == torch.float32 and torch.allclose(got, ref)
