"""One optimizer step on a batch of episodes: advantages -> proximal log-probs -> loss -> AdamW.

Decoupled PPO (AReaL): when ``recompute_proximal`` is on, the proximal log-probs are the current
weights' (before the update) and each token is weighted by the detached behaviour weight of the
chosen off-policy correction (``train.off_policy_correction``; by default
``min(exp(logp_prox - logp_behavior), is_cap)``); with no staleness this is exactly PPO.

Over several processes (``distributed='ddp'`` or ``'fsdp2'``, issue 15) every rank is given the same
collated batch, takes its rows of each mini-batch (:func:`distributed.shard_rows`) and scales its
losses (:func:`micro_batches.loss_scales` with :func:`distributed.step_totals`) so that the gradient
averaged over ranks is the one-process gradient of the whole mini-batch; metrics are combined over
ranks (:func:`distributed.reduce_stats`).

Each mini-batch goes through the model in micro-batches of at most ``train.micro_batch_tokens``
tokens, packed without padding (``train.packing``, :mod:`.packing`), the rows that carry no
gradient left out (``train.skip_zero_advantage``), the gradients accumulated and the loss
normalised over the whole mini-batch (:mod:`.micro_batches`): one optimizer step per mini-batch, the
same update as one padded pass over all its rows.

With ``train.advantage.estimator: gae`` the trainer holds a critic (:mod:`.critic`): at the start of
each step it computes every row's values and puts GAE's per-token advantages into the batch, and
each mini-batch's policy step is followed by the critic's own (``critic.warmup_steps``: the critic's
alone).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from ...config import ConfigError, CriticConfig, ModelConfig
from ...objectives.advantages import ADV_ESTIMATORS, discounted_reinforce_pp, per_token, trajectory_advantages
from ...objectives.aggregation import agg_loss, masked_mean
from ...objectives.corrections import CorrectionConfig, behavior_weights
from ...objectives.logprobs import kl_penalty
from ...objectives.losses import POLICY_LOSSES, LossConfig, PolicyLossInputs
from ...objectives.shaping import LengthShaping
from ...types import Episode
from ..ingest.staleness import StalenessPolicy
from . import distributed as dist_learner
from .attention import choose as choose_attention
from .attention import measure as measure_attention
from .batch import Forward, TrainBatch, collate, forward_rows, put_rows, replayed_share, shared_width
from .critic import Critic
from .distill import Distiller
from .micro_batches import Totals, combine_stats, loss_scales, plan_micro_batches
from .optim import adamw, apply_update, lr_at


class StepAbandoned(Exception):
    """A stop was asked for in the middle of a step, before any of its updates was applied: the step is
    given up (the model and optimizer are as they were before it), so that a stop never waits for a
    long step to finish (:attr:`PolicyTrainer.should_stop`)."""


@dataclass
class TrainStepResult:
    """One training step: mean statistics over its mini-batches, and (when asked for) the
    learner's per-row log-probs and entropies under the weights before the update, ``[B, T-1]`` on
    the CPU, rows in batch order (what experience replay records)."""

    stats: dict[str, float]
    row_logprobs: torch.Tensor | None = None
    row_entropy: torch.Tensor | None = None


def _checkpoint_layers(model) -> None:
    """train.gradient_checkpointing: transformers' non-reentrant checkpointing of each decoder layer."""
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise ConfigError(f"train.gradient_checkpointing: {type(model).__name__} has no gradient checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class PolicyTrainer:
    """One optimizer step on a batch: proximal log-probs, the registered policy loss (``train.policy_loss``
    with :class:`LossConfig`), KL and entropy terms, AdamW. Rows carrying recorded log-probs on
    their ``exp_mask`` tokens use them as the old policy when ``use_recorded_logprobs``.

    ``distributed``: 'none' (one process), or 'ddp' / 'fsdp2' under a process group already joined
    (:func:`distributed.init_from_env`); ``model`` is then wrapped here (FSDP2 shards it in place) and
    ``self.model`` is the wrapped model: read full weights with :func:`distributed.full_state_dict`."""

    def __init__(
        self,
        model,
        tokenizer,
        train_cfg,
        temperature: float,
        loss_cfg: LossConfig | None = None,
        use_recorded_logprobs: bool = True,
        distributed: str = "none",
        staleness: StalenessPolicy | None = None,
        critic_cfg=None,
        model_cfg=None,
        seed: int = 0,
    ):
        if distributed != "none" and not dist_learner.active():
            raise RuntimeError(
                f"PolicyTrainer: distributed={distributed!r} needs a process group of more than "
                "one rank; call asyncrl.learner.training.distributed.init_from_env first, or use 'none'"
            )
        self.distributed = distributed
        self.model = model
        self.cfg = train_cfg
        self.loss_cfg = loss_cfg or LossConfig.from_config(train_cfg)
        self.correction = CorrectionConfig.from_config(train_cfg)
        self.use_recorded = use_recorded_logprobs
        self.temperature = temperature
        self.staleness = staleness  # for staleness/token_frac_past_bound (None: not reported)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.policy_loss = POLICY_LOSSES.resolve(train_cfg.policy_loss, "train.policy_loss", what="function")
        self.estimator = ADV_ESTIMATORS.get(train_cfg.advantage.estimator)
        self.ref_model = None
        # model.lora: the reference is the base model, i.e. the policy with its adapters disabled (no copy)
        self.ref_is_base = train_cfg.kl_coef > 0 and hasattr(model, "disable_adapter")
        if train_cfg.kl_coef > 0 and not self.ref_is_base:  # a full copy on every rank, taken before any sharding
            self.ref_model = copy.deepcopy(model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self._hold_policy = False  # this step trains the critic only (critic.warmup_steps)
        self._critic_fused = False  # this step's critic stepped in Critic.prepare
        self.critic: Critic | None = None  # estimator gae: the value model, copied before any sharding
        if per_token(self.estimator):
            self.critic = Critic(
                model, critic_cfg or CriticConfig(), train_cfg, model_cfg or ModelConfig(), seed, distributed
            )
        if train_cfg.gradient_checkpointing:  # (before any wrapping: transformers' own switch on the model)
            _checkpoint_layers(model)
        self.model = dist_learner.wrap(model, distributed)  # the optimizer must see the sharded parameters
        # the forward's layout (batch.forward_rows): packed, a prompt once per bin, in a learner group
        # too (each rank over its own rows); micro-batches of a token budget; rows with no gradient left out
        self.packing, self.shared_prefix = train_cfg.packing, train_cfg.shared_prefix
        # train.attention (.attention): the packed forward's attention; None until measured (auto on CUDA)
        self.attention, self._attention_candidates = self._choose_attention()
        self.packing = self.attention != "padded"
        if self.critic is not None:
            self.critic.attention = self.attention or self._attention_candidates[0]
        self.micro_tokens = train_cfg.micro_batch_tokens
        self.shaping = LengthShaping.from_config(train_cfg)
        self.shaping_stats: dict[str, float] = {}  # the last batch's (make_batch; distillation's too)
        self.distiller = Distiller(train_cfg.distill, model) if train_cfg.distill.teacher else None
        self.side_terms = train_cfg.kl_coef > 0 or train_cfg.entropy_coef > 0  # they read every row
        # only what trains (model.lora: the adapters) is in the optimizer, so it holds state for nothing else
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = adamw(trainable, train_cfg, fused=distributed != "fsdp2")
        # ``should_stop() -> bool``: asked before every micro-batch of a step; True before any of the step's
        # updates is applied gives the step up (StepAbandoned). One process only: a group's ranks run
        # their collectives in step, so a group always finishes its step.
        self.should_stop = None
        self.tick = None  # called before every micro-batch too: the learner answers its actors during a long step
        self._applied = False  # an update of the step in progress was applied (it can no longer be given up)
        self.micro_s = 0.0  # the longest micro-batch of the last step (seconds): how long a stop may wait

    def _choose_attention(self) -> tuple[str | None, list[str]]:
        """:func:`.attention.choose` for this trainer's model and settings; a path that cannot run is a
        ConfigError (one line)."""
        cfg = self.cfg
        try:
            return choose_attention(
                cfg.attention,
                cfg.packing,
                dist_learner.unwrap(self.model),
                cfg.device,
                deterministic=cfg.deterministic or self.distributed != "none",
                recompute=cfg.gradient_checkpointing,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _check_stop(self) -> None:
        if self.tick is not None:
            self.tick()
        if self.should_stop is not None and self.distributed == "none" and not self._applied and self.should_stop():
            raise StepAbandoned(
                f"the step was given up before its {'first ' if self.cfg.mini_batches > 1 else ''}"
                f"update (a stop was asked for)"
            )

    @property
    def critic_model(self) -> torch.nn.Module | None:
        """The critic's (wrapped) model, or None without one."""
        return self.critic.model if self.critic is not None else None

    def make_batch(self, episodes: list[Episode]) -> TrainBatch:
        """The episodes' trajectories collated with their advantages (length shaping applied)."""
        trajs = [t for ep in episodes for t in ep.trajectories]
        penalties = self.shaping.penalties(trajs) if self.shaping.buffer else None  # (off: not on the path)
        adv = trajectory_advantages(trajs, self.cfg.advantage, self.estimator, shaping=penalties)
        batch = collate(trajs, adv, self.pad_id, device=self.cfg.device)
        if penalties is not None:  # (GAE reads the shaped reward; the other estimators have applied it)
            batch.rewards = batch.rewards + penalties.to(batch.rewards)
        if self.cfg.advantage.estimator == "reinforce_pp" and self.cfg.advantage.gamma < 1.0:
            self._discount(batch, trajs, penalties)
        dropped = self.shaping.dropped_rows(trajs) if self.shaping.mask_truncated else []
        if dropped:  # overlong filtering: out of the loss and its normaliser
            batch.response_mask[dropped] = 0.0
            batch.advantages[dropped] = 0.0
        self.shaping_stats = {}
        if penalties is not None:
            self.shaping_stats["overlong/penalty_mean"] = float(penalties.mean())
        if self.shaping.mask_truncated:
            self.shaping_stats["overlong/truncated_share"] = len(dropped) / max(len(trajs), 1)
        if batch.routing is not None:  # routing replay (model.routing_replay): how much of the batch replays
            self.shaping_stats["routing/replayed_share"] = replayed_share(batch)
        if self.distiller is not None:  # the teacher's per-token advantage on the tokens about to be trained
            self.shaping_stats.update(self.distiller.apply(self, batch))
        return batch

    def _discount(self, batch: TrainBatch, trajs: list, penalties) -> None:
        """REINFORCE++ with ``train.advantage.gamma < 1``: per-token discounted returns, whitened over
        the batch (:func:`discounted_reinforce_pp`), times each row's ``advantage_scale``; a row that
        carries its own advantage keeps it."""
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
        if penalties is not None:
            rewards = rewards + penalties.to(torch.float64).cpu()
        own = torch.tensor([t.advantage is not None for t in trajs])
        scale = torch.tensor([t.advantage_scale for t in trajs], dtype=torch.float32)
        gamma, norm = self.cfg.advantage.gamma, self.cfg.advantage.norm_by_std
        per_token = discounted_reinforce_pp(rewards[~own], batch.response_mask.cpu()[~own], gamma, norm)
        batch.advantages[(~own).to(batch.advantages.device)] = (per_token * scale[~own, None]).to(batch.advantages)

    def step(self, batch: TrainBatch, keep_rows: bool = False, version: int | None = None) -> TrainStepResult:
        """Train on ``batch``: ``ppo_epochs`` x ``mini_batches`` optimizer steps, each over micro-batches
        of the token budget with the gradients accumulated. A mini-batch whose loss or gradient norm
        is not finite is not applied (``skipped_nonfinite``: the share of such mini-batches).
        ``keep_rows``: also return the per-row log-probs and entropies. ``version``: the learner's
        policy version, for the learning-rate schedule, the train/inference mismatch
        (:func:`mismatch_stats`) and the per-token version lag (:func:`token_lag_stats`).

        The learner's step, top to bottom in one place (a spine the architecture test lets run past
        sixty lines): the critic, the proximal pass, then each mini-batch's micro-batches, update and
        statistics."""
        cfg = self.cfg
        self.model.train()
        single_pass = cfg.ppo_epochs == 1 and cfg.mini_batches == 1
        result = TrainStepResult({})
        self._hold_policy, self._applied, self.micro_s = False, False, 0.0
        lr = lr_at(cfg, version or 0)
        for group in self.optimizer.param_groups:  # (train.lr_schedule: a function of the version alone)
            group["lr"] = lr
        self._check_stop()

        # 1. the critic (estimator gae): per-token advantages and its targets from its current values;
        # in one process with one pass it also steps, on the whole batch, in the forward that gives them
        critic_stats: dict[str, float] = {}
        self._critic_fused = single_pass and self.distributed == "none"
        if self.critic is not None:
            critic_stats = self.critic.prepare(batch, train=self._critic_fused)
            self._applied = self._critic_fused  # (the critic's update is in)
            self._hold_policy = version is not None and version < self.critic.cfg.warmup_steps
            critic_stats["critic/warmup"] = float(self._hold_policy)

        # 2. more than one pass: the proximal policy (decoupled PPO) and the rows' log-probs, from the
        # weights before any update (one pass: the forward below is that policy)
        if (cfg.recompute_proximal or keep_rows) and not single_pass:
            with torch.no_grad():
                logp0, ent0 = self._chunked_logprobs(
                    self.model, batch, with_entropy=keep_rows, skip=not keep_rows and self._may_skip()
                )
            if cfg.recompute_proximal:
                batch.old_logprobs = logp0
            if keep_rows:
                result.row_logprobs, result.row_entropy = logp0.detach().cpu(), ent0.detach().cpu()

        # 3. the optimizer steps: one per mini-batch (this rank's rows of it)
        per_minibatch: list[dict[str, float]] = []
        for epoch in range(cfg.ppo_epochs):
            for i, mb in enumerate(batch.split(cfg.mini_batches)):
                if self.distributed != "none":
                    mb = mb.select(
                        dist_learner.shard_rows(
                            mb.batch_size, torch.distributed.get_rank(), torch.distributed.get_world_size()
                        )
                    )
                measured = version if epoch == 0 and i == 0 else None  # (the mismatch: the first mini-batch's)
                rows = keep_rows and single_pass  # this pass gives the rows' log-probs (every row is run)
                plan = plan_micro_batches(mb, self.micro_tokens, self.packing, skip=not rows and self._may_skip())
                if rows:
                    result.row_logprobs = torch.zeros(mb.response_mask.shape, device="cpu")
                    result.row_entropy = torch.zeros(mb.response_mask.shape, device="cpu")
                if self.attention is None and plan.micro_batches:  # train.attention=auto on CUDA
                    self._measure_attention(mb.take(plan.micro_batches[0]))
                self.optimizer.zero_grad(set_to_none=True)
                parts, slots, real_tokens, shared = [], 0, 0, 0
                loss_sum, started = 0.0, time.perf_counter()
                for part in dist_learner.accumulate(self.model, mb, plan):
                    self._check_stop()
                    t_micro = time.perf_counter()
                    out, loss, stats = self._loss(part.batch, part.totals, single_pass, measured if part.real else None)
                    (loss if part.real else loss * 0.0).backward()
                    self.micro_s = max(self.micro_s, time.perf_counter() - t_micro)
                    if not part.real:
                        continue
                    loss_sum += float(loss.detach())
                    parts.append((stats, float(part.batch.response_mask.sum())))
                    slots, real_tokens, shared = (
                        slots + out.slots,
                        real_tokens + out.real_tokens,
                        shared + out.shared_rows,
                    )
                    if rows:
                        put_rows(result.row_logprobs, part.index, out.logprobs.detach().cpu())
                        put_rows(result.row_entropy, part.index, out.entropy.detach().cpu())
                elapsed = time.perf_counter() - started
                stats = combine_stats(parts) if parts else {"loss": 0.0, "pg_loss": 0.0}
                stats.update(
                    apply_update(
                        self.optimizer, loss_sum, cfg.max_grad_norm, self.distributed, apply=not self._hold_policy
                    )
                )
                self._applied = True
                stats.update(
                    {
                        "learner/rows_skipped": float(len(plan.skipped)),
                        "learner/micro_batches": float(len(plan.micro_batches)),
                        "learner/forward_tokens": float(real_tokens),
                        "learner/shared_prompt_rows": float(shared),
                        "learner/padding_share": 1.0 - real_tokens / slots if slots else 0.0,
                        "learner/tokens_per_s": real_tokens / elapsed if elapsed > 0 and real_tokens else 0.0,
                    }
                )
                if self.distributed != "none":  # a scaled loss averages to the global one over ranks
                    stats = dist_learner.reduce_stats(
                        stats, float(mb.response_mask.sum()), mean_keys=frozenset({"loss", "pg_loss"})
                    )
                if self.critic is not None and not self._critic_fused:  # (its collectives: after the policy's)
                    stats.update(self.critic.train_on(mb))
                per_minibatch.append(stats)

        # 4. the step's statistics: the mean over its mini-batches
        if self.distributed != "none" and keep_rows and single_pass:  # each rank holds its own rows
            result.row_logprobs = dist_learner.gather_rows(result.row_logprobs)
            result.row_entropy = dist_learner.gather_rows(result.row_entropy)
        keys = {k for stats in per_minibatch for k in stats}
        result.stats = {k: sum(vals) / len(vals) for k in keys for vals in [[st[k] for st in per_minibatch if k in st]]}
        result.stats["lr"] = lr
        result.stats.update(critic_stats)
        if version is not None:
            result.stats.update(token_lag_stats(batch, version, self.staleness))
        return result

    def _loss_inputs(
        self, mb: TrainBatch, logp: torch.Tensor, trace: dict | None = None
    ) -> tuple[PolicyLossInputs, dict[str, float]]:
        """The policy loss's inputs for a mini-batch: the proximal (decoupled PPO) or behaviour
        policy as old, recorded log-probs on replayed tokens, the staleness weight. ``trace``: a dict
        that takes the correction's per-token ``is_capped`` and ``is_masked`` too (and is passed on to
        the loss for its own flags)."""
        cfg = self.cfg
        weight, bw, log_rho = None, None, None
        if cfg.recompute_proximal:  # the off-policy correction over generated, non-replayed tokens
            fresh = mb.response_mask * (1 - mb.exp_mask)
            bw = behavior_weights(mb.old_logprobs, mb.behavior_logprobs, fresh, self.correction)
            weight = bw.weight
            if self.loss_cfg.behavior_clip:  # the trust region around the behaviour policy reads log rho
                log_rho = torch.where(
                    fresh > 0,
                    mb.old_logprobs - mb.behavior_logprobs,
                    torch.zeros((), dtype=weight.dtype, device=weight.device),
                )
        else:
            mb.old_logprobs = mb.behavior_logprobs
        old, stats = mb.old_logprobs, {}
        has_exp = bool(mb.exp_mask.any())
        if has_exp:
            # replayed tokens take their recorded log-probs as the old policy where one was recorded,
            # and carry no staleness weight (their ratio is the off-policy one)
            use_rec = mb.exp_mask * mb.recorded_mask if self.use_recorded else torch.zeros_like(mb.exp_mask)
            m = (use_rec * mb.response_mask).bool()
            if m.any():
                stats["recorded_vs_current_logprob_diff"] = float((old[m] - mb.recorded_logprobs[m]).abs().mean())
            old = torch.where(use_rec.bool(), mb.recorded_logprobs, old)
            if weight is not None:
                weight = torch.where(mb.exp_mask.bool(), torch.ones_like(weight), weight)
        if trace is not None and bw is not None:
            trace.update(is_capped=bw.capped, is_masked=bw.masked)
        if bw is not None and mb.response_mask.bool().any():
            on = mb.response_mask.bool()
            w = weight[on]
            stats.update(
                is_weight_mean=w.mean().item(),
                is_weight_max=w.max().item(),
                is_weight_capped_frac=bw.capped[on].float().mean().item(),
                is_weight_masked_frac=bw.masked[on].float().mean().item(),
            )
        inputs = PolicyLossInputs(
            logp,
            old,
            mb.advantages,
            mb.response_mask,
            behavior_weight=weight,
            exp_mask=mb.exp_mask if has_exp else None,
            behavior_log_ratio=log_rho,
            trace=trace,
        )
        return inputs, stats

    @torch.no_grad()
    def trace_tokens(
        self, batch: TrainBatch, index: list[int], learner_logprobs: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """What the policy loss saw on rows ``index`` of ``batch``, per target position ``[len(index),
        T'-1]``: ``learner_logprobs`` (this step's policy before its update, run by the caller), the
        old policy the ratio is taken against, the behaviour weight and the correction's and the
        loss's flags (:func:`PolicyLossInputs`'s ``trace``), the advantages, masks and versions.
        Called after the step, so that a critic's advantages are the ones trained with; the inputs
        are made as the first mini-batch's (:meth:`_loss_inputs`, the proximal policy being the
        weights before the update)."""
        sub = batch.take(index)
        logp = learner_logprobs.to(sub.response_mask.device)
        if self.cfg.recompute_proximal:
            sub.old_logprobs = logp
        kept: dict = {}
        inputs, _ = self._loss_inputs(sub, logp, kept)
        self.policy_loss(inputs, self.loss_cfg)
        weight = inputs.behavior_weight
        return {
            **kept,
            "learner": logp,
            "old": inputs.old_logprobs,
            "behaviour": sub.behavior_logprobs,
            "weight": torch.ones_like(logp) if weight is None else weight,
            "token_advantage": sub.advantages,
            "response_mask": sub.response_mask,
            "exp_mask": sub.exp_mask,
            "version": sub.token_versions,
        }

    def _may_skip(self) -> bool:
        """Rows that carry no gradient may be left out: no KL or entropy term reads them."""
        return self.cfg.skip_zero_advantage and not self.side_terms

    def _forward(
        self, model, batch: TrainBatch, with_entropy: bool = False, entropy_grad: bool = True, path: str | None = None
    ) -> Forward:
        """:func:`forward_rows` in this trainer's layout; with shared prompts, bins up to four times
        the longest row (within the token budget), so that a prompt's completions share more bins."""
        path = path or self.attention
        width = shared_width(batch, self.micro_tokens) if path == "mask" and self.shared_prefix else None
        return forward_rows(
            model,
            batch,
            self.temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            packing=path,
            shared_prefix=self.shared_prefix,
            width=width,
            logits_chunk_mb=self.cfg.logits_chunk_mb,
        )

    def _measure_attention(self, micro: TrainBatch) -> None:
        """train.attention=auto on CUDA: the fastest candidate on this first micro-batch (forward and
        backward, each run twice), printed with the times; the gradients are dropped after."""

        def run(path: str) -> None:
            out = self._forward(self.model, micro, path=path)
            (out.logprobs * micro.response_mask).sum().backward()

        device = torch.device(self.cfg.device)
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.attention, times = measure_attention(self._attention_candidates, run, sync)
        self.optimizer.zero_grad(set_to_none=True)
        self.packing = self.attention != "padded"
        if self.critic is not None:
            self.critic.attention = self.attention
        shown = ", ".join(f"{p} {t * 1e3:.0f} ms" if t == t else f"{p} failed" for p, t in times.items())
        print(
            f"[learner] train.attention=auto: {self.attention} (the first micro-batch, forward and backward: {shown})",
            flush=True,
        )

    @torch.no_grad()
    def logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        """``model``'s log-probs of ``batch``'s target tokens, ``[B, T-1]``, as this trainer computes
        them (its temperature and attention path), without a graph: for a model other than the policy."""
        return self._forward(model, batch).logprobs

    @torch.no_grad()
    def _chunked_logprobs(
        self, model, batch: TrainBatch, with_entropy: bool = False, skip: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) of every row, ``[B, T-1]``, in micro-batches of the token budget
        and without a graph; ``skip``: rows that carry no gradient are not run (their values stay 0)."""
        logp = torch.zeros(batch.response_mask.shape, device=batch.response_mask.device)
        ent = torch.zeros_like(logp) if with_entropy else None
        for index in plan_micro_batches(batch, self.micro_tokens, self.packing, skip).micro_batches:
            self._check_stop()
            out = self._forward(model, batch.take(index), with_entropy=with_entropy)
            put_rows(logp, index, out.logprobs)
            if ent is not None:
                put_rows(ent, index, out.entropy)
        return logp, ent

    @torch.no_grad()
    def _ref_logprobs(self, mb: TrainBatch) -> torch.Tensor:
        """The reference policy's log-probs for the KL term: the frozen copy, or (``model.lora``) the
        policy itself with its adapters disabled, which is the base model."""
        if self.ref_model is not None:
            return self._forward(self.ref_model, mb).logprobs
        with dist_learner.unwrap(self.model).disable_adapter():
            return self._forward(self.model, mb).logprobs

    def _loss(
        self, micro: TrainBatch, totals: Totals, single_pass: bool, version: int | None
    ) -> tuple[Forward, torch.Tensor, dict[str, float]]:
        """Forward one micro-batch and its loss (the policy loss, KL, entropy), scaled to its share of
        the mini-batch's normalisers."""
        cfg = self.cfg
        want_entropy = cfg.entropy_coef > 0
        # the entropy is always computed for the ``entropy`` metric; a graph only for the bonus
        out = self._forward(self.model, micro, with_entropy=True, entropy_grad=want_entropy)
        logp, entropy = out.logprobs, out.entropy
        mismatch = mismatch_stats(logp.detach(), micro, version) if version is not None else {}
        if cfg.recompute_proximal and single_pass:
            micro.old_logprobs = logp.detach()  # the proximal policy is the current one: no extra forward
        inputs, stats = self._loss_inputs(micro, logp)
        stats.update(mismatch)
        pg_scale, tok_scale = loss_scales(micro.response_mask, self.loss_cfg.loss_agg_mode, totals)
        loss, loss_stats = self.policy_loss(inputs, self.loss_cfg)
        loss = loss * pg_scale
        stats.update(loss_stats, pg_loss=loss_stats.get("pg_loss", 0.0) * pg_scale)
        # the KL and entropy terms: a token mean, or the policy loss's own aggregation (train.side_terms_agg)
        side_mode = self.loss_cfg.loss_agg_mode if cfg.side_terms_agg == "loss_agg_mode" else "token-mean"
        side_scale = pg_scale if side_mode != "token-mean" else tok_scale
        if self.ref_model is not None or self.ref_is_base:
            kl = kl_penalty(logp, self._ref_logprobs(micro), cfg.kl_type)
            loss = (
                loss
                + cfg.kl_coef * agg_loss(kl, micro.response_mask, side_mode, norm=self.loss_cfg.agg_norm) * side_scale
            )
            stats["kl"] = masked_mean(kl, micro.response_mask).item()
        if want_entropy:
            loss = (
                loss
                - cfg.entropy_coef
                * agg_loss(entropy, micro.response_mask, side_mode, norm=self.loss_cfg.agg_norm)
                * side_scale
            )
        stats["entropy"] = masked_mean(entropy, micro.response_mask).item()
        return out, loss, stats


def mismatch_stats(learner_logprobs: torch.Tensor, mb: TrainBatch, version: int) -> dict[str, float]:
    """Train/inference mismatch on the generated tokens made with the learner's own current weights
    (the token's version ``== version``, not replayed): the engine's behaviour log-probs against
    the learner's, ``[B, T-1]`` each, before this step's update. ``mismatch/logprob_abs_diff_*`` is
    ``|logp_behaviour - logp_learner|``; ``mismatch/kl`` the k3 estimate of KL(behaviour || learner),
    ``mean(r - log r - 1)`` with ``r = exp(logp_learner - logp_behaviour)`` (as prime-rl reports it).
    Empty when no such token is in the batch."""
    fresh = (mb.token_versions.to(learner_logprobs.device) == version) & (mb.exp_mask == 0)
    m = (mb.response_mask > 0) & fresh
    if not bool(m.any()):
        return {}
    log_r = (learner_logprobs - mb.behavior_logprobs)[m].double()
    diff = log_r.abs()
    return {
        "mismatch/logprob_abs_diff_mean": float(diff.mean()),
        "mismatch/logprob_abs_diff_max": float(diff.max()),
        "mismatch/kl": float((log_r.exp() - log_r - 1).mean()),
        "mismatch/tokens": float(m.sum()),
    }


def token_lag_stats(
    batch: TrainBatch, version: int, staleness: StalenessPolicy | None = None, bins: int = 4
) -> dict[str, float]:
    """Per-token version lag of the batch's generated tokens (replayed ones excluded): ``version``
    minus the version that generated each token (``TrainBatch.token_versions``).
    ``staleness/token_lag_mean``, ``_max``, and ``staleness/token_lag_frac_<k>`` the share of tokens
    with lag k for k < ``bins``, plus ``_ge<bins>`` for the rest; with the ``staleness`` policy,
    ``staleness/token_frac_past_bound`` the share of tokens older than its bound (rows that began
    before an in-flight update). Empty when no such token."""
    m = (batch.response_mask * (1 - batch.exp_mask)).cpu() > 0
    if not bool(m.any()):
        return {}
    lag = (version - batch.token_versions.cpu())[m].double()
    total = float(lag.numel())
    out = {"staleness/token_lag_mean": float(lag.mean()), "staleness/token_lag_max": float(lag.max())}
    for k in range(bins):
        out[f"staleness/token_lag_frac_{k}"] = float((lag == k).sum()) / total
    out[f"staleness/token_lag_frac_ge{bins}"] = float((lag >= bins).sum()) / total
    if staleness is not None:
        out["staleness/token_frac_past_bound"] = float((lag > staleness.max_staleness).sum()) / total
    return out
