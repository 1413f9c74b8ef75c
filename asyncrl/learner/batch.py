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

from asyncrl.learner.core_algos import entropy_from_logits, logprobs_from_logits
from asyncrl.types import Trajectory

__all__ = ["TrainBatch", "collate", "compute_logprobs"]


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
    policy_versions: Tensor  # long [B]
    sample_types: list[str]
    group_ids: list[str]

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Response (trained) tokens in the batch."""
        return int(self.response_mask.sum().item())

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
    rows: dict[str, list[Tensor]] = {k: [] for k in ("resp", "behav", "exp", "rec", "recm")}
    for i, (t, n) in enumerate(zip(trajectories, lengths)):
        input_ids[i, :n] = torch.as_tensor(t.token_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        exp = t.off_policy_mask
        rows["resp"].append(_shifted(t.loss_mask, n, W, torch.float32))
        rows["behav"].append(_shifted(t.behavior_logprobs, n, W, torch.float32))
        rows["exp"].append(_shifted(exp, n, W, torch.float32))
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
        policy_versions=torch.tensor([int(t.policy_version) for t in trajectories], dtype=torch.long),
        sample_types=[t.sample_type for t in trajectories],
        group_ids=[t.group_id for t in trajectories],
    )
    return batch if torch.device(device).type == "cpu" else batch.to(device)


def compute_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float = 1.0,
                     with_entropy: bool = False, entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
    """Forward a Hugging Face causal LM over ``batch``; log-probs of the targets.

    Returns ``(logprobs[B, T-1], entropy[B, T-1] or None)`` from ``logits[:, :-1] / temperature``
    and targets ``input_ids[:, 1:]``. Grad flows if enabled by the caller (``torch.no_grad()`` for
    the proximal/reference passes). Padded positions hold finite junk; mask them.
    ``entropy_grad=False`` computes the entropy without a graph (for logging: no memory is kept for
    a backward pass through it).
    """
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    logits = out.logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = logprobs_from_logits(logits, batch.input_ids[:, 1:])
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
    return logprobs, entropy
