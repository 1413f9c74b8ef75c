"""Per-token quantities from logits and log-probs: log-probs of the targets, entropy, the KL
estimate to a reference policy (mask and aggregate them with :mod:`asyncrl.objectives.aggregation`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL estimate to a reference policy, ``[B, T]`` (mask and aggregate it yourself).

    - ``k1``: ``logp - ref``.
    - ``k2``: ``0.5 * (logp - ref) ** 2``.
    - ``k3`` / ``low_var_kl``: ``exp(ref - logp) - (ref - logp) - 1``, clamped to ``[-10, 10]``
      (verl), non-negative and low-variance.
    """
    if kind == "k1":
        return logprobs - ref_logprobs
    if kind == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    if kind in ("k3", "low_var_kl"):
        d = ref_logprobs - logprobs
        return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL kind {kind!r}; valid: k1, k2, k3, low_var_kl")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Categorical entropy per position: ``logits[B, T, V] -> [B, T]``.

    ``H = logsumexp(z) - sum(softmax(z) * z)``: one softmax, no [B, T, V] log-softmax kept.
    """
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """``log softmax(logits)[labels]``: ``logits[B, T, V]``, ``labels[B, T]`` -> ``[B, T]``.

    Float32/64: ``gather - logsumexp``, never materialising a full log-softmax. Half precision:
    row by row in float32, since logsumexp in bf16 loses the digits the PPO ratio needs.
    """
    labels = labels.long().unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        return logits.gather(-1, labels).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    rows = [F.log_softmax(row.float(), dim=-1).gather(-1, lab).squeeze(-1) for row, lab in zip(logits, labels)]
    return torch.stack(rows)
