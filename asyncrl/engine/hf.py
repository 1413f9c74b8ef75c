"""Batched sampling with a Hugging Face causal LM (CPU or one GPU).

A hand-written KV-cache loop: prompts are left-padded with an attention mask, one forward pass per
new token (only the last position's logits are computed), sampling from ``softmax(logits / T)`` with
optional nucleus (top-p) filtering. The behaviour log-prob of each sampled token is read from the
unfiltered ``log_softmax(logits / T)``. On a 1M-parameter model on 2 CPU cores this loop was faster
than ``model.generate(..., output_logits=True)``, which adds per-step processor overhead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import SamplingConfig
from .base import Generation


@dataclass
class _Batch:
    """Sampled output of one batch. ``tokens``/``logprobs``: [B, T]; ``lengths``: [B]."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: list[int]
    reasons: list[str]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists. Returns ``ids`` long [B, P] and ``mask`` long [B, P] (1 = real token)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def sample_top_p(logp: torch.Tensor, top_p: float, gen: torch.Generator | None) -> torch.Tensor:
    """Sample one token per row from log-probs ``logp`` [B, V] after nucleus filtering -> long [B]."""
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # keeps at least the top token
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


class HFEngine:
    """``Engine`` over a ``transformers`` causal LM. ``version`` is the policy version in use."""

    def __init__(self, model, tokenizer, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.version = 0
        self.eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids))

    # ----------------------------------------------------------------------------- generation
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 seed: int | None = None) -> list[Generation]:
        """Sample one continuation per prompt (token-id lists). Deterministic for a given ``seed``.

        Generation ends at an EOS token (kept as the last token) or right after the token that
        completes a stop string from ``sampling.stop`` (the stop string stays in tokens and text);
        both give ``finish_reason == "stop"``, running out of ``max_new_tokens`` gives "length".
        ``seed=None`` draws from torch's global generator.
        """
        if not prompts:
            return []
        ids, mask = left_pad(prompts, self.pad_id)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(seed))
        out = self._sample(ids.to(self.device), mask.to(self.device), sampling, gen)
        return [self._to_generation(out, i) for i in range(len(prompts))]

    def _sample(self, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingConfig,
                gen: torch.Generator | None) -> _Batch:
        """The KV-cache loop. ``ids``/``mask``: [B, P] left-padded. Returns tokens/logprobs [B, T]."""
        bsz, steps = ids.shape[0], sampling.max_new_tokens
        tokens = torch.full((bsz, steps), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((bsz, steps), dtype=torch.float32, device=self.device)
        done = torch.zeros(bsz, dtype=torch.bool, device=self.device)
        eos = torch.tensor(sorted(self.eos_ids), device=self.device)
        lengths, reasons = [steps] * bsz, ["length"] * bsz
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        inp, cache = ids, None
        for t in range(steps):
            out = self.model(input_ids=inp, attention_mask=mask, position_ids=positions,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            logp = torch.log_softmax(out.logits[:, -1].float() / sampling.temperature, dim=-1)
            tok = sample_top_p(logp, sampling.top_p, gen).masked_fill(done, self.pad_id)
            tokens[:, t] = tok
            logprobs[:, t] = logp.gather(1, tok[:, None])[:, 0]
            finished = (~done) & torch.isin(tok, eos)
            if sampling.stop:
                finished |= self._stop_hits(tokens[:, : t + 1], done | finished, sampling.stop)
            for i in finished.nonzero()[:, 0].tolist():
                lengths[i], reasons[i] = t + 1, "stop"
            done |= finished
            if bool(done.all()):
                break
            inp = tok[:, None]
            mask = torch.cat([mask, mask.new_ones((bsz, 1))], dim=1)
            positions = positions[:, -1:] + 1
        return _Batch(tokens.cpu(), logprobs.cpu(), lengths, reasons)

    def _stop_hits(self, tokens: torch.Tensor, skip: torch.Tensor, stop: list[str]) -> torch.Tensor:
        """bool [B]: rows (not in ``skip``) whose text now contains a stop string.

        Only a window of the latest tokens is decoded: earlier tokens were checked at earlier steps.
        """
        window = 2 * max(len(s) for s in stop) + 8
        hits = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for i in (~skip).nonzero()[:, 0].tolist():
            text = self.tokenizer.decode(tokens[i, -window:].tolist(), skip_special_tokens=True)
            hits[i] = any(s in text for s in stop)
        return hits

    def _to_generation(self, out: _Batch, i: int) -> Generation:
        n = out.lengths[i]
        ids = out.tokens[i, :n].numpy().astype(np.int32)
        text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        return Generation(ids, out.logprobs[i, :n].numpy(), text, out.reasons[i])

    # ----------------------------------------------------------------------------- weights
    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Parameters by name (tied weights appear once), detached: ``{name: tensor}``."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    @torch.no_grad()
    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy ``named_tensors`` into the model and set ``version``.

        Names must be exactly those of ``state_dict_for_sync`` (aliases of tied weights are also
        accepted); any unknown or missing name or any shape mismatch raises ``ValueError`` before
        a single weight is changed.
        """
        targets = dict(self.model.state_dict(keep_vars=True))
        _check_weights(named_tensors, targets, set(self.state_dict_for_sync()))
        for name, tensor in named_tensors.items():
            targets[name].data.copy_(torch.as_tensor(tensor).to(targets[name].device))
        self.version = int(version)


def _check_weights(named: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
                   required: set[str]) -> None:
    unknown = sorted(set(named) - set(targets))
    if unknown:
        raise ValueError(f"update_weights: unknown parameter names {unknown[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''}; the model has e.g. {sorted(required)[:3]}")
    covered = {n for n in required if n in named or _tied_alias_given(n, named, targets)}
    missing = sorted(required - covered)
    if missing:
        raise ValueError(f"update_weights: missing parameters {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''} ({len(missing)} of {len(required)})")
    for name, tensor in named.items():
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise ValueError(f"update_weights: shape mismatch for {name!r}: got {tuple(tensor.shape)}, "
                             f"the model has {tuple(targets[name].shape)}")


def _tied_alias_given(name: str, named: dict, targets: dict) -> bool:
    """True when another given name points at the same storage as ``name`` (tied weights)."""
    ptr = targets[name].data_ptr()
    return any(targets[n].data_ptr() == ptr for n in named)


def _eos_ids(model, tokenizer) -> set[int]:
    """EOS token ids from the tokenizer and the model's generation config."""
    ids: set[int] = set()
    for src in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None),
                                                 "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src is not None:
            ids.update(int(x) for x in src)
    if not ids:
        raise ValueError("the tokenizer and model define no EOS token; set tokenizer.eos_token")
    return ids
