"""The estimators and losses beside GRPO and PPO (RLOO, REINFORCE++, GSPO, CISPO), the trust region
around the behaviour policy, dynamic sampling's rule, length shaping and pass@k: against numbers
worked out by hand and against the published formulas written out token by token (verl's
``core_algos`` semantics)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.learner.evaluate import pass_at_k, pass_ks, sample_scores
from asyncrl.objectives.advantages import ADV_ESTIMATORS, informative, trajectory_advantages
from asyncrl.objectives.aggregation import LOSS_AGG_MODES, agg_loss
from asyncrl.objectives.losses import POLICY_LOSSES, LossConfig, PolicyLossInputs
from asyncrl.objectives.shaping import LengthShaping, overlong_penalty, truncated
from asyncrl.types import Episode, Trajectory

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def approx(x, rel=1e-6, abs=1e-9):
    """pytest.approx of ``x``, a nested list flattened (compare with ``tensor.flatten().tolist()``)."""
    while isinstance(x, list) and x and isinstance(x[0], list):
        x = [v for row in x for v in row]
    return pytest.approx(x, rel=rel, abs=abs)


# ---------------------------------------------------------------------------- estimators


def test_rloo_by_hand_and_as_n_over_n_minus_one_times_the_centred_reward():
    # group g: [1, 0, 1, 1]: the others' means are [2/3, 1, 2/3, 2/3]; group h: [2, 4] -> [-2, 2]
    adv = ADV_ESTIMATORS.get("rloo")(t([1.0, 0.0, 2.0, 1.0, 1.0, 4.0]), ["g", "g", "h", "g", "g", "h"])
    assert adv.tolist() == approx([1 / 3, -1.0, -2.0, 1 / 3, 1 / 3, 2.0])
    r = t([1.0, 0.0, 1.0, 1.0])
    assert ADV_ESTIMATORS.get("rloo")(r, ["g"] * 4).tolist() == approx((4 / 3 * (r - r.mean())).tolist())


def test_rloo_groups_of_one_and_equal_rewards():
    rloo = ADV_ESTIMATORS.get("rloo")
    assert rloo(t([0.7] * 8 + [5.0]), ["g"] * 8 + ["lone"]).tolist() == [0.0] * 9  # exactly 0
    assert rloo(t([1.0, 0.0, 5.0]), ["a", "a", "lone"], singleton="verl").tolist() == approx([1.0, -1.0, 5.0])
    assert rloo(t([1.0, 0.0]), ["a", "a"], norm_by_std=False).tolist() == rloo(t([1.0, 0.0]), ["a", "a"]).tolist()


def _masked_whiten(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_whiten`` (shift_mean) written out over tokens: the reference for REINFORCE++."""
    n = mask.sum()
    mean = (rows * mask).sum() / n
    var = (((rows - mean) ** 2) * mask).sum() / n * (n / (n - 1))  # masked_var, unbiased
    return (rows - mean) * torch.rsqrt(var + 1e-8)


def _token_rows(scores, lengths):
    width = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=D)
    return t(scores)[:, None] * mask, mask


def test_reinforce_pp_whitens_over_the_batchs_tokens():
    # by hand: lengths [2, 2, 4, 4], rewards [1, 0, 0, 1]: mean over 12 tokens 6/12 = 0.5,
    # unbiased variance 12 * 0.25 / 11 = 3/11, so A = +-0.5 / sqrt(3/11 + 1e-8)
    rewards, lengths = [1.0, 0.0, 0.0, 1.0], [2, 2, 4, 4]
    adv = ADV_ESTIMATORS.get("reinforce_pp")(t(rewards), ["a", "a", "b", "b"], lengths=lengths)
    a = 0.5 / math.sqrt(3 / 11 + 1e-8)
    assert adv.tolist() == approx([a, -a, -a, a])
    rows, mask = _token_rows(rewards, lengths)
    ref = _masked_whiten(rows, mask)
    assert adv.tolist() == approx([float(ref[i, 0]) for i in range(4)])
    # no lengths: every trajectory one token; a batch of one or of equal rewards: zeros
    adv1 = ADV_ESTIMATORS.get("reinforce_pp")(t([1.0, 0.0, 0.0]), ["a", "b", "c"])
    m, v = 1 / 3, (2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2
    assert adv1.tolist() == approx([(1 - m) / math.sqrt(v + 1e-8), -m / math.sqrt(v + 1e-8), -m / math.sqrt(v + 1e-8)])
    assert ADV_ESTIMATORS.get("reinforce_pp")(t([3.0]), ["a"]).tolist() == [0.0]
    assert ADV_ESTIMATORS.get("reinforce_pp")(t([0.5, 0.5]), ["a", "a"]).tolist() == [0.0, 0.0]


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens_over_tokens():
    rewards, groups, lengths = [1.0, 0.0, 1.0, 0.5, 0.5, 3.0], ["g", "g", "g", "h", "h", "lone"], [3, 1, 2, 5, 2, 4]
    est = ADV_ESTIMATORS.get("reinforce_pp_baseline")
    adv = est(t(rewards), groups, lengths=lengths, singleton="verl")
    # verl: scores - group mean (a group of one keeps its score), spread on tokens, masked_whiten
    centred = [1 - 2 / 3, 0 - 2 / 3, 1 - 2 / 3, 0.0, 0.0, 3.0]
    rows, mask = _token_rows(centred, lengths)
    ref = _masked_whiten(rows, mask)
    assert adv.tolist() == approx([float(ref[i, 0]) for i in range(6)])
    # the default singleton rule gives the lone trajectory score 0 before whitening
    rows0, _ = _token_rows(centred[:5] + [0.0], lengths)
    assert est(t(rewards), groups, lengths=lengths).tolist() == approx(
        [float(_masked_whiten(rows0, mask)[i, 0]) for i in range(6)]
    )
    assert est(t(rewards), groups, lengths=lengths, norm_by_std=False).tolist() == approx(
        [c - sum(n * c for n, c in zip(lengths, centred[:5] + [0.0])) / sum(lengths) for c in centred[:5] + [0.0]]
    )


def _traj(reward, group, n_gen=3, advantage=None, reasons=None):
    return Trajectory(
        token_ids=np.arange(2 + n_gen),
        loss_mask=[0, 0] + [1] * n_gen,
        behavior_logprobs=[0.0] * (2 + n_gen),
        policy_version=0,
        reward=reward,
        group_id=group,
        advantage=advantage,
        metadata={"finish_reasons": reasons} if reasons else {},
    )


def test_every_estimator_is_usable_from_the_config_and_reads_generated_lengths():
    trajs = [_traj(1.0, "g", 2), _traj(0.0, "g", 6), _traj(1.0, "h", 4), _traj(1.0, "h", 4)]
    for name in ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        cfg = load_config(None, [f"train.advantage.estimator={name}"]).train.advantage
        adv = trajectory_advantages(trajs, cfg)
        assert adv.shape == (4,) and torch.isfinite(adv).all(), name
    cfg = load_config(None, ["train.advantage.estimator=reinforce_pp"]).train.advantage
    expect = ADV_ESTIMATORS.get("reinforce_pp")(t([1.0, 0.0, 1.0, 1.0]), ["g", "g", "h", "h"], lengths=[2, 6, 4, 4])
    assert trajectory_advantages(trajs, cfg).tolist() == approx(expect.float().tolist(), rel=1e-6)
    with pytest.raises(ConfigError, match="rloo"):
        load_config(None, ["train.advantage.estimator=leave_one_in"])


# ---------------------------------------------------------------------------- losses


def _loss(name, logp, old, adv, mask, **kw):
    extra = {k: kw.pop(k) for k in ("behavior_weight", "exp_mask", "behavior_log_ratio") if k in kw}
    return POLICY_LOSSES.get(name)(PolicyLossInputs(logp, old, adv, mask, **extra), LossConfig(**kw))


def _grad(name, logp0, old, adv, mask, **kw):
    logp = logp0.clone().requires_grad_(True)
    loss, stats = _loss(name, logp, old, adv, mask, **kw)
    loss.backward()
    return loss, logp.grad, stats


def test_gspo_by_hand_ratio_one_and_a_clipped_sequence():
    mask = t([[1.0, 1.0]])
    # the tokens' log-ratios +0.1 and -0.1 average to 0: s = 1, L = -A, each token's gradient -A s / 2
    loss, grad, stats = _grad("gspo", t([[-1.0, -2.0]]), t([[-1.1, -1.9]]), t([[1.0, 1.0]]), mask)
    assert float(loss.detach()) == approx(-1.0) and grad.flatten().tolist() == approx([[-0.5, -0.5]])
    assert stats["clipfrac"] == 0.0
    # mean log-ratio 0.01: s = e^0.01 > 1 + 4e-4 with A > 0: clipped, no gradient
    loss, grad, stats = _grad("gspo", t([[-1.0, -2.0]]), t([[-1.01, -2.01]]), t([[1.0, 1.0]]), mask)
    assert float(loss.detach()) == approx(-(1 + 4e-4)) and grad.abs().max() == 0.0 and stats["clipfrac"] == 1.0
    # the same sequence with A < 0 is not clipped above: L = -A s
    loss, grad, _ = _grad("gspo", t([[-1.0, -2.0]]), t([[-1.01, -2.01]]), t([[-1.0, -1.0]]), mask)
    assert float(loss.detach()) == approx(math.exp(0.01)) and grad.flatten().tolist() == approx(
        [[math.exp(0.01) / 2] * 2]
    )


def _gspo_reference(logp, old, adv, mask, low, high, mode, norm=None):
    """verl's compute_policy_loss_gspo, written out."""
    neg_kl = logp - old
    seq = (neg_kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_s = (logp - logp.detach() + seq.detach().unsqueeze(-1)).clamp(max=10.0)
    s = torch.exp(log_s)
    losses = torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - low, 1 + high))
    return agg_loss(losses, mask, mode, norm=norm)


def _cispo_reference(logp, old, adv, mask, low, high, mode, norm=None):
    """MiniMax-M1's CISPO (verl / slime's compute_cispo_loss), written out."""
    ratio = torch.exp(logp - old)
    return agg_loss(-adv * torch.clamp(ratio, 1 - low, 1 + high).detach() * logp, mask, mode, norm=norm)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_gspo_and_cispo_equal_their_published_formulas_in_every_aggregation(name, mode):
    g = torch.Generator().manual_seed(3)
    logp0 = -torch.rand(3, 5, generator=g, dtype=D) * 2
    old = logp0 + (torch.rand(3, 5, generator=g, dtype=D) - 0.5) * 0.02
    adv = t([[1.0] * 5, [-0.5] * 5, [0.0] * 5])
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    norm = 7.0 if mode == "seq-mean-token-sum-norm" else None
    kw = dict(loss_agg_mode=mode, agg_norm=norm)
    loss, grad, _ = _grad(name, logp0, old, adv, mask, **kw)
    ref_fn, (low, high) = (_gspo_reference, (3e-4, 4e-4)) if name == "gspo" else (_cispo_reference, (1.0, 0.28))
    logp = logp0.clone().requires_grad_(True)
    ref = ref_fn(logp, old, adv, mask, low, high, mode, norm)
    ref.backward()
    assert float(loss.detach()) == approx(float(ref)) and grad.flatten().tolist() == approx(
        logp.grad.flatten().tolist()
    )


def test_cispo_keeps_the_gradient_of_a_token_ppo_clips():
    # r = 2 with A > 0: PPO clips the token (no gradient); CISPO weighs it by 1 + 0.28 and keeps it
    logp, old, adv, mask = t([[-0.5]]), t([[-0.5 - math.log(2.0)]]), t([[1.0]]), t([[1.0]])
    _, grad_ppo, _ = _grad("ppo", logp, old, adv, mask)
    loss, grad, stats = _grad("cispo", logp, old, adv, mask)
    assert grad_ppo.abs().max() == 0.0
    assert (
        grad.flatten().tolist() == approx([[-1.28]])
        and float(loss.detach()) == approx(1.28 * 0.5)
        and stats["clipfrac"] == 1.0
    )


# ---------------------------------------------------------------------------- the trust region on stale data


def test_behaviour_clip_blocks_tokens_past_the_band_on_their_advantages_side():
    # ratio 1 against the proximal policy (one step per batch); against the behaviour policy:
    # rho = 1.5 (A > 0: past 1.28, blocked), rho = 1.5 (A < 0: not clipped above), rho = 0.5 (A < 0: blocked)
    logp = t([[-1.0, -1.0, -1.0]])
    log_rho = t([[math.log(1.5), math.log(1.5), math.log(0.5)]])
    adv, mask = t([[1.0, -1.0, -1.0]]), t([[1.0, 1.0, 1.0]])
    weight = torch.exp(log_rho)
    _, grad, stats = _grad("ppo", logp, logp.clone(), adv, mask, behavior_weight=weight, behavior_log_ratio=log_rho)
    assert grad.flatten().tolist() == approx([[0.0, 1.5 / 3, 0.0]]) and stats["behavior_clipfrac"] == approx(2 / 3)
    assert stats["clipfrac"] == 0.0  # the proximal clip never acts here: only the behaviour one does
    _, grad_off, stats_off = _grad(
        "ppo", logp, logp.clone(), adv, mask, behavior_weight=weight, behavior_log_ratio=log_rho, behavior_clip=False
    )
    assert (
        grad_off.flatten().tolist() == approx([[-1.5 / 3, 1.5 / 3, 0.5 / 3]]) and "behavior_clipfrac" not in stats_off
    )


def test_one_step_decoupled_with_the_behaviour_clip_is_ppo_against_the_behaviour_policy():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=g, dtype=D) * 2
    behav = logp + (torch.rand(4, 6, generator=g, dtype=D) - 0.5) * 1.2  # rho in [0.55, 1.8]
    adv = (torch.rand(4, 1, generator=g, dtype=D) - 0.5).expand(4, 6).contiguous()
    mask = (torch.rand(4, 6, generator=g) > 0.2).to(D)
    log_rho = logp - behav  # the proximal policy is the current one
    _, grad_dec, stats = _grad(
        "ppo", logp, logp.clone(), adv, mask, behavior_weight=torch.exp(log_rho), behavior_log_ratio=log_rho
    )
    _, grad_off, stats_off = _grad("ppo", logp, behav, adv, mask)
    assert 0 < stats["behavior_clipfrac"] < 1
    assert stats["behavior_clipfrac"] == approx(stats_off["clipfrac"])
    assert grad_dec.flatten().tolist() == approx(grad_off.flatten().tolist())


def test_the_behaviour_clip_is_ppo_against_the_behaviour_policy_up_to_the_cap_dual_clip_included():
    """Issue 68.3: rho drawn up to is_cap (5), past the dual clip (3): where A < 0 and rho > 3 PPO
    against the behaviour policy gives no gradient, and neither does the trust region now."""
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(8, 12, generator=g, dtype=D) * 2
    log_rho = (torch.rand(8, 12, generator=g, dtype=D) * (math.log(5.0) - math.log(0.55))) + math.log(0.55)
    behav = logp - log_rho
    adv = (torch.rand(8, 1, generator=g, dtype=D) - 0.5).expand(8, 12).contiguous()
    mask = torch.ones(8, 12, dtype=D)
    assert bool(((adv < 0) & (log_rho > math.log(3.0))).any())  # (the case the audit found)
    _, grad_dec, stats = _grad(
        "ppo", logp, logp.clone(), adv, mask, behavior_weight=torch.exp(log_rho), behavior_log_ratio=log_rho
    )
    _, grad_off, stats_off = _grad("ppo", logp, behav, adv, mask)
    assert stats_off["dual_clip_frac"] > 0
    assert stats["behavior_clipfrac"] == approx(stats_off["clipfrac"] + stats_off["dual_clip_frac"])
    assert grad_dec.flatten().tolist() == approx(grad_off.flatten().tolist())


def test_gspo_takes_the_sequence_mean_of_the_raw_log_ratios_and_clamps_only_it():
    """Issue 68.5: verl's compute_policy_loss_gspo: the tokens' log-ratios are averaged as they are
    (no per-token clamp at +-20) and only the sequence's log-ratio is clamped, at 10."""
    mask = t([[1.0, 1.0]])
    # log-ratios +30 and -20: the sequence mean is 5 (a clamp at +-20 first would make it 0)
    loss, _, stats = _grad("gspo", t([[-1.0, -31.0]]), t([[-31.0, -11.0]]), t([[-1.0, -1.0]]), mask)
    assert float(loss.detach()) == approx(math.exp(5.0)) and stats["ratio_max"] == approx(math.exp(5.0))
    loss, _, _ = _grad("gspo", t([[-1.0, -1.0]]), t([[-40.0, -40.0]]), t([[-1.0, -1.0]]), mask)
    assert float(loss.detach()) == approx(math.exp(10.0))  # (the sequence's clamp)


def test_gspo_defaults_to_its_own_aggregation():
    """Issue 68.1: the paper's and verl's GSPO is seq-mean-token-mean; an explicit choice stays."""
    assert load_config(None, ["train.policy_loss=gspo"]).train.loss_agg_mode == "seq-mean-token-mean"
    assert load_config(None, []).train.loss_agg_mode == "token-mean"
    kept = load_config(None, ["train.policy_loss=gspo", "train.loss_agg_mode=token-mean"]).train.loss_agg_mode
    assert kept == "token-mean"


def test_gspo_and_cispo_under_the_behaviour_clip():
    logp, mask = t([[-1.0, -1.0]]), t([[1.0, 1.0]])
    log_rho = t([[0.01, 0.01]])  # the sequence's geometric-mean ratio against behaviour e^0.01 > 1 + 4e-4
    _, grad, stats = _grad("gspo", logp, logp.clone(), t([[1.0, 1.0]]), mask, behavior_log_ratio=log_rho)
    assert grad.abs().max() == 0.0 and stats["behavior_clipfrac"] == 1.0
    _, grad, _ = _grad("gspo", logp, logp.clone(), t([[-1.0, -1.0]]), mask, behavior_log_ratio=log_rho)
    assert grad.abs().max() > 0
    # CISPO: the weight is the ratio against behaviour, clipped (the correction's weight is not applied again)
    _, grad, _ = _grad(
        "cispo",
        logp,
        logp.clone(),
        t([[1.0, 1.0]]),
        mask,
        behavior_log_ratio=t([[math.log(2.0)] * 2]),
        behavior_weight=t([[2.0, 2.0]]),
    )
    assert grad.flatten().tolist() == approx([[-1.28 / 2] * 2])
    _, grad, _ = _grad(
        "cispo",
        logp,
        logp.clone(),
        t([[1.0, 1.0]]),
        mask,
        behavior_log_ratio=t([[math.log(2.0)] * 2]),
        behavior_weight=t([[2.0, 2.0]]),
        behavior_clip=False,
    )
    assert grad.flatten().tolist() == approx([[-2.0 / 2] * 2])  # weight 1 (ratio against the proximal policy) x 2


def test_meaningless_combinations_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="off_policy_reshape=p_div_p_0.1 shapes PPO"):
        load_config(None, ["train.policy_loss=gspo", "replay.enabled=true", "replay.off_policy_reshape=p_div_p_0.1"])
    with pytest.raises(ConfigError, match="overlong_buffer .8. must be below"):
        load_config(None, ["train.overlong_buffer=8", "sampling.max_new_tokens=8"])
    with pytest.raises(ConfigError, match="cispo, gspo, ppo"):
        load_config(None, ["train.policy_loss=dpo"])


# ---------------------------------------------------------------------------- dynamic sampling, length shaping


def test_informative_groups():
    assert not informative([_traj(1.0, "g"), _traj(1.0, "g"), _traj(0.0, "h")])  # equal, and a group of one
    assert informative([_traj(1.0, "g"), _traj(0.0, "g")])
    assert not informative([_traj(0.3, "g", advantage=0.0), _traj(0.7, "g", advantage=0.0)])  # their own: 0
    assert informative([_traj(0.5, "g", advantage=-0.2)])


def test_overlong_penalty_is_a_linear_ramp_over_the_buffer():
    # max_len 10, buffer 4: no penalty up to 6 tokens, then -0.25 per token, -1 at 10 and beyond
    assert overlong_penalty([3, 6, 7, 8, 10, 12], 10, 4).tolist() == approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert overlong_penalty([8], 10, 4, factor=0.5).tolist() == approx([-0.25])
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty([1], 4, 4)


def test_length_shaping_in_the_batch():
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.learner.training.trainer import PolicyTrainer

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
        )
    )
    train = load_config(
        None, ["train.overlong_buffer=2", "train.mask_truncated=true", "sampling.max_new_tokens=6"]
    ).train
    trainer = PolicyTrainer(model, type("Tok", (), {"pad_token_id": 0})(), train, 1.0)
    trajs = [_traj(1.0, "g", 6, reasons=["length"]), _traj(1.0, "g", 3, reasons=["stop"]), _traj(0.0, "g", 5)]
    assert [truncated(x) for x in trajs] == [True, False, False]
    assert LengthShaping.from_config(train).penalties(trajs).tolist() == approx([-1.0, 0.0, -0.5])

    batch = trainer.make_batch([Episode(trajectories=trajs)])
    assert batch.response_mask[0].sum() == 0 and batch.advantages[0].abs().sum() == 0  # truncated: out of the loss
    # the advantages read the shaped rewards [0, 1, -0.5]: grpo over them
    expect = ADV_ESTIMATORS.get("grpo")(t([0.0, 1.0, -0.5]), ["g"] * 3).float()
    assert batch.row_advantages.tolist() == approx(expect.tolist(), rel=1e-6)
    assert trainer.shaping_stats == approx({"overlong/penalty_mean": -0.5, "overlong/truncated_share": 1 / 3})


# ---------------------------------------------------------------------------- pass@k


def test_pass_at_k_against_its_closed_form_and_avg_at_k():
    for n in (1, 4, 10, 50):
        for c in range(n + 1):
            for k in range(1, n + 1):
                closed = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == approx(closed, rel=1e-9, abs=1e-12), (n, c, k)
    assert pass_at_k(8, 3, 1) == approx(3 / 8)  # pass@1 is the mean correctness, avg@k
    assert pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1]
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(4, 5, 1)


def test_avg_at_k_is_the_direct_mean_and_pass_at_k_the_share_of_problems_solved_once():
    right = np.random.default_rng(0).random((40, 8)) < np.linspace(0.0, 0.9, 40)[:, None]  # 40 problems x 8 samples
    scores = sample_scores(right.sum(1).tolist(), 8)
    assert scores["avg@8"] == approx(float(right.mean()))
    assert scores["pass@1"] == approx(float(right.mean()))  # pass@1's unbiased estimate is the mean correctness
    assert scores["pass@8"] == approx(float(right.any(1).mean()))  # with j = n: solved by at least one sample
    assert scores["pass@1"] <= scores["pass@2"] <= scores["pass@4"] <= scores["pass@8"]


def test_rlcr_two_levels_take_the_runs_estimator():
    from asyncrl.algos.rlcr.trees import tree_advantages

    acc = np.array([1.0, 0.0, 1.0])
    conf = np.array([[0.9, 0.5], [0.2, 0.7], [1.0, 1.0]])
    ans, cf = tree_advantages(acc, conf, norm_by_std=False, estimator="rloo")
    assert ans.tolist() == approx(ADV_ESTIMATORS.get("rloo")(t(acc), ["p"] * 3).tolist())
    assert cf.reshape(-1).tolist() == approx(
        ADV_ESTIMATORS.get("rloo")(t(conf.reshape(-1)), ["0", "0", "1", "1", "2", "2"]).tolist()
    )
    grpo_ans, _ = tree_advantages(acc, conf, norm_by_std=False)
    assert ans.tolist() != approx(grpo_ans.tolist())  # rloo's n / (n - 1) differs from grpo's R - mean


def test_reinforce_pp_discounts_per_generated_token_with_gamma():
    """Issue 68.4: REINFORCE++ takes train.advantage.gamma: token t returns R gamma^k (k generated
    tokens after it; a multi-turn row's environment tokens neither count nor reset it), whitened
    over the batch's tokens; gamma 1 is the trajectory-level estimator spread on the tokens."""
    from asyncrl.objectives.advantages import discounted_reinforce_pp

    rewards = t([1.0, 0.0])
    mask = t([[0.0, 1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0, 0.0]])  # row 0: two turns around an env token
    out = discounted_reinforce_pp(rewards, mask, gamma=0.5)
    returns = torch.tensor([0.25, 0.5, 1.0, 0.0, 0.0], dtype=D)  # row 0's three tokens, then row 1's two
    whitened = (returns - returns.mean()) / torch.sqrt(returns.var() + 1e-8)
    assert out[mask > 0].tolist() == approx(whitened.tolist(), rel=1e-5) and (out[mask == 0] == 0).all()
    flat = discounted_reinforce_pp(rewards, mask, gamma=1.0)
    expect = ADV_ESTIMATORS.get("reinforce_pp")(rewards, ["a", "b"], lengths=[3, 2])
    assert flat[0][mask[0] > 0].tolist() == approx([float(expect[0])] * 3, rel=1e-5)
    assert flat[1][mask[1] > 0].tolist() == approx([float(expect[1])] * 2, rel=1e-5)


def test_the_trainer_applies_reinforce_pp_s_discount():
    from asyncrl.learner.training.trainer import PolicyTrainer
    from asyncrl.models.tokenizer import build_char_tokenizer
    from tests.unit.learner.test_packing import _model, _rows

    rows = _rows()
    for gamma, constant in ((1.0, True), (0.9, False)):
        cfg = load_config(None, ["train.advantage.estimator=reinforce_pp", f"train.advantage.gamma={gamma}"])
        batch = PolicyTrainer(_model(), build_char_tokenizer(), cfg.train, 1.0).make_batch([Episode(trajectories=rows)])
        long_row = batch.advantages[1][batch.response_mask[1] > 0]  # (30 generated tokens)
        assert bool((long_row == long_row[0]).all()) == constant
