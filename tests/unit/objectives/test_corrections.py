"""Off-policy corrections (train.off_policy_correction), the is_cap rules, the per-token version lag
and the constant divisor of seq-mean-token-sum-norm, against hand-computed numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.config import ConfigError, load_config
from asyncrl.learner.training.batch import collate, compute_logprobs
from asyncrl.learner.training.trainer import PolicyTrainer, token_lag_stats
from asyncrl.objectives.corrections import OFF_POLICY_CORRECTIONS, CorrectionConfig, behavior_weights
from asyncrl.objectives.losses import LossConfig, PolicyLossInputs, compute_policy_loss
from asyncrl.types import Episode, Trajectory

LN = math.log
# Two rows of log rho = logp_prox - logp_behav. Row 0: rho = [2, 3, 0.25] (product 1.5, geometric
# mean 1.5^(1/3) = 1.1447); row 1: rho = [2, 2] and one padded position (product 4, geometric mean 2).
LOG_RHO = torch.tensor([[LN(2), LN(3), LN(0.25)], [LN(2), LN(2), 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _weights(name: str, cap: float, low: float | None = None, mode: str = "truncate"):
    behav = torch.zeros(2, 3, dtype=torch.float64)
    return behavior_weights(LOG_RHO.clone(), behav, MASK, CorrectionConfig(name, cap, mode, low))


def _on(x: torch.Tensor) -> list:
    """The values on MASK, row by row."""
    return x[MASK > 0].tolist()


def test_decoupled_truncates_at_the_cap():
    bw = _weights("decoupled", cap=2.5)
    assert _on(bw.weight) == pytest.approx([2.0, 2.5, 0.25, 2.0, 2.0])  # min(rho, 2.5)
    assert _on(bw.capped) == [False, True, False, False, False]
    assert not bw.masked.any()


def test_decoupled_mask_mode_drops_tokens_above_the_cap_as_areal_does():
    bw = _weights("decoupled", cap=2.5, mode="mask")
    assert _on(bw.weight) == pytest.approx([2.0, 0.0, 0.25, 2.0, 2.0])  # 3 > 2.5: weight 0
    assert _on(bw.masked) == [False, True, False, False, False]
    assert not bw.capped.any()


def test_token_tis_is_the_truncated_token_weight():
    bw = _weights("token_tis", cap=2.5, mode="mask")  # is_cap_mode does not apply to token_tis
    assert _on(bw.weight) == pytest.approx([2.0, 2.5, 0.25, 2.0, 2.0])


def test_seq_tis_truncates_the_sequence_product():
    bw = _weights("seq_tis", cap=2.5)
    # row 0: 2 * 3 * 0.25 = 1.5 <= 2.5; row 1: 2 * 2 = 4 -> 2.5, on every token of the row
    assert _on(bw.weight) == pytest.approx([1.5, 1.5, 1.5, 2.5, 2.5])
    assert _on(bw.capped) == [False, False, False, True, True]


def test_seq_mis_drops_sequences_whose_product_exceeds_the_cap():
    bw = _weights("seq_mis", cap=2.5)
    assert _on(bw.weight) == pytest.approx([1.5, 1.5, 1.5, 0.0, 0.0])
    assert _on(bw.masked) == [False, False, False, True, True]
    bw = _weights("seq_mis", cap=4.5)  # 4 <= 4.5: kept with its weight
    assert _on(bw.weight) == pytest.approx([1.5, 1.5, 1.5, 4.0, 4.0])


def test_icepop_keeps_tokens_whose_ratio_is_inside_the_band():
    bw = _weights("icepop", cap=2.5, low=0.5)
    # 2 in [0.5, 2.5] kept as 2; 3 above; 0.25 below
    assert _on(bw.weight) == pytest.approx([2.0, 0.0, 0.0, 2.0, 2.0])
    assert _on(bw.masked) == [False, True, True, False, False]
    bw = _weights("icepop", cap=4.0)  # low defaults to 1 / cap = 0.25: 0.25 is kept (closed band)
    assert _on(bw.weight) == pytest.approx([2.0, 3.0, 0.25, 2.0, 2.0])


def test_geo_mask_rejects_sequences_by_the_geometric_mean():
    bw = _weights("geo_mask", cap=1.2, low=0.9)
    # row 0: 1.5 ** (1/3) = 1.1447 inside [0.9, 1.2] -> 1; row 1: geometric mean 2 -> 0
    assert 0.9 < 1.5 ** (1 / 3) < 1.2
    assert _on(bw.weight) == pytest.approx([1.0, 1.0, 1.0, 0.0, 0.0])
    assert _on(bw.masked) == [False, False, False, True, True]


def test_seq_geo_weighs_each_sequence_by_its_geometric_mean_and_is_gspo_s_default():
    """Issue 68.2: a sequence-level loss takes a sequence-level behaviour weight."""
    bw = _weights("seq_geo", cap=1.9)
    g0 = 1.5 ** (1 / 3)
    assert _on(bw.weight) == pytest.approx([g0, g0, g0, 1.9, 1.9])  # row 1's mean 2 is capped
    assert _on(bw.capped) == [False, False, False, True, True]
    masked = _weights("seq_geo", cap=1.9, mode="mask")
    assert _on(masked.weight) == pytest.approx([g0, g0, g0, 0.0, 0.0]) and _on(masked.masked)[3:] == [True, True]
    assert load_config(None, ["train.policy_loss=gspo"]).train.off_policy_correction == "seq_geo"
    assert load_config(None, []).train.off_policy_correction == "decoupled"
    chosen = ["train.policy_loss=gspo", "train.off_policy_correction=decoupled"]
    assert load_config(None, chosen).train.off_policy_correction == "decoupled"  # (an explicit choice stays)


@pytest.mark.parametrize("name", sorted(OFF_POLICY_CORRECTIONS.names()))
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_every_correction_is_one_without_staleness(name, mode):
    logp = torch.tensor([[-0.3, -2.0, -5.0], [-1.0, -0.1, 0.0]])
    bw = behavior_weights(logp, logp.clone(), MASK, CorrectionConfig(name, cap=1.0, cap_mode=mode, low=1.0))
    assert (bw.weight == 1.0).all() and not bw.capped.any() and not bw.masked.any()


def test_config_names_every_registered_correction():
    """The registry is the one declaration: every registered correction is a valid config value, and
    anything else is refused with the registered names."""
    for name in OFF_POLICY_CORRECTIONS.names():
        assert load_config(None, [f"train.off_policy_correction={name}"]).train.off_policy_correction == name
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.off_policy_correction=nope"])
    assert ", ".join(OFF_POLICY_CORRECTIONS.names()) in str(err.value)


def test_cap_below_one_and_bad_bounds_are_refused_at_config_load():
    with pytest.raises(ConfigError, match=r"train\.is_cap.*>= 1.*plain PPO"):
        load_config(None, ["train.is_cap=0.5"])
    with pytest.raises(ConfigError, match=r"train\.is_low.*\(0, 1\]"):
        load_config(None, ["train.is_low=1.5"])
    with pytest.raises(ConfigError, match=r"recompute_proximal=true"):
        load_config(None, ["train.recompute_proximal=false", "train.off_policy_correction=seq_tis"])
    with pytest.raises(ConfigError, match=r"off_policy_correction"):
        load_config(None, ["train.off_policy_correction=nope"])
    with pytest.raises(ValueError, match="is_cap must be >= 1"):
        CorrectionConfig("decoupled", cap=0.9)
    cfg = load_config(None, ["train.off_policy_correction=icepop", "train.is_low=0.5", "train.is_cap=5"])
    assert CorrectionConfig.from_config(cfg.train) == CorrectionConfig("icepop", 5.0, "truncate", 0.5)


# ---------------------------------------------------------------------------- through the trainer
def _tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=16,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    )


class _Tok:
    pad_token_id = 0


def test_trainer_applies_icepop_and_reports_masked_share():
    """Two rows, advantages -0.5 / +0.5 (Dr.GRPO); behaviour log-probs set so that rho is 3 on one
    token of row 0 and 1 elsewhere. With icepop [0.5, 2.5] that token's loss is dropped: the
    token-mean PPO loss at ratio 1 is sum(-A_i * w_t) / N."""
    model = _tiny_model()
    cfg = load_config(
        None,
        [
            "train.off_policy_correction=icepop",
            "train.is_cap=2.5",
            "train.is_low=0.5",
            "train.advantage.norm_by_std=false",
            "train.lr=1e-9",
        ],
    )
    ids = [np.array([1, 2, 3, 4, 5, 6]), np.array([1, 2, 7, 8, 9, 10])]
    mask = np.array([0, 0, 1, 1, 1, 1], dtype=np.uint8)
    rows = [
        Trajectory(
            token_ids=i,
            loss_mask=mask,
            behavior_logprobs=np.zeros(6, np.float32),
            policy_version=3,
            reward=r,
            group_id="g",
        )
        for i, r in zip(ids, (0.0, 1.0))
    ]
    with torch.no_grad():
        cur, _ = compute_logprobs(model, collate(rows, torch.zeros(2), 0))
    for b, t in enumerate(rows):  # behaviour = current (rho = 1), except row 0's third generated token
        beh = np.concatenate([[0.0], cur[b].numpy()]).astype(np.float32) * mask
        if b == 0:
            beh[4] -= LN(3.0)  # target position 3 scores token 4: rho = 3 there
        t.behavior_logprobs = beh
    trainer = PolicyTrainer(model, _Tok(), cfg.train, 1.0)
    stats = trainer.step(trainer.make_batch([Episode(trajectories=rows)]), version=5).stats
    n = 8  # four generated tokens per row
    assert stats["is_weight_masked_frac"] == pytest.approx(1 / n)
    assert stats["is_weight_capped_frac"] == 0.0
    # row 0 (A = -0.5): three kept tokens of loss +0.5; row 1 (A = +0.5): four tokens of loss -0.5
    assert stats["pg_loss"] == pytest.approx((3 * 0.5 + 4 * -0.5) / n, abs=1e-5)
    assert stats["staleness/token_lag_mean"] == 2.0 and stats["staleness/token_lag_frac_2"] == 1.0


def test_token_lag_distribution_is_weighted_by_generated_tokens():
    def row(n_gen: int, version: int, replay: bool = False) -> Trajectory:
        m = np.array([0, 0] + [1] * n_gen, dtype=np.uint8)
        return Trajectory(
            token_ids=np.arange(1, 3 + n_gen),
            loss_mask=m,
            behavior_logprobs=np.zeros(2 + n_gen),
            policy_version=version,
            is_replay=replay,
            exp_mask=m if replay else None,
        )

    # at version 10: 2 tokens of lag 0, 3 of lag 1, 5 of lag 6; a replayed row (lag 9) is left out
    batch = collate([row(2, 10), row(3, 9), row(5, 4), row(4, 1, replay=True)], torch.zeros(4), 0)
    s = token_lag_stats(batch, 10)
    assert s["staleness/token_lag_mean"] == pytest.approx((0 * 2 + 1 * 3 + 6 * 5) / 10)
    assert s["staleness/token_lag_max"] == 6.0
    assert [s[f"staleness/token_lag_frac_{k}"] for k in range(4)] == pytest.approx([0.2, 0.3, 0.0, 0.0])
    assert s["staleness/token_lag_frac_ge4"] == pytest.approx(0.5)


# ---------------------------------------------------------------------------- seq-mean-token-sum-norm
def test_sum_norm_loss_does_not_depend_on_prompt_length():
    """The same two responses (4 and 2 generated tokens) after a 2-token and a 12-token prompt: with
    the constant divisor from config the loss is the same (the padded width, prompt + 4 - 1, would
    have made it -1/5 and -1/15); without one the mode is refused."""

    def rows(prompt: int) -> list[Trajectory]:
        out = []
        for n_gen, r in ((4, 1.0), (2, 0.0)):
            m = np.array([0] * prompt + [1] * n_gen, dtype=np.uint8)
            out.append(
                Trajectory(
                    token_ids=np.ones(prompt + n_gen, np.int64),
                    loss_mask=m,
                    behavior_logprobs=np.zeros(prompt + n_gen),
                    policy_version=0,
                    reward=r,
                )
            )
        return out

    cfg = load_config(None, ["train.loss_agg_mode=seq-mean-token-sum-norm", "sampling.max_new_tokens=8"])
    assert cfg.train.loss_scale_norm == 8.0  # default: sampling.max_new_tokens x env.max_turns
    losses = {}
    lc = LossConfig(loss_agg_mode="seq-mean-token-sum-norm", agg_norm=cfg.train.loss_scale_norm)
    for prompt in (2, 12):
        b = collate(rows(prompt), torch.tensor([0.5, -0.5]), 0)
        logp = torch.zeros_like(b.behavior_logprobs)
        losses[prompt], _ = compute_policy_loss(PolicyLossInputs(logp, logp, b.advantages, b.response_mask), lc)
    # ratio 1: token loss -A; sum = 4 * -0.5 + 2 * 0.5 = -1; divided by 8
    assert float(losses[2]) == pytest.approx(-1 / 8) and float(losses[12]) == pytest.approx(-1 / 8)
    with pytest.raises(ValueError, match="needs a constant divisor"):
        LossConfig(loss_agg_mode="seq-mean-token-sum-norm", agg_norm=None)
    assert LossConfig.from_config(cfg.train).agg_norm == 8.0


@pytest.mark.parametrize("name", sorted(OFF_POLICY_CORRECTIONS))
def test_a_masked_minus_infinity_leaves_the_row_finite(name):
    """A padded (masked) position holding -inf (a log-prob of a token never scored) is ignored: row 1's
    padded slot is -inf in the proximal and in the behaviour log-probs; the weights on the mask are those of
    the clean rows (hand-computed above), never NaN (``-inf * 0`` would be)."""
    old = LOG_RHO.clone()
    old[1, 2] = -math.inf
    behav = torch.zeros(2, 3, dtype=torch.float64)
    behav[1, 2] = -math.inf
    cfg = CorrectionConfig(name, 2.5, "truncate", 0.5)
    got = behavior_weights(old, behav, MASK, cfg)
    clean = behavior_weights(LOG_RHO.clone(), torch.zeros(2, 3, dtype=torch.float64), MASK, cfg)
    assert not torch.isnan(got.weight[MASK > 0]).any()
    assert _on(got.weight) == _on(clean.weight)
    if name == "seq_tis":  # row 1: min(2 * 2, 2.5) on each token, as without the -inf
        assert _on(got.weight)[3:] == pytest.approx([2.5, 2.5])


# ---------------------------------------------------------------------------- KL and entropy aggregation
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_the_entropy_term_follows_side_terms_agg(agg):
    """Two rows of 4 and 1 generated tokens with equal rewards (advantages 0: the policy loss is 0), an
    entropy bonus of 1: the step's loss is minus the entropy aggregated over the response tokens, as a token
    mean by default, by ``loss_agg_mode`` with ``side_terms_agg=loss_agg_mode`` (verl), computed here by hand
    from the per-token entropies. The ``entropy`` metric is the token mean either way."""
    model = _tiny_model()
    ids = [np.array([1, 2, 3, 4, 5, 6]), np.array([1, 2, 7])]
    masks = [np.array([0, 0, 1, 1, 1, 1], dtype=np.uint8), np.array([0, 0, 1], dtype=np.uint8)]
    rows = [
        Trajectory(
            token_ids=i,
            loss_mask=m,
            behavior_logprobs=np.zeros(len(i), np.float32),
            policy_version=0,
            reward=1.0,
            group_id="g",
        )
        for i, m in zip(ids, masks)
    ]
    batch = collate(rows, torch.zeros(2), 0)
    with torch.no_grad():
        _, ent = compute_logprobs(model, batch, 1.0, with_entropy=True)
    per_row = [ent[b][batch.response_mask[b] > 0].double() for b in range(2)]  # 4 and 1 values
    token_mean = float(torch.cat(per_row).mean())
    by_hand = {
        "token-mean": token_mean,
        "seq-mean-token-mean": float((per_row[0].mean() + per_row[1].mean()) / 2),
        "seq-mean-token-sum": float((per_row[0].sum() + per_row[1].sum()) / 2),
        "seq-mean-token-sum-norm": float(torch.cat(per_row).sum() / 6.0),
    }  # norm: 6 new tokens x 1 turn
    for side, expected in (("token-mean", token_mean), ("loss_agg_mode", by_hand[agg])):
        cfg = load_config(
            None,
            [
                f"train.loss_agg_mode={agg}",
                f"train.side_terms_agg={side}",
                "train.entropy_coef=1",
                "train.lr=1e-9",
                "sampling.max_new_tokens=6",
                "train.recompute_proximal=false",
            ],
        )
        trainer = PolicyTrainer(_tiny_model(), _Tok(), cfg.train, 1.0, loss_cfg=LossConfig.from_config(cfg.train))
        stats = trainer.step(trainer.make_batch([Episode(trajectories=rows)])).stats
        assert stats["loss"] == pytest.approx(-expected, rel=2e-6), (agg, side)
        assert stats["entropy"] == pytest.approx(token_mean, rel=2e-6)
    if agg != "token-mean":  # the two settings really differ here (by 2e-4 relative for seq-mean-token-mean)
        assert by_hand[agg] != pytest.approx(token_mean, rel=5e-5)
