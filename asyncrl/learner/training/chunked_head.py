"""The learner's log-probs and entropies without a micro-batch's ``[tokens, vocabulary]`` logits.

A real vocabulary makes the output layer the learner's largest tensor: 8,192 tokens of a
49,152-token vocabulary are 1.6 GB of float32 logits, kept for the backward pass along with the
softmax. Here the model's output layer (its ``lm_head``, a ``Linear``) is asked, for the duration of one
forward, for what the learner reads and nothing else: at each target position (the slots whose next
token is trained or scored), the log-prob of that token under ``logits / temperature`` and, when
asked, the entropy. It computes them ``chunk`` positions at a time and keeps no logits; the backward
pass recomputes one chunk's logits at a time and writes their gradients by hand (:class:`_TargetLogits`). Peak memory for the logits: one chunk (``train.logits_chunk_mb``), whatever the
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


class _TargetLogits(torch.autograd.Function):
    """``(log-prob of labels, entropy)`` at the rows of ``h`` ``[N, hidden]`` under ``linear(h) / temperature``,
    ``chunk`` rows at a time. Forward keeps no logits (only each row's logsumexp and entropy); backward
    recomputes one chunk's logits at a time and writes its gradients by hand: for the log-prob
    ``onehot - p``, for the entropy ``-p * (log p + H)``, through the temperature and the layer (what autograd
    would compute, without its dense gather and softmax copies). Logits are taken in the layer's dtype,
    then float32 (as :func:`asyncrl.objectives.logprobs.logprobs_from_logits` does)."""

    @staticmethod
    def forward(ctx, h, weight, bias, labels, temperature, with_entropy, entropy_grad, chunk):
        n = h.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty_like(logp)
        ent = torch.zeros_like(logp) if with_entropy else logp.new_zeros(0)
        for s in range(0, n, chunk):
            z = _logits(h[s : s + chunk], weight, bias, temperature)
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
            logp[s : s + chunk] = z.gather(-1, labels[s : s + chunk, None]).squeeze(-1) - lse[s : s + chunk]
            if with_entropy:
                ent[s : s + chunk] = lse[s : s + chunk] - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(h, weight, bias if bias is not None else weight.new_zeros(0), labels, lse, ent)
        ctx.temperature, ctx.chunk, ctx.has_bias = temperature, chunk, bias is not None
        ctx.entropy_grad = with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight, bias, labels, lse, ent = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_b = ctx.has_bias and ctx.needs_input_grad[2]
        g_h = torch.zeros_like(h) if want_h else None
        g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        g_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_b else None
        use_ent = ctx.entropy_grad and g_ent is not None
        for s in range(0, h.shape[0], ctx.chunk):
            e = s + ctx.chunk
            z = _logits(h[s:e], weight, bias, ctx.temperature)
            p = torch.exp(z - lse[s:e, None])
            g = p * (-g_logp[s:e, None]) if g_logp is not None else torch.zeros_like(p)
            if g_logp is not None:
                g.scatter_add_(-1, labels[s:e, None], g_logp[s:e, None])
            if use_ent:  # dH/dz = -p * (log p + H), log p = z - lse
                g -= g_ent[s:e, None] * p * (z - lse[s:e, None] + ent[s:e, None])
            if ctx.temperature != 1.0:
                g = g / ctx.temperature
            g = g.to(weight.dtype)
            if want_h:
                g_h[s:e] = g @ weight
            if want_w:
                g_w += (g.t() @ h[s:e]).float()
            if want_b:
                g_b += g.float().sum(0)
        return (
            g_h,
            g_w.to(weight.dtype) if want_w else None,
            g_b.to(weight.dtype) if want_b else None,
            None,
            None,
            None,
            None,
            None,
        )


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    z = F.linear(h, weight, bias)
    if temperature != 1.0:
        z = z / temperature
    return z if z.dtype in (torch.float32, torch.float64) else z.float()


@contextlib.contextmanager
def target_head(
    model,
    slots: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk: int = 1024,
):
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
        logp, ent = _TargetLogits.apply(
            h, head.weight, head.bias, lab, temperature, with_entropy, entropy_grad and torch.is_grad_enabled(), chunk
        )
        return torch.stack([logp, ent if with_entropy else torch.zeros_like(logp)], dim=-1)[None]

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

            warnings.warn(
                f"{type(model).__name__}: its forward changes the output layer's logits (or the chunked "
                f"output layer failed); the learner computes full logits for it",
                stacklevel=2,
            )
        _CHECKED[head] = known
    return known
