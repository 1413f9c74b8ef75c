"""Trajectories -> one padded training batch, and the learner's log-prob forward.

Alignment: ``input_ids[B, T]`` holds the right-padded token sequences; every per-token tensor is
``[B, T-1]`` over TARGET positions: position ``j`` refers to token ``j + 1``, the one the logits at
``j`` predict. So ``response_mask[b, j] = loss_mask[j + 1]`` and ``behavior_logprobs[b, j]`` is the
engine's log-prob of token ``j + 1``. Token 0 is never a target (it is always prompt).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ...engine.kv import cache_arg, cache_of
from ...objectives.logprobs import entropy_from_logits, logprobs_from_logits
from ...types import Trajectory

__all__ = ["TrainBatch", "collate", "compute_logprobs", "shared_prefix_plan"]


@dataclass
class TrainBatch:
    """A padded batch of ``B`` trajectories (see the module docstring for the alignment)."""

    input_ids: Tensor  # long [B, T], right-padded with pad_id
    attention_mask: Tensor  # long [B, T], 1 on real tokens
    response_mask: Tensor  # float [B, T-1], loss_mask of the target token
    behavior_logprobs: Tensor  # float [B, T-1], engine log-probs of the target token (0 off-mask)
    old_logprobs: Tensor  # float [B, T-1], proximal policy; a copy of behaviour until recomputed
    advantages: Tensor  # float [B, T-1], trajectory advantage on response tokens, 0 elsewhere
    exp_mask: Tensor  # float [B, T-1], 1 on replayed (off-policy) target tokens
    recorded_logprobs: Tensor  # float [B, T-1], replay's recorded log-probs (0 when absent)
    recorded_mask: Tensor  # float [B, T-1], 1 where a recorded log-prob exists (NaN/absent: 0)
    rewards: Tensor  # float [B]
    row_advantages: Tensor  # float [B], each trajectory's advantage (what ``advantages`` spreads on its tokens)
    policy_versions: Tensor  # long [B], each row's oldest generated token's version
    token_versions: Tensor  # long [B, T-1], the policy version of each target token (its row's where none recorded)
    sample_types: list[str]
    group_ids: list[str]

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Response (trained) tokens in the batch."""
        return int(self.response_mask.sum().item())

    def truncate_stale(self, version: int, max_staleness: int) -> int:
        """``buffer.stale_tokens: truncate``: no loss on generated tokens more than ``max_staleness``
        versions older than ``version`` (response mask and advantages 0 there, in place; replayed
        tokens are left alone). Returns how many tokens it masked."""
        stale = ((version - self.token_versions) > max_staleness) & (self.response_mask > 0) & (self.exp_mask == 0)
        n = int(stale.sum())
        if n:
            self.response_mask = self.response_mask.masked_fill(stale, 0.0)
            self.advantages = self.advantages.masked_fill(stale, 0.0)
        return n

    def _map(self, tensor_fn, list_fn) -> "TrainBatch":
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = tensor_fn(v) if isinstance(v, Tensor) else list_fn(v)
        return TrainBatch(**out)

    def to(self, device: str | torch.device) -> "TrainBatch":
        """A copy with every tensor on ``device``."""
        return self._map(lambda t: t.to(device), list)

    def select(self, rows: slice) -> "TrainBatch":
        """Rows ``rows`` of every field (tensors share storage with this batch)."""
        return self._map(lambda t: t[rows], lambda xs: list(xs[rows]))

    def split(self, k: int) -> list["TrainBatch"]:
        """``k`` mini-batches along B, sizes differing by at most one, order kept."""
        b = self.batch_size
        if not 1 <= k <= b:
            raise ValueError(f"cannot split a batch of {b} trajectories into {k} mini-batches")
        base, extra = divmod(b, k)
        out, start = [], 0
        for i in range(k):
            stop = start + base + (1 if i < extra else 0)
            out.append(self.select(slice(start, stop)))
            start = stop
        return out


def _shifted(arr: np.ndarray | None, n: int, width: int, dtype: torch.dtype) -> Tensor:
    """Row ``[width]``: ``arr[1:n]`` (the target positions), zero-padded; zeros when ``arr`` is None."""
    row = torch.zeros(width, dtype=dtype)
    if arr is not None and n > 1:
        row[: n - 1] = torch.as_tensor(np.asarray(arr[1:n]), dtype=dtype)
    return row


def collate(trajectories: list[Trajectory], advantages: Tensor, pad_id: int,
            device: str | torch.device = "cpu") -> TrainBatch:
    """Pad ``N`` trajectories into a :class:`TrainBatch` with ``advantages[N]`` on response tokens.

    ``exp_mask`` comes from ``Trajectory.exp_mask``; a replay trajectory (``is_replay``) without one
    is off-policy on all its generated tokens, so its ``loss_mask`` is used. NaN in
    ``recorded_logprobs`` means "not recorded" (seed 6.4): ``recorded_mask`` is 0 there, the value 0.
    """
    if not trajectories:
        raise ValueError("collate needs at least one trajectory")
    adv = torch.as_tensor(advantages, dtype=torch.float32).detach().reshape(-1).cpu()
    if adv.shape[0] != len(trajectories):
        raise ValueError(f"got {adv.shape[0]} advantages for {len(trajectories)} trajectories")
    lengths = [len(t.token_ids) for t in trajectories]
    T = max(lengths)
    W = max(T - 1, 0)
    B = len(trajectories)
    input_ids = torch.full((B, T), int(pad_id), dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    rows: dict[str, list[Tensor]] = {k: [] for k in ("resp", "behav", "exp", "rec", "recm", "ver")}
    for i, (t, n) in enumerate(zip(trajectories, lengths)):
        input_ids[i, :n] = torch.as_tensor(t.token_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        exp = t.off_policy_mask
        rows["resp"].append(_shifted(t.loss_mask, n, W, torch.float32))
        rows["behav"].append(_shifted(t.behavior_logprobs, n, W, torch.float32))
        rows["exp"].append(_shifted(exp, n, W, torch.float32))
        rows["ver"].append(_shifted(t.versions_per_token(), n, W, torch.long))
        rec = _shifted(t.recorded_logprobs, n, W, torch.float32)
        rows["recm"].append(torch.isfinite(rec).float() if t.recorded_logprobs is not None
                            else torch.zeros(W))
        rows["rec"].append(torch.nan_to_num(rec, nan=0.0, posinf=0.0, neginf=0.0))
    response_mask = torch.stack(rows["resp"])
    behavior = torch.stack(rows["behav"])
    batch = TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        behavior_logprobs=behavior,
        old_logprobs=behavior.clone(),
        advantages=adv[:, None] * response_mask,
        exp_mask=torch.stack(rows["exp"]),
        recorded_logprobs=torch.stack(rows["rec"]),
        recorded_mask=torch.stack(rows["recm"]),
        rewards=torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32),
        row_advantages=adv.clone(),
        policy_versions=torch.tensor([int(t.policy_version) for t in trajectories], dtype=torch.long),
        token_versions=torch.stack(rows["ver"]),
        sample_types=[t.sample_type for t in trajectories],
        group_ids=[t.group_id for t in trajectories],
    )
    return batch if torch.device(device).type == "cpu" else batch.to(device)


def compute_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float = 1.0,
                     with_entropy: bool = False, entropy_grad: bool = True,
                     shared_prefix: bool = False) -> tuple[Tensor, Tensor | None]:
    """Forward a Hugging Face causal LM over ``batch``; log-probs of the targets.

    Returns ``(logprobs[B, T-1], entropy[B, T-1] or None)`` from ``logits[:, :-1] / temperature``
    and targets ``input_ids[:, 1:]``. Grad flows if enabled by the caller (``torch.no_grad()`` for
    the proximal/reference passes). Padded positions hold finite junk; mask them.
    ``entropy_grad=False`` computes the entropy without a graph (for logging: no memory is kept for
    a backward pass through it).

    ``shared_prefix``: rows that start with the same tokens up to their first trained token (the
    completions of one prompt) run that prefix once (:func:`shared_prefix_plan`); the same values
    as the full forward up to float rounding, on fewer tokens. Used when it saves at least a fifth of
    the padded tokens and the model returns a key/value cache; otherwise the plain forward.
    """
    plan = shared_prefix_plan(batch) if shared_prefix else None
    if plan is not None:
        out = _shared_prefix_forward(model, batch, plan, temperature, with_entropy, entropy_grad)
        if out is not None:
            return out
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    return _targets(out.logits[:, :-1], batch.input_ids[:, 1:], temperature, with_entropy, entropy_grad)


def _targets(logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool,
             entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = logprobs_from_logits(logits, labels)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
    return logprobs, entropy


@dataclass
class PrefixPlan:
    """How :func:`compute_logprobs` splits a batch: ``G`` distinct prefixes (``prefix_ids[G, P]``,
    right-padded, ``prefix_mask``), ``group[B]`` (each row's prefix), ``start[B]`` (each row's first
    trained token: the prefix is tokens ``0 .. start-1``) and ``S`` (the longest suffix)."""

    prefix_ids: Tensor
    prefix_mask: Tensor
    group: Tensor
    start: Tensor
    suffix_len: int


def shared_prefix_plan(batch: TrainBatch, min_saving: float = 0.2) -> PrefixPlan | None:
    """The prefix sharing plan for ``batch``, or None when every row has its own prefix, a row has
    no trained token, or sharing saves less than ``min_saving`` of the padded tokens."""
    ids, lengths = batch.input_ids, batch.attention_mask.sum(1)
    trained = batch.response_mask > 0
    if batch.batch_size < 2 or not bool(trained.any(1).all()):
        return None
    start = trained.float().argmax(1) + 1  # token index of the first trained token (>= 1)
    keys: dict[tuple[int, ...], int] = {}
    group = [keys.setdefault(tuple(row[:k].tolist()), len(keys))
             for row, k in zip(ids.cpu(), start.tolist())]
    G, B, T = len(keys), *ids.shape
    P, S = int(start.max()), int((lengths - start).max())
    if G == B or G * P + B * S > (1 - min_saving) * B * T:
        return None
    prefix_ids = torch.zeros(G, P, dtype=torch.long)
    prefix_mask = torch.zeros(G, P, dtype=torch.long)
    for key, g in keys.items():
        prefix_ids[g, : len(key)] = torch.tensor(key, dtype=torch.long)
        prefix_mask[g, : len(key)] = 1
    dev = ids.device
    return PrefixPlan(prefix_ids.to(dev), prefix_mask.to(dev), torch.tensor(group, device=dev), start, S)


def _shared_prefix_forward(model, batch: TrainBatch, plan: PrefixPlan, temperature: float, with_entropy: bool,
                           entropy_grad: bool) -> tuple[Tensor, Tensor | None] | None:
    """The prefixes once (keeping their key/value cache), then every row's suffix attending to its
    group's cache (repeated per row: the gradient flows back into the prefix pass). Target position
    ``j`` (predicting token ``j + 1``) takes its logits from the prefix pass while ``j < start - 1``
    and from the suffix pass after. None when the model gives no full cache (gradient
    checkpointing, sliding-window layers): the caller runs the plain forward."""
    from transformers import DynamicCache

    ids, group, start, S = batch.input_ids, plan.group, plan.start, plan.suffix_len
    B, T = ids.shape
    P = plan.prefix_ids.shape[1]
    # two forwards, one backward: under DDP and FSDP2 too (each parameter's gradient hook fires once,
    # with both passes' contributions summed; tests/unit/learner/test_distributed_learner.py)
    pre = model(input_ids=plan.prefix_ids, attention_mask=plan.prefix_mask, use_cache=True)
    cache = cache_of(pre)
    layers = getattr(cache, "layers", None)
    if not layers or any(getattr(layer, "keys", None) is None or layer.keys.shape[-2] != P for layer in layers):
        return None
    rows = DynamicCache()
    for i, layer in enumerate(layers):
        rows.update(layer.keys.index_select(0, group), layer.values.index_select(0, group), i)
    steps = torch.arange(S, device=ids.device)
    lengths = batch.attention_mask.sum(1)
    suffix_mask = (steps[None] < (lengths - start)[:, None]).long()
    index = (start[:, None] + steps[None]).clamp(max=T - 1)  # token index of each suffix slot
    suffix_ids = ids.gather(1, index) * suffix_mask
    mask = torch.cat([plan.prefix_mask.index_select(0, group), suffix_mask], 1)
    suf = model(input_ids=suffix_ids, attention_mask=mask, position_ids=start[:, None] + steps[None],
                **cache_arg(model, rows), use_cache=False)
    # suffix targets: token start + s for s in 0..S-1, predicted by the prefix's last logits (s = 0)
    # and the suffix logits at s - 1
    last = pre.logits.index_select(0, group)[torch.arange(B, device=ids.device), start - 1]
    lp_s, ent_s = _targets(torch.cat([last[:, None], suf.logits[:, :-1]], 1), ids.gather(1, index),
                           temperature, with_entropy, entropy_grad)
    lp_p, ent_p = _targets(pre.logits[:, :-1], plan.prefix_ids[:, 1:], temperature, with_entropy, entropy_grad)
    j = torch.arange(T - 1, device=ids.device)[None].expand(B, -1)
    in_prefix = j < (start - 1)[:, None]
    from_prefix = j.clamp(max=max(P - 2, 0))
    from_suffix = (j - (start - 1)[:, None]).clamp(min=0, max=S - 1)

    def place(prefix_part: Tensor | None, suffix_part: Tensor | None) -> Tensor | None:
        if prefix_part is None:
            return None
        if P < 2:  # every prefix is one token: no prefix targets
            return suffix_part.gather(1, from_suffix)
        return torch.where(in_prefix, prefix_part.index_select(0, group).gather(1, from_prefix),
                           suffix_part.gather(1, from_suffix))

    return place(lp_p, lp_s), place(ent_p, ent_s)
