"""Issue 46: PPO with a critic. GAE against hand-computed values and verl's recursion, the clipped value
loss, explained variance; the critic on the learner (a real forward of the tiny model): its values in
the packed and padded layouts, its warm-up, and its checkpoint restoring weights and optimizer state
exactly."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.objectives.gae import explained_variance, gae, masked_whiten, token_rewards, value_loss


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """verl's ``compute_gae_advantage_return`` recursion (its semantics, written out here as the
    reference): the next value and advantage carried through masked positions; not whitened."""
    nextvalues, lastgaelam, out = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def test_gae_single_turn_by_hand():
    v = torch.tensor([[0.0, 0.5, 0.6, 0.7, 0.0]])
    m = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])  # a prompt position, three generated tokens, padding
    r = token_rewards(torch.tensor([1.0]), m)
    assert r.tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0]]
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)  # R - V(s_t)
    assert adv[0].tolist() == pytest.approx([0.0, 0.5, 0.4, 0.3, 0.0])
    assert ret[0].tolist() == pytest.approx([0.0, 1.0, 1.0, 1.0, 0.0])
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.5)
    d3 = 1.0 - 0.7  # the last token: no next value
    d2 = 0.9 * 0.7 - 0.6
    d1 = 0.9 * 0.6 - 0.5
    a3 = d3
    a2 = d2 + 0.45 * a3
    a1 = d1 + 0.45 * a2
    assert adv[0].tolist() == pytest.approx([0.0, a1, a2, a3, 0.0])
    assert ret[0].tolist() == pytest.approx([0.0, a1 + 0.5, a2 + 0.6, a3 + 0.7, 0.0])


def test_gae_lambda_and_gamma_edges():
    v = torch.tensor([[0.2, 0.4, 0.8]])
    m = torch.ones(1, 3)
    r = torch.tensor([[0.1, 0.0, 1.0]])
    adv, _ = gae(r, v, m, gamma=0.9, lam=0.0)  # the one-step TD error
    assert adv[0].tolist() == pytest.approx([0.1 + 0.9 * 0.4 - 0.2, 0.9 * 0.8 - 0.4, 1.0 - 0.8])
    adv, _ = gae(r, v, m, gamma=0.0, lam=0.7)  # no future at all: r_t - V(s_t)
    assert adv[0].tolist() == pytest.approx([0.1 - 0.2, -0.4, 1.0 - 0.8])
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)  # Monte Carlo: the return to go minus the value
    assert adv[0].tolist() == pytest.approx([1.1 - 0.2, 1.0 - 0.4, 1.0 - 0.8])
    assert ret[0].tolist() == pytest.approx([1.1, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"gamma=1.5 and lam=0.5 must lie in \[0, 1\]"):
        gae(r, v, m, gamma=1.5, lam=0.5)


def test_gae_skips_environment_tokens_between_turns():
    # two assistant turns with an environment reply between them (mask 0 there): its positions add no TD
    # error and the chain runs across them, as if they were not there
    v = torch.tensor([[0.0, 0.3, 0.5, 9.0, 9.0, 0.6, 0.2, 0.0]])
    m = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    r = token_rewards(torch.tensor([1.0]), m)
    adv, ret = gae(r, v, m, gamma=0.95, lam=0.9)
    compact_v = torch.tensor([[0.3, 0.5, 0.6, 0.2]])
    compact, compact_ret = gae(torch.tensor([[0.0, 0.0, 0.0, 1.0]]), compact_v, torch.ones(1, 4), 0.95, 0.9)
    on = m[0] > 0
    assert adv[0, on].tolist() == pytest.approx(compact[0].tolist())
    assert ret[0, on].tolist() == pytest.approx(compact_ret[0].tolist())
    assert adv[0, ~on].abs().max() == 0 and ret[0, ~on].abs().max() == 0


def test_rows_of_different_lengths_are_each_their_own():
    g = torch.Generator().manual_seed(0)
    v = torch.rand(3, 9, generator=g)
    m = torch.zeros(3, 9)
    m[0, 2:9] = 1
    m[1, 4:6] = 1
    m[2, 1:4] = 1
    r = token_rewards(torch.tensor([1.0, -0.5, 0.0]), m)
    adv, ret = gae(r, v, m, 0.97, 0.8)
    for b in range(3):
        alone, alone_ret = gae(r[b : b + 1], v[b : b + 1], m[b : b + 1], 0.97, 0.8)
        assert torch.allclose(adv[b], alone[0]) and torch.allclose(ret[b], alone_ret[0])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 1.0), (1.0, 0.5)])
def test_gae_equals_verls_recursion(gamma, lam):
    g = torch.Generator().manual_seed(3)
    B, T = 6, 17
    v = torch.randn(B, T, generator=g)
    m = (torch.rand(B, T, generator=g) > 0.3).float()
    m[:, :2] = 0  # prompts
    m[0, 9:] = 0  # a short row (padding after it)
    m[5] = 0  # a row with no trained token
    r = token_rewards(torch.randn(B, generator=g), m) + 0.1 * torch.randn(B, T, generator=g) * m  # per-token too
    adv, ret = gae(r, v, m, gamma, lam)
    ref_adv, ref_ret = verl_gae(r, v, m, gamma, lam)
    # on trained tokens the same; elsewhere verl leaves carried values, which its mask ignores and this zeroes
    assert torch.allclose(adv * m, ref_adv * m, atol=1e-5) and torch.allclose(ret * m, ref_ret * m, atol=1e-5)
    assert float((adv * (1 - m)).abs().max()) == 0.0
    # and whitened as verl's masked_whiten: mean 0 and unbiased variance 1 over the trained tokens
    w = masked_whiten(adv, m)[m > 0].double()
    n = w.numel()
    assert abs(float(w.mean())) < 1e-6 and float(((w - w.mean()) ** 2).sum() / (n - 1)) == pytest.approx(1.0, abs=1e-5)


def test_value_loss_with_and_without_clipping_by_hand():
    v = torch.tensor([[1.0, 0.0, 2.0]])
    old = torch.tensor([[0.5, 0.5, 1.9]])
    ret = torch.tensor([[2.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is not trained
    loss, frac = value_loss(v, ret, old, m, cliprange=None)
    assert float(loss) == pytest.approx(0.5 * (1.0 + 0.0) / 2) and float(frac) == 0
    loss, frac = value_loss(v, ret, old, m, cliprange=0.2)
    # token 1: V clipped to 0.7, (0.7 - 2)^2 = 1.69 > (1 - 2)^2 = 1 -> 1.69; token 2: clipped to 0.3, 0.09 > 0 -> 0.09
    assert float(loss) == pytest.approx(0.5 * (1.69 + 0.09) / 2) and float(frac) == pytest.approx(1.0)
    loss, frac = value_loss(v, ret, old, m, cliprange=1.0)  # within the range: unclipped
    assert float(loss) == pytest.approx(0.25) and float(frac) == 0
    v = v.clone().requires_grad_(True)
    loss, _ = value_loss(v, ret, old, m, cliprange=0.2)
    loss.backward()  # both tokens' clipped terms win: their value moved too far, no gradient through V
    assert v.grad.abs().max() == 0


def test_explained_variance_by_hand():
    m = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    ret = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]])
    assert explained_variance(ret, ret, m) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(ret, 2.5), ret, m) == pytest.approx(0.0)
    v = torch.tensor([[1.5, 1.5, 3.5, 3.5, 0.0]])
    assert explained_variance(v, ret, m) == pytest.approx(1 - 0.25 / 1.25)
    assert math.isnan(explained_variance(v, torch.ones_like(ret), m))


def test_gae_is_refused_where_it_has_no_meaning():
    from asyncrl.config import ConfigError, load_config
    from asyncrl.objectives.advantages import ADV_ESTIMATORS

    with pytest.raises(ConfigError, match="RLCR's rows carry advantages of their tree's two levels"):
        load_config(None, ["algorithm=rlcr", "train.advantage.estimator=gae"])
    with pytest.raises(ValueError, match="computed per token by the learner's critic"):
        ADV_ESTIMATORS.get("gae")(torch.ones(2), ["a", "a"])
    with pytest.raises(ConfigError, match="cliprange_value"):
        load_config(None, ["train.advantage.estimator=gae", "critic.cliprange_value=-1"])


# -- the critic on the learner ----------------------------------------------------------------------


def _trainer(tiny_overrides, *extra):
    from asyncrl.config import load_config
    from asyncrl.learner.training.trainer import PolicyTrainer
    from asyncrl.models.loading import load_policy

    cfg = load_config(
        None, [*tiny_overrides, "train.advantage.estimator=gae", "critic.lr=1e-3", "train.lr=1e-3", *extra]
    )
    torch.manual_seed(0)
    model, tok, _ = load_policy(cfg.model, cfg.seed)
    if cfg.model.lora is not None:
        from asyncrl.models.lora import with_adapters

        model = with_adapters(model, cfg.model, cfg.seed)
    return PolicyTrainer(model, tok, cfg.train, 1.0, critic_cfg=cfg.critic, model_cfg=cfg.model), tok


def _batch(trainer, tok, shared_prompts=False):
    from tests.support.dist_step_worker import trajectories

    rows = trajectories(len(tok), shared_prompts=shared_prompts)
    return trainer.make_batch([type("E", (), {"trajectories": rows})()])


def test_the_critic_values_are_the_same_packed_and_padded_and_zero_at_the_start(tiny_overrides):
    from asyncrl.learner.training.batch import shared_width, value_rows

    trainer, tok = _trainer(tiny_overrides)
    batch = _batch(trainer, tok, shared_prompts=True)  # each group's rows start with the same prompt
    assert float(trainer.critic.values(batch).abs().max()) == 0.0  # the head starts at zero
    with torch.no_grad():
        for p in trainer.critic.model.lm_head.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
        padded = value_rows(trainer.critic.model, batch, packing=False)
        packed = value_rows(trainer.critic.model, batch, packing=True)
        shared = value_rows(
            trainer.critic.model, batch, packing=True, shared_prefix=True, width=shared_width(batch, 4096)
        )  # a prompt read once per bin
        used = trainer.critic.values(batch)  # the learner's: shared prompts, micro-batches of the budget
    valid = batch.attention_mask[:, 1:].float()
    assert float(padded.abs().max()) > 0.01
    for other in (packed, shared, used):
        assert torch.allclose(padded * valid, other * valid, atol=1e-5)
    # the critic is the policy's body: the same hidden states under a different head
    assert trainer.critic.model.lm_head.out_features == 1 and trainer.critic.model.config.tie_word_embeddings is False


def test_warmup_trains_the_critic_alone_then_both(tiny_overrides):
    trainer, tok = _trainer(tiny_overrides, "critic.warmup_steps=1")
    policy0 = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    critic0 = {k: v.clone() for k, v in trainer.critic.model.state_dict().items()}
    stats = trainer.step(_batch(trainer, tok), version=0).stats
    assert stats["critic/warmup"] == 1.0 and stats["critic/value_loss"] > 0
    assert all(torch.equal(v, policy0[k]) for k, v in trainer.model.state_dict().items())
    assert any(not torch.equal(v, critic0[k]) for k, v in trainer.critic.model.state_dict().items())
    stats = trainer.step(_batch(trainer, tok), version=1).stats
    assert stats["critic/warmup"] == 0.0
    assert any(not torch.equal(v, policy0[k]) for k, v in trainer.model.state_dict().items())


@pytest.mark.parametrize("lora", [False, True])
def test_a_critic_checkpoint_restores_weights_and_optimizer_exactly(tiny_overrides, tmp_path, lora):
    from asyncrl.learner.checkpoint import read_critic, write_critic
    from asyncrl.learner.training.ranks import critic_states, load_critic

    extra = ["model.lora.rank=4"] if lora else []
    a, tok = _trainer(tiny_overrides, *extra)
    for version in range(2):
        a.step(_batch(a, tok), version=version)
    write_critic(tmp_path, critic_states(a))
    saved = read_critic(tmp_path, a.critic.model)
    trained = {n for n, p in a.critic.model.named_parameters() if p.requires_grad}
    assert set(saved[0]) == trained and "lm_head.weight" in {n.split("base_model.model.")[-1] for n in trained}
    if lora:  # the adapters and the head only: the frozen base is the policy's
        assert all("lora_" in n or "lm_head" in n for n in trained), sorted(trained)[:5]
    b, _ = _trainer(tiny_overrides, *extra)
    load_critic(b, saved)
    for (n, p), (_, q) in zip(a.critic.model.named_parameters(), b.critic.model.named_parameters()):
        assert torch.equal(p, q), n
    sa, sb = a.critic.optimizer.state_dict(), b.critic.optimizer.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for i, entry in sa["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][i][key])), (i, key)
    # and the next step is the same (b's policy is reset to a's so that both see the same batch's advantages)
    b.model.load_state_dict(a.model.state_dict())
    b.optimizer.load_state_dict(a.optimizer.state_dict())
    a.step(_batch(a, tok), version=2)
    b.step(_batch(b, tok), version=2)
    for (n, p), (_, q) in zip(a.critic.model.named_parameters(), b.critic.model.named_parameters()):
        assert torch.equal(p, q), n
    # a checkpoint written by another critic is refused, naming the file
    from asyncrl.rundir.layout import CheckpointError

    other, _ = _trainer(tiny_overrides, *([] if lora else ["model.lora.rank=4"]))
    with pytest.raises(CheckpointError, match="critic/model.safetensors does not match this run's critic"):
        read_critic(tmp_path, other.critic.model)


def test_the_one_pass_critic_step_equals_values_then_a_step(tiny_overrides):
    """One process, one pass over the batch: the critic steps inside ``prepare`` from the forward that
    gives its values (no forward without a graph first); the same update, targets and advantages as
    computing the values first and stepping after."""
    a, tok = _trainer(tiny_overrides, "critic.lam=0.9", "train.advantage.lam=0.7", "train.advantage.gamma=0.95")
    b, _ = _trainer(tiny_overrides, "critic.lam=0.9", "train.advantage.lam=0.7", "train.advantage.gamma=0.95")
    with torch.no_grad():
        for critic in (a.critic, b.critic):
            for p in critic.model.lm_head.parameters():
                p.copy_(torch.linspace(-0.5, 0.5, p.numel()).reshape(p.shape))
    ba, bb = _batch(a, tok), _batch(b, tok)
    fused = a.critic.prepare(ba, train=True)
    b.critic.prepare(bb)
    apart = b.critic.train_on(bb)
    for key in ("advantages", "returns", "old_values", "row_advantages"):
        assert torch.allclose(getattr(ba, key), getattr(bb, key), atol=1e-6), key
    assert fused["critic/value_loss"] == pytest.approx(apart["critic/value_loss"], rel=1e-6)
    for (n, p), (_, q) in zip(a.critic.model.named_parameters(), b.critic.model.named_parameters()):
        assert torch.allclose(p, q, atol=1e-7), n
    assert fused["critic/grad_norm"] > 0
