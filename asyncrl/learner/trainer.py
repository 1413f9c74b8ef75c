"""One optimizer step on a batch of episodes: advantages -> proximal log-probs -> loss -> AdamW.

Decoupled PPO (AReaL): when ``recompute_proximal`` is on, the proximal log-probs are the current
weights' (before the update) and each token is weighted by the detached behaviour weight
``min(exp(logp_prox - logp_behavior), is_cap)``; with no staleness this is exactly PPO.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch

from ..types import Episode, Trajectory
from .batch import TrainBatch, collate, compute_logprobs
from .core_algos import behavior_importance_weight, get_adv_estimator, get_policy_loss, kl_penalty


def trajectory_advantages(trajs: list[Trajectory], adv_cfg) -> torch.Tensor:
    """Scalar advantage per trajectory ``[N]``: the estimator over ``group_id`` groups; a trajectory
    that carries its own (``Trajectory.advantage``, e.g. RLCR) keeps it. ``metadata['adv_scale']``
    scales the result (e.g. the Absolute Zero proposer weight)."""
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    est = get_adv_estimator(adv_cfg.estimator)
    adv = est(rewards, [t.group_id for t in trajs], norm_by_std=adv_cfg.norm_by_std)
    for i, t in enumerate(trajs):
        if t.advantage is not None:
            adv[i] = float(t.advantage)
        scale = t.metadata.get("adv_scale")
        if scale is not None:
            adv[i] = adv[i] * float(scale)
    return adv


class PolicyTrainer:
    def __init__(self, model, tokenizer, train_cfg, temperature: float, replay_cfg=None):
        self.model = model
        self.cfg = train_cfg
        # experience replay (seed 004): off-policy loss settings, and recording of the learner's
        # log-probs and entropy per row for the ExperienceManager (``last_rows`` after a step)
        self.replay_cfg = replay_cfg if replay_cfg is not None and replay_cfg.enabled else None
        self.last_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self.temperature = temperature
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr, betas=tuple(train_cfg.betas),
                                           weight_decay=train_cfg.weight_decay)
        self.policy_loss = get_policy_loss(train_cfg.policy_loss)
        self.ref_model = None
        if train_cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)

    def make_batch(self, episodes: list[Episode]) -> TrainBatch:
        trajs = [t for ep in episodes for t in ep.trajectories]
        adv = trajectory_advantages(trajs, self.cfg.advantage)
        return collate(trajs, adv, self.pad_id, device=self.cfg.device)

    def step(self, batch: TrainBatch, extra_loss_kwargs: dict | None = None) -> dict[str, float]:
        """Train on ``batch`` (ppo_epochs x mini_batches optimizer steps); returns mean stats.
        A mini-batch whose loss or gradient norm is not finite is not applied; ``skipped_nonfinite``
        is the share of such mini-batches."""
        self.model.train()
        single_pass = self.cfg.ppo_epochs == 1 and self.cfg.mini_batches == 1
        record = self.replay_cfg is not None
        self.last_rows = None
        if (self.cfg.recompute_proximal or record) and not single_pass:
            with torch.no_grad():
                logp0, ent0 = compute_logprobs(self.model, batch, self.temperature, with_entropy=record)
            if self.cfg.recompute_proximal:
                batch.old_logprobs = logp0
            if record:
                self.last_rows = (logp0.detach().cpu(), ent0.detach().cpu())
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for _ in range(self.cfg.ppo_epochs):
            for mb in batch.split(self.cfg.mini_batches):
                stats = self._minibatch_step(mb, single_pass, extra_loss_kwargs or {})
                for k, v in stats.items():
                    sums[k] += v
                    counts[k] += 1
        return {k: v / counts[k] for k, v in sums.items()}

    def _minibatch_step(self, mb: TrainBatch, single_pass: bool, extra: dict) -> dict[str, float]:
        cfg = self.cfg
        rp = self.replay_cfg
        want_entropy = cfg.entropy_coef > 0
        # the entropy is always computed for the ``entropy`` metric; a graph only for the bonus
        logp, entropy = compute_logprobs(self.model, mb, self.temperature, with_entropy=True,
                                         entropy_grad=want_entropy)
        if rp is not None and single_pass:  # the weights before this update: the log-prob pass to record
            self.last_rows = (logp.detach().cpu(), entropy.detach().cpu())
        if cfg.recompute_proximal and single_pass:
            mb.old_logprobs = logp.detach()  # the proximal policy is the current one: no extra forward
        weight = None
        if cfg.recompute_proximal:
            weight = behavior_importance_weight(mb.old_logprobs, mb.behavior_logprobs, cfg.is_cap)
        else:
            mb.old_logprobs = mb.behavior_logprobs
        old = mb.old_logprobs
        has_exp = bool(mb.exp_mask.any())
        replay_stats: dict[str, float] = {}
        if has_exp:
            # replayed tokens take the recorded log-probs as their old policy (exp_is_correct), where
            # one was recorded; they carry no staleness weight (their ratio is the off-policy one)
            use_rec = mb.exp_mask * mb.recorded_mask
            if rp is not None and not rp.exp_is_correct:
                use_rec = torch.zeros_like(use_rec)
            m = (use_rec * mb.response_mask).bool()
            if m.any():
                replay_stats["replay/recorded_vs_current_logprob_diff"] = float(
                    (old[m] - mb.recorded_logprobs[m]).abs().mean())
            old = torch.where(use_rec.bool(), mb.recorded_logprobs, old)
            if weight is not None:
                weight = torch.where(mb.exp_mask.bool(), torch.ones_like(weight), weight)
            if rp is not None:
                extra = {**extra, "off_clip_high": rp.off_cliprange_high,
                         "off_policy_reshape": None if rp.off_policy_reshape == "none" else rp.off_policy_reshape}
        loss, stats = self.policy_loss(
            logp, old, mb.advantages, mb.response_mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
            dual_clip_c=cfg.dual_clip_c, loss_agg_mode=cfg.loss_agg_mode, behavior_weight=weight,
            exp_mask=mb.exp_mask if has_exp else None, **extra)
        stats = dict(stats)
        if rp is not None:
            stats = _replay_names(stats)
            stats.update(replay_stats)
            stats.setdefault("replay/off_token_ratio", 0.0)
        if weight is not None:
            m = mb.response_mask.bool()
            w = weight[m]
            if w.numel():
                stats.update(is_weight_mean=w.mean().item(), is_weight_max=w.max().item(),
                             is_weight_capped_frac=(w >= cfg.is_cap).float().mean().item())
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp, _ = compute_logprobs(self.ref_model, mb, self.temperature)
            kl = kl_penalty(logp, ref_logp, cfg.kl_type)
            kl_val = (kl * mb.response_mask).sum() / mb.response_mask.sum().clamp(min=1)
            loss = loss + cfg.kl_coef * kl_val
            stats["kl"] = kl_val.item()
        ent = (entropy * mb.response_mask).sum() / mb.response_mask.sum().clamp(min=1)
        if want_entropy:
            loss = loss - cfg.entropy_coef * ent
        stats["entropy"] = ent.item()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        finite = bool(torch.isfinite(loss.detach()) and torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        else:  # never apply a NaN/inf update: the weights and the optimizer state stay as they were
            self.optimizer.zero_grad(set_to_none=True)
        stats.update(loss=loss.item(), grad_norm=float(grad_norm), skipped_nonfinite=float(not finite))
        return stats


_REPLAY_KEYS = {"on_pg_loss": "replay/on_pg_loss", "off_pg_loss": "replay/off_pg_loss",
                "on_clipfrac": "replay/on_clipfrac", "off_clipfrac": "replay/off_clipfrac",
                "off_token_ratio": "replay/off_token_ratio", "off_ratio_mean": "replay/ratio_mean",
                "off_ratio_min": "replay/ratio_min", "off_ratio_max": "replay/ratio_max"}


def _replay_names(stats: dict[str, float]) -> dict[str, float]:
    """The policy loss's on/off-policy statistics under their ``replay/`` metric names
    (``replay/ratio_*`` is the importance ratio on replayed tokens)."""
    return {_REPLAY_KEYS.get(k, k): v for k, v in stats.items()}
