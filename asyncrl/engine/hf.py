"""Batched sampling with a Hugging Face causal LM (CPU or one GPU).

A hand-written KV-cache loop: prompts are left-padded with an attention mask, one forward pass per
new token (only the last position's logits are computed), sampling from ``softmax(logits / T)`` with
optional nucleus (top-p) filtering. The behaviour log-prob of each sampled token is read from the
unfiltered ``log_softmax(logits / T)``. On a 1M-parameter model on 2 CPU cores this loop was faster
than ``model.generate(..., output_logits=True)``, which adds per-step processor overhead.

Continuous mode (``actor.weight_update: inflight``, :mod:`asyncrl.engine.continuous`): the owner
thread calls :meth:`HFEngine.step`, one decode step over all sequences in flight; finished rows leave
the batch (their cache rows are dropped), queued prompts are prefilled on their own and merged into
the running cache. New weights are applied between two steps; what happens to the KV cache of the tokens
before the update is ``kv_on_update``: ``recompute`` (default) rebuilds it with the new weights, so
every token's behaviour log-prob is exactly its version's; ``keep`` goes on with the old keys and
values (as PipelineRL does), so the first tokens after an update are computed over a cache made by
the previous weights (docs/design/inflight.md measures the difference).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from ..config import LoraSettings, SamplingConfig
from ..weights.adapters import MergedAdapters
from ..weights.base import check_weight_values
from ..weights.digest import tensor_crcs
from .base import Generation
from .continuous import ContinuousBatcher, Row
from .kv import cache_arg, cache_of
from .routing import RouteBuffer, RoutingRecorder

KV_ON_UPDATE = ("recompute", "keep")


@dataclass
class _Batch:
    """Sampled output of one batch. ``tokens``/``logprobs``: [B, T]; ``lengths``: [B]."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: list[int]
    reasons: list[str]
    routes: torch.Tensor | None = None  # int16 [B, P + T, layers x top_k] (routing replay), -1: no forward read it
    prompt_width: int = 0


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists. Returns ``ids`` long [B, P] and ``mask`` long [B, P] (1 = real token), on
    the CPU (the engine moves them to its device)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device="cpu")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long, device="cpu")
        mask[i, width - len(p) :] = 1
    return ids, mask


def sample_top_p(logp: torch.Tensor, top_p: "float | torch.Tensor", gen: torch.Generator | None) -> torch.Tensor:
    """Sample one token per row from log-probs ``logp`` [B, V] after nucleus filtering -> long [B].
    ``top_p``: one value, or one per row ([B, 1])."""
    probs = logp.exp()
    if bool((top_p < 1.0).any()) if isinstance(top_p, torch.Tensor) else top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # keeps at least the top token
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


class HFEngine:
    """``Engine`` over a ``transformers`` causal LM. ``version`` is the policy version in use."""

    def __init__(
        self, model, tokenizer, device: str = "cpu", lora: LoraSettings | None = None, record_routing: bool = False
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        # model.routing_replay: each token's experts, recorded as it is generated (asyncrl.engine.routing)
        self.recorder = RoutingRecorder(self.model) if record_routing else None
        if self.recorder is not None and not self.recorder.routers:
            raise ValueError(
                "model.routing_replay: the model has no mixture-of-experts routers (transformers TopKRouter "
                "modules) to record; turn it off for a dense model"
            )
        # model.lora: updates are adapters, merged into the targeted weights in place (asyncrl.weights.adapters)
        self.adapters = MergedAdapters(self.model, lora) if lora is not None else None
        self.tokenizer = tokenizer
        self.version = 0
        self.eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids))
        self.batcher: ContinuousBatcher | None = None  # continuous mode (start_continuous)
        self.kv_on_update = "recompute"
        self._live: list[Row] = []
        self._state = None  # (cache, mask, positions, last tokens) after the latest step
        self._rebuild = False
        self.steps = 0  # forward passes in continuous mode
        self.tokens_generated = 0  # every token sampled, counted as it is (the actor's heartbeat reports it)
        self.on_step = None  # called after every decode step of generate (the learner answers actors meanwhile)
        self.rebuilds = 0  # of which prefills (admitted prompts, caches recomputed after an update)

    # ----------------------------------------------------------------------------- generation
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seed: int | None = None) -> list[Generation]:
        """Sample one continuation per prompt (token-id lists). Deterministic for a given ``seed``.

        Generation ends at an EOS token (kept as the last token) or right after the token that
        completes a stop string from ``sampling.stop`` (the stop string stays in tokens and text);
        both give ``finish_reason == "stop"``, running out of ``max_new_tokens`` gives "length".
        ``seed=None`` draws from torch's global generator.
        """
        if not prompts:
            return []
        if self.batcher is not None and not self.batcher.is_owner():
            return self.batcher.submit(prompts, sampling)
        ids, mask = left_pad(prompts, self.pad_id)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(seed))
        first: dict[tuple, int] = {}
        rows = [first.setdefault(tuple(p), len(first)) for p in prompts]  # a group's n samples: one prompt
        shared = rows if len(first) < len(prompts) else None
        with self.recorder.recording() if self.recorder is not None else contextlib.nullcontext():
            out = self._sample(ids.to(self.device), mask.to(self.device), sampling, gen, shared=shared)
        return [self._to_generation(out, i, len(p)) for i, p in enumerate(prompts)]

    def _sample(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        sampling: SamplingConfig,
        gen: torch.Generator | None,
        shared: list[int] | None = None,
    ) -> _Batch:
        """The KV-cache loop. ``ids``/``mask``: [B, P] left-padded. Returns tokens/logprobs [B, T].
        ``shared[b]``: row b's prompt is the ``shared[b]``-th distinct one: each distinct prompt is
        prefilled once and its cache copied to its rows (a group's samples; the prefill is most of a
        batch's work when prompts are long and replies short)."""
        bsz, steps = ids.shape[0], sampling.max_new_tokens
        tokens = torch.full((bsz, steps), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((bsz, steps), dtype=torch.float32, device=self.device)
        done = torch.zeros(bsz, dtype=torch.bool, device=self.device)
        eos = torch.tensor(sorted(self.eos_ids), device=self.device)
        lengths, reasons = [steps] * bsz, ["length"] * bsz
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        inp, cache = ids, None
        # model.routing_replay: what the prefill and each decode step chose, [B, P + T, layers x top_k]
        routes = RouteBuffer(self.recorder, bsz, ids.shape[1] + steps, self.device) if self.recorder else None
        for t in range(steps):
            if t == 0 and shared is not None:
                logits, cache, rows = self._shared_prefill(ids, mask, positions, shared)
                if routes is not None:
                    routes.put(0, ids.shape[1], rows)
            else:
                out = self.model(
                    input_ids=inp,
                    attention_mask=mask,
                    position_ids=positions,
                    **cache_arg(self.model, cache),
                    use_cache=True,
                    logits_to_keep=1,
                )
                cache = cache_of(out)
                logits = out.logits[:, -1]
                if routes is not None:  # the prefill: the prompts' columns; step t: token t - 1's column
                    routes.put(ids.shape[1] + t - inp.shape[1], inp.shape[1])
            logp = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)
            tok = sample_top_p(logp, sampling.top_p, gen).masked_fill(done, self.pad_id)
            self.tokens_generated += bsz - int(done.sum())
            tokens[:, t] = tok
            logprobs[:, t] = logp.gather(1, tok[:, None])[:, 0]
            finished = (~done) & torch.isin(tok, eos)
            if sampling.stop:
                finished |= self._stop_hits(tokens[:, : t + 1], done | finished, sampling.stop)
            for i in finished.nonzero()[:, 0].tolist():
                lengths[i], reasons[i] = t + 1, "stop"
            done |= finished
            if self.on_step is not None:
                self.on_step()
            if bool(done.all()):
                break
            inp = tok[:, None]
            mask = torch.cat([mask, mask.new_ones((bsz, 1))], dim=1)
            positions = positions[:, -1:] + 1
        recorded = routes.routes.cpu() if routes is not None else None
        return _Batch(tokens.cpu(), logprobs.cpu(), lengths, reasons, recorded, ids.shape[1])

    def _shared_prefill(self, ids, mask, positions, shared: list[int]) -> tuple:
        """Each distinct prompt prefilled once, its cache copied to its rows: ``(next-token logits [B, V],
        the cache, the distinct prompt of each row)``."""
        rows = torch.tensor(shared, device=self.device)
        unique = torch.tensor([shared.index(k) for k in range(max(shared) + 1)], device=self.device)
        out = self.model(
            input_ids=ids[unique],
            attention_mask=mask[unique],
            position_ids=positions[unique],
            use_cache=True,
            logits_to_keep=1,
        )
        cache = cache_of(out)
        cache.batch_select_indices(rows)
        return out.logits[rows, -1], cache, rows

    def _stop_hits(self, tokens: torch.Tensor, skip: torch.Tensor, stop: list[str]) -> torch.Tensor:
        """bool [B]: rows (not in ``skip``) whose text now contains a stop string.

        Only a window of the latest tokens is decoded: earlier tokens were checked at earlier steps.
        """
        hits = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for i in (~skip).nonzero()[:, 0].tolist():
            hits[i] = self._stopped(tokens[i].tolist(), stop)
        return hits

    def _stopped(self, tokens: list[int], stop: list[str]) -> bool:
        """Whether the latest tokens' text contains a stop string (only a window of them is decoded:
        earlier tokens were checked at earlier steps)."""
        window = 2 * max(len(s) for s in stop) + 8
        text = self.tokenizer.decode(tokens[-window:], skip_special_tokens=True)
        return any(s in text for s in stop)

    def _to_generation(self, out: _Batch, i: int, prompt_len: int = 0) -> Generation:
        n = out.lengths[i]
        ids = out.tokens[i, :n].numpy().astype(np.int32)
        text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        routing = None
        if out.routes is not None:  # the prompt's own columns (left-padded) and the generated tokens'
            routing = out.routes[i, out.prompt_width - prompt_len : out.prompt_width + n].numpy().copy()
            routing[-1] = -1  # the last token: no forward of this sequence read it (a later step's is padding)
        return Generation(ids, out.logprobs[i, :n].numpy(), text, out.reasons[i], routing=routing)

    # ----------------------------------------------------------------------------- continuous mode
    def start_continuous(self, kv_on_update: str = "recompute") -> None:
        """Serve ``generate`` calls from other threads through :meth:`step` (called by this thread)."""
        if kv_on_update not in KV_ON_UPDATE:
            raise ValueError(f"kv_on_update must be one of {KV_ON_UPDATE}, got {kv_on_update!r}")
        self.batcher, self.kv_on_update = ContinuousBatcher(), kv_on_update
        self._live, self._state = [], None

    def stop_continuous(self, reason: str) -> None:
        """Fail every call still waiting (EngineStopped) and leave continuous mode."""
        if self.batcher is not None:
            self.batcher.stop(reason, self._live)
        self._live, self._state = [], None

    @property
    def in_flight(self) -> int:
        """Sequences being generated now (continuous mode)."""
        return sum(r.finished is None for r in self._live)

    @torch.inference_mode()
    def step(self) -> bool:
        """One decode step over every sequence in flight, plus a prefill of the prompts queued since
        the last step (their first token); False when there was nothing to generate. Finished rows
        go back to their callers and leave the batch (their cache rows are dropped), so no step
        computes a finished sequence."""
        alive = [i for i, r in enumerate(self._live) if r.finished is None]
        new = self.batcher.take() if self.batcher.num_pending() else []
        if not alive and not new:
            self._live, self._state, self._rebuild = [], None, False
            return False
        parts = []
        if alive and self._rebuild:  # new weights, kv_on_update=recompute: the cache of every row afresh
            parts.append(self._prefill([self._live[i] for i in alive] + new))
            new = []
        elif alive:
            if len(alive) < len(self._live):
                self._select(alive)
            parts.append(self._decode())
        if new:
            parts.append(self._prefill(new))
        self._rebuild = False
        rows, logits, state = _merge(parts)
        self.steps += 1
        temps = torch.tensor([[r.sampling.temperature] for r in rows], device=self.device)
        top_p = torch.tensor([[r.sampling.top_p] for r in rows], device=self.device)
        logp = torch.log_softmax(logits.float() / temps, dim=-1)
        tok = sample_top_p(logp, top_p, None)
        lps = logp.gather(1, tok[:, None])[:, 0].tolist()
        self.tokens_generated += len(rows)
        version = self.version
        for r, t, lp in zip(rows, tok.tolist(), lps):
            r.tokens.append(t)
            r.logprobs.append(lp)
            r.versions.append(version)
            if t in self.eos_ids or (r.sampling.stop and self._stopped(r.tokens, r.sampling.stop)):
                r.finished = "stop"
            elif len(r.tokens) >= r.sampling.max_new_tokens:
                r.finished = "length"
            if r.finished is not None:
                text = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
                self.batcher.finish(r, Generation(r.tokens, r.logprobs, text, r.finished, r.versions))
        self._live = rows
        self._state = (*state, tok)
        return True

    def _prefill(self, rows: list[Row]) -> tuple:
        """Forward the rows' whole sequences (prompt + tokens so far), left-padded: ``(rows, logits
        [B, V] of the next token, (cache, mask, last positions))``."""
        ids, mask = left_pad([r.prompt + r.tokens for r in rows], self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        self.rebuilds += 1
        return rows, out.logits[:, -1], (cache_of(out), mask, positions[:, -1:])

    def _decode(self) -> tuple:
        """One token for every row in the batch (their last sampled tokens as input)."""
        cache, mask, positions, last = self._state
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        positions = positions + 1
        out = self.model(
            input_ids=last[:, None],
            attention_mask=mask,
            position_ids=positions,
            **cache_arg(self.model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
        return self._live, out.logits[:, -1], (cache_of(out), mask, positions)

    def _select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the batch (its cache, mask, positions, last tokens)."""
        cache, mask, positions, last = self._state
        idx = torch.tensor(keep, device=self.device)
        cache.batch_select_indices(idx)
        self._live = [self._live[i] for i in keep]
        self._state = (cache, mask[idx], positions[idx], last[idx])

    # ----------------------------------------------------------------------------- weights
    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Parameters by name (tied weights appear once), detached: ``{name: tensor}``."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    @torch.no_grad()
    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy ``named_tensors`` into the model and set ``version``.

        Names must be exactly those of ``state_dict_for_sync`` (aliases of tied weights are also
        accepted), or with ``lora`` every adapter tensor (``asyncrl.weights.adapters``: merged into the base
        weights); any unknown or missing name or any shape mismatch raises ``ValueError`` before
        a single weight is changed; so does a tensor that is not float32/bfloat16/float16 or holds a NaN or
        an infinity (the actor checks each received version too: this is for callers that bypass it).
        """
        check_weight_values(named_tensors)
        if self.adapters is not None:
            self.adapters.apply(named_tensors)
        else:
            targets = dict(self.model.state_dict(keep_vars=True))
            _check_weights(named_tensors, targets, set(self.state_dict_for_sync()))
            for name, tensor in named_tensors.items():
                targets[name].data.copy_(torch.as_tensor(tensor, device=targets[name].device))
        self.version = int(version)
        if self._live and self.kv_on_update == "recompute":
            self._rebuild = True  # the next step recomputes the cache of the tokens so far

    @torch.no_grad()
    def loaded_mismatch(self, named_tensors: dict[str, torch.Tensor]) -> str | None:
        """None when the model holds exactly ``named_tensors`` (each compared in the model's own dtype:
        on a CPU by the CRC32C of both, elsewhere on the device), else what differs: the actor's check
        that an update really loaded (``asyncrl.weights.digest``). LoRA adapters merged into the weights
        are not read back (None)."""
        if self.adapters is not None:
            return None
        targets = dict(self.model.state_dict(keep_vars=True))
        held, sent = {}, {}
        for name, t in named_tensors.items():
            if name in targets:
                target = targets[name].detach()
                held[name], sent[name] = target, torch.as_tensor(t).to(target.device, target.dtype)
        if self.device.type == "cpu":
            a, b = tensor_crcs(held), tensor_crcs(sent)
            differ = [n for n in held if a[n] != b[n]]
        else:
            differ = [n for n in held if not torch.equal(held[n], sent[n])]
        if not differ:
            return None
        return (
            f"{len(differ)} of {len(named_tensors)} tensors in the engine differ from what arrived (e.g. {differ[0]})"
        )


def _merge(parts: list[tuple]) -> tuple:
    """Batches ``(rows, logits, (cache, mask, positions))`` as one: caches and masks left-padded to
    the same length and concatenated along the batch, then the columns that are padding in every
    row cut off (so the cache is as long as its longest live row)."""
    if len(parts) == 1:
        rows, logits, (cache, mask, positions) = parts[0]
    else:
        width = max(p[2][1].shape[1] for p in parts)
        rows = [r for p in parts for r in p[0]]
        logits = torch.cat([p[1] for p in parts])
        positions = torch.cat([p[2][2] for p in parts])
        mask = torch.cat([torch.nn.functional.pad(p[2][1], (width - p[2][1].shape[1], 0)) for p in parts])
        cache = parts[0][2][0]
        for i, layer in enumerate(cache.layers):
            for name in ("keys", "values"):
                tensors = [getattr(p[2][0].layers[i], name) for p in parts]
                setattr(
                    layer, name, torch.cat([torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0)) for t in tensors])
                )
    lead = int((mask.cumsum(-1) == 0).sum(-1).min())  # padding columns shared by every row
    if lead:
        mask = mask[:, lead:]
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
    return rows, logits, (cache, mask, positions)


def _check_weights(named: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], required: set[str]) -> None:
    unknown = sorted(set(named) - set(targets))
    if unknown:
        raise ValueError(
            f"update_weights: unknown parameter names {unknown[:5]}"
            f"{' ...' if len(unknown) > 5 else ''}; the model has e.g. {sorted(required)[:3]}"
        )
    covered = {n for n in required if n in named or _tied_alias_given(n, named, targets)}
    missing = sorted(required - covered)
    if missing:
        raise ValueError(
            f"update_weights: missing parameters {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} ({len(missing)} of {len(required)})"
        )
    for name, tensor in named.items():
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise ValueError(
                f"update_weights: shape mismatch for {name!r}: got {tuple(tensor.shape)}, "
                f"the model has {tuple(targets[name].shape)}"
            )


def _tied_alias_given(name: str, named: dict, targets: dict) -> bool:
    """True when another given name points at the same storage as ``name`` (tied weights)."""
    ptr = targets[name].data_ptr()
    return any(targets[n].data_ptr() == ptr for n in named)


def _eos_ids(model, tokenizer) -> set[int]:
    """EOS token ids from the tokenizer and the model's generation config."""
    ids: set[int] = set()
    for src in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src is not None:
            ids.update(int(x) for x in src)
    if not ids:
        raise ValueError("the tokenizer and model define no EOS token; set tokenizer.eos_token")
    return ids
