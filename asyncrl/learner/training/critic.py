"""The learner's critic (``train.advantage.estimator: gae``): values, GAE, and the value model's own step.

Promised here (:class:`asyncrl.learner.training.trainer.PolicyTrainer` holds one when the estimator
is ``gae``):

- The critic (:func:`asyncrl.models.critic.build_critic`) lives on the learner only: actors never
  need it. :meth:`Critic.prepare` runs it, without a graph, over every row of a batch before the
  step, so stale and replayed rows get the current critic's values; it places each row's reward
  (with length shaping) on its last trained token, computes GAE with ``train.advantage.gamma`` and
  ``lam`` for the policy's advantages (whitened over the batch's trained tokens with
  ``train.advantage.norm_by_std``, times the row's ``advantage_scale``) and with ``critic.lam`` for
  the critic's return targets (VAPO's decoupled GAE; the same pass when it is unset).
- In one process with one pass over the batch (``ppo_epochs`` and ``mini_batches`` 1), :meth:`Critic.prepare`
  also takes the critic's step, from the same forward that gives the values: the values before the
  step are that forward's own, so no forward without a graph is run (the same update).
- :meth:`Critic.train_on` takes one optimizer step of the critic on a mini-batch (this rank's rows):
  the clipped value loss (``critic.cliprange_value``) token-mean over the whole mini-batch, in
  micro-batches of the token budget with the gradients accumulated, its own AdamW (``critic.lr``)
  and gradient clipping; a non-finite loss or gradient norm is not applied.
- Under DDP or FSDP2 the critic is wrapped like the policy; every rank computes the values of the
  whole batch (the same numbers), then trains on its rows, with losses scaled as the policy's
  (:func:`asyncrl.learner.training.micro_batches.loss_scales`).
- Metrics (``critic/*``): ``value_loss``, ``clipfrac``, ``grad_norm``, ``explained_variance``
  (of the values before the step against the return targets), ``value_mean``, ``return_mean``,
  ``advantage_raw_mean`` (GAE's before whitening), ``warmup`` (1 while only the critic trains).
"""

from __future__ import annotations

import torch

from ...models.critic import build_critic
from ...objectives.aggregation import masked_mean
from ...objectives.gae import explained_variance, gae, masked_whiten, token_rewards, value_loss
from . import distributed as dist_learner
from .batch import TrainBatch, put_rows, shared_width, value_rows
from .micro_batches import loss_scales, plan_micro_batches
from .optim import adamw, apply_update

__all__ = ["Critic"]


class Critic:
    """The value model, its optimizer and its settings (``cfg.critic``, ``cfg.train.advantage``)."""

    def __init__(self, policy, critic_cfg, train_cfg, model_cfg, seed: int, distributed: str = "none"):
        self.cfg, self.adv = critic_cfg, train_cfg.advantage
        self.distributed = distributed
        self.micro_tokens = train_cfg.micro_batch_tokens
        self.attention = "mask" if train_cfg.packing else "padded"  # the policy's path (the trainer sets it)
        self.shared_prefix = train_cfg.packing and train_cfg.shared_prefix  # a prompt read once per bin, as the policy
        self.return_lam = critic_cfg.lam if critic_cfg.lam is not None else self.adv.lam
        critic = build_critic(policy, critic_cfg, model_cfg, seed, device=train_cfg.device)
        self.model = dist_learner.wrap(critic, distributed)
        opt_cfg = train_cfg.model_copy(
            update={"lr": critic_cfg.lr or train_cfg.lr, "weight_decay": critic_cfg.weight_decay}
        )
        self.optimizer = adamw(
            [p for p in self.model.parameters() if p.requires_grad], opt_cfg, fused=distributed != "fsdp2"
        )

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T-1]`` the critic's values on every row, in micro-batches of the token budget."""
        out = torch.zeros(batch.response_mask.shape, device=batch.response_mask.device)
        for index in plan_micro_batches(batch, self.micro_tokens, self.attention != "padded", skip=False).micro_batches:
            put_rows(out, index, self._values(batch.take(index)))
        return out

    def _targets(self, micro: TrainBatch, values: torch.Tensor) -> None:
        """``micro``'s ``old_values`` and ``returns`` (GAE per row with ``critic.lam``) from ``values``."""
        mask = micro.response_mask
        micro.old_values = values * mask
        _, micro.returns = gae(
            token_rewards(micro.rewards, mask), micro.old_values, mask, self.adv.gamma, self.return_lam
        )

    def _values(self, micro: TrainBatch) -> torch.Tensor:
        width = shared_width(micro, self.micro_tokens) if self.shared_prefix and self.attention == "mask" else None
        return value_rows(self.model, micro, self.attention, self.shared_prefix, width)

    def prepare(self, batch: TrainBatch, train: bool = False) -> dict[str, float]:
        """Fill in ``batch``'s ``old_values``, ``returns``, per-token ``advantages`` and ``row_advantages``
        (each row's mean over its trained tokens). On entry ``batch.advantages`` holds each row's
        ``advantage_scale`` on its trained tokens and ``batch.rewards`` the shaped rewards.

        ``train`` (one process, one pass over the batch): also take the critic's step on the whole
        batch, from the same forward: the values before the step are that forward's own, so the
        forward without a graph is not needed (the same update as :meth:`train_on` after it)."""
        mask = batch.response_mask
        stats: dict[str, float] = {}
        if train:
            values = torch.zeros(mask.shape, device=mask.device)
            stats = self.train_on(batch, values_out=values)
        else:
            values = self.values(batch)
        values = values * mask
        rewards = token_rewards(batch.rewards, mask)
        adv, returns = gae(rewards, values, mask, self.adv.gamma, self.adv.lam)
        if self.return_lam != self.adv.lam:
            _, returns = gae(rewards, values, mask, self.adv.gamma, self.return_lam)
        raw_mean = float(masked_mean(adv, mask))
        if self.adv.norm_by_std:
            adv = masked_whiten(adv, mask)
        batch.advantages = adv * batch.advantages * mask  # (the scale, on trained tokens)
        batch.old_values, batch.returns = values, returns
        n = mask.sum(1)
        batch.row_advantages = torch.where(n > 0, batch.advantages.sum(1) / n.clamp(min=1), 0.0)
        return {
            **stats,
            "critic/value_mean": float(masked_mean(values, mask)),
            "critic/return_mean": float(masked_mean(returns, mask)),
            "critic/explained_variance": explained_variance(values, returns, mask),
            "critic/advantage_raw_mean": raw_mean,
        }

    def train_on(self, mb: TrainBatch, values_out: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step of the critic on mini-batch ``mb`` (this rank's rows). ``values_out``
        (:meth:`prepare` with ``train``): ``mb`` has no targets yet; each micro-batch's forward gives
        its values before the step (written there) and its rows' return targets."""
        plan = plan_micro_batches(mb, self.micro_tokens, self.attention != "padded", skip=False)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, clip_sum, tokens = 0.0, 0.0, 0.0
        for part in dist_learner.accumulate(self.model, mb, plan):
            micro = part.batch
            v = self._values(micro)
            if values_out is not None:  # (one process only: every part is real)
                self._targets(micro, v.detach())
                put_rows(values_out, part.index, micro.old_values)
            loss, clipfrac = value_loss(
                v, micro.returns, micro.old_values, micro.response_mask, self.cfg.cliprange_value
            )
            scale, _ = loss_scales(micro.response_mask, "token-mean", part.totals)
            (loss * (scale if part.real else 0.0)).backward()
            if part.real:
                n = float(micro.response_mask.sum())
                loss_sum += float(loss.detach()) * scale
                clip_sum, tokens = clip_sum + float(clipfrac) * n, tokens + n
        update = apply_update(self.optimizer, loss_sum, self.cfg.max_grad_norm, self.distributed)
        stats = {
            "critic/value_loss": loss_sum,
            "critic/clipfrac": clip_sum / tokens if tokens else 0.0,
            "critic/grad_norm": update["grad_norm"],
            "critic/skipped_nonfinite": update["skipped_nonfinite"],
        }
        if self.distributed != "none":
            stats = dist_learner.reduce_stats(
                stats, float(mb.response_mask.sum()), mean_keys=frozenset({"critic/value_loss"})
            )
        return stats
