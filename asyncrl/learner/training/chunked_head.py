"""The learner's log-probs and entropies without a micro-batch's ``[tokens, vocabulary]`` logits.

A real vocabulary makes the output layer the learner's largest tensor: 8,192 tokens of a
49,152-token vocabulary are 1.6 GB of float32 logits, kept for the backward pass along with the
softmax. Here the model's output layer (its ``lm_head``, a ``Linear``) is asked, for the duration of one
forward, for what the learner reads and nothing else: at each target position (the slots whose next
token is trained or scored), the log-prob of that token under ``logits / temperature`` and, when
asked, the entropy. It computes them ``chunk`` positions at a time; with gradients on, each chunk runs
under activation checkpointing, so the backward pass recomputes one chunk's logits at a time instead
of keeping them all. Peak memory for the logits: one chunk (``train.logits_chunk_mb``), whatever the
micro-batch. The values are today's (:func:`asyncrl.objectives.logprobs.logprobs_from_logits`): the
same float32 arithmetic on the same logits, rows of the matrix product computed in other groupings.

The output layer is patched on the instance (``forward``), not replaced, so its parameter (tied to the
embeddings or not) and every wrapper's hooks (DDP, FSDP2's root, peft) are untouched; the model's own
forward returns the layer's output as its ``logits``: ``[1, N, 2]`` (log-prob, entropy) for the N
targets, in order. A model whose forward changes its logits after the output layer (soft-capping,
scaling) would change them: :func:`usable` checks the model once, on a few tokens, against the plain
path, and the learner falls back to full logits for a model that fails (or has no ``Linear`` head).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ...models.lora import is_lora

__all__ = ["chunk_tokens", "output_layer", "target_head", "usable"]

_CHECKED: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def output_layer(model) -> torch.nn.Linear | None:
    """The model's output layer when it is a plain ``Linear`` (through DDP's and peft's wrappers); None
    otherwise (a LoRA-adapted head, a model without one)."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    if is_lora(inner):
        inner = inner.get_base_model()
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Linear) else None


def chunk_tokens(head: torch.nn.Linear, budget_mb: float) -> int:
    """Target positions per chunk: a chunk's float32 logits fit in ``budget_mb`` MiB."""
    return max(1, int(budget_mb * (1 << 20)) // (4 * head.out_features))


def _chunk(h: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float,
           with_entropy: bool, entropy_grad: bool) -> tuple[Tensor, Tensor]:
    """``(log-prob of labels, entropy)`` at the rows of ``h`` ``[n, hidden]``: the layer's logits in its
    dtype, divided by the temperature, then in float32 (as logprobs_from_logits does)."""
    logits = F.linear(h, weight, bias)
    if temperature != 1.0:
        logits = logits / temperature
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, labels[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, logp.new_zeros(())
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        p = torch.softmax(logits, dim=-1)
        entropy = lse - (p * logits).sum(-1)
    return logp, entropy


@contextlib.contextmanager
def target_head(model, slots: Tensor, labels: Tensor, temperature: float = 1.0, with_entropy: bool = False,
                entropy_grad: bool = True, chunk: int = 1024):
    """Within the block, a forward of ``model`` returns as ``logits`` a ``[1, N, 2]`` tensor: for each of
    the N targets, the log-prob of ``labels[i]`` at flat position ``slots[i]`` (``row * width + column``
    of the forward's input; a position may be asked for several times) and the entropy there (0 without
    ``with_entropy``; no graph without ``entropy_grad``)."""
    head = output_layer(model)
    if head is None:
        raise ValueError("target_head: the model has no plain Linear output layer")
    slots, labels = slots.reshape(-1), labels.reshape(-1).long()

    def forward(hidden: Tensor) -> Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        h = flat.index_select(0, slots.to(flat.device))
        lab = labels.to(flat.device)
        grad = torch.is_grad_enabled() and (h.requires_grad or head.weight.requires_grad)
        outs = []
        for start in range(0, max(h.shape[0], 1), chunk):
            args = (h[start:start + chunk], head.weight, head.bias, lab[start:start + chunk], temperature,
                    with_entropy, entropy_grad)
            many = h.shape[0] > chunk
            outs.append(checkpoint(_chunk, *args, use_reentrant=False) if grad and many else _chunk(*args))
        logp = torch.cat([o[0] for o in outs])
        ent = torch.cat([o[1] for o in outs]) if with_entropy else torch.zeros_like(logp)
        return torch.stack([logp, ent], dim=-1)[None]

    before = head.__dict__.get("forward")  # (a hook's own forward on the instance, e.g. accelerate's)
    head.forward = forward
    try:
        yield
    finally:
        if before is None:
            del head.forward  # the class's forward again
        else:
            head.forward = before


def usable(model, run_plain, run_chunked) -> bool:
    """Whether the chunked head gives the plain path's log-probs for ``model`` (checked once per model
    on a few tokens: ``run_plain()`` and ``run_chunked()`` return the same targets' log-probs; every rank
    of a learner group checks at the same point of its first step, so their collectives pair up)."""
    head = output_layer(model)
    if head is None:
        return False
    known = _CHECKED.get(head)
    if known is None:
        with torch.no_grad():
            try:
                a, b = run_plain(), run_chunked()
                known = a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), atol=1e-3, rtol=0))
            except (RuntimeError, ValueError, IndexError):
                known = False
        if not known:
            import warnings

            warnings.warn(f"{type(model).__name__}: its forward changes the output layer's logits (or the chunked "
                          f"output layer failed); the learner computes full logits for it", stacklevel=2)
        _CHECKED[head] = known
    return known
