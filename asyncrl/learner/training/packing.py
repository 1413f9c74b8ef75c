"""Padding-free layout for the learner's forward: rows packed into bins, a prompt shared by its
completions computed once.

A batch's rows (``B`` rows, the longest ``T`` tokens) go into ``R`` bins of ``W`` slots each
(``W`` at least the longest row). A bin holds *segments*: a whole row, or a prompt (the tokens before
a row's first trained token) followed, anywhere later in the same bin, by the suffixes of the rows
that share it. Each slot carries its token, its position id (its index in its own row) and a
segment id; a slot attends to the earlier slots of its own segment and to every slot of its
segment's parent (a suffix's prompt). So every row sees exactly the tokens it would see alone, at the
same positions, and its log-probs are those of a padded forward up to float rounding.

Attention paths (``train.attention``, :mod:`.attention`):

- ``mask``: a block mask ``[R, 1, W, W]`` given to the model as a ready 4D mask (:func:`mask_for`:
  boolean for ``sdpa``, additive for ``eager``), with shared prompts; under a model's own flash
  variable-length kernel (``flash_attention_2/3``), position ids alone (one flat bin, no shared prompts);
- ``flex``: one flat bin (``flat=True``) with shared prompts, its document mask built from the slots'
  segment and parent ids as a flex attention ``BlockMask`` (blocks no segment reaches are skipped);
- ``varlen``: one flat bin (``varlen=True``), no shared prompts, each row a sequence of its own for a
  variable-length kernel (:func:`cu_seqlens`), no mask.

``token_index[b, t]`` is the flat slot (``r * W + w``) holding token ``t`` of row ``b`` (-1 past its
end), which is all :func:`asyncrl.learner.training.batch.compute_logprobs` needs to put every
per-token value back in the padded ``[B, T-1]`` layout the losses read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["PackedRows", "attention_kind", "cu_seqlens", "mask_for", "model_config", "pack_rows", "varlen_attention"]

_VARLEN = ("flash_attention_2", "flash_attention_3", "flash")


def model_config(model):
    """The model's config through DDP's ``module`` and peft's ``base_model`` wrappers (None: none)."""
    config = getattr(model, "config", None)
    for _ in range(8):  # DDP's module, peft's base model
        if config is not None or model is None:
            break
        model = getattr(model, "module", None) or getattr(model, "base_model", None)
        config = getattr(model, "config", None)
    return config


def attention_kind(model) -> str:
    """The model's attention implementation (``config._attn_implementation``, through DDP's and
    peft's wrappers): ``sdpa``, ``eager``, ``flash_attention_2``..., or "" when it says none."""
    return str(getattr(model_config(model), "_attn_implementation", "") or "")


def varlen_attention(model) -> bool:
    """Whether the model's attention runs packed sequences from position ids alone (a flash
    variable-length kernel), so that no mask is built."""
    impl = attention_kind(model)
    return any(name in impl for name in _VARLEN)


def mask_for(model, attention: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The block mask as the model's attention takes a ready 4D mask: boolean (True = attend) for
    SDPA, additive (0, or the dtype's minimum where a slot may not attend) for eager attention and
    any other implementation that adds the mask to its scores."""
    if attention is None or attention_kind(model) == "sdpa":
        return attention
    return torch.zeros(attention.shape, dtype=dtype, device=attention.device).masked_fill(
        ~attention, torch.finfo(dtype).min
    )


@dataclass
class PackedRows:
    """One packed forward's inputs (see the module docstring)."""

    input_ids: Tensor  # long [R, W]
    position_ids: Tensor  # long [R, W]
    attention: Tensor | None  # bool [R, 1, W, W], True = attend; None: one flat bin (flex, varlen)
    token_index: Tensor  # long [B, T], flat slot of token t of row b; -1 past the row's end
    slots_used: int  # slots holding a token (a shared prompt once per bin)
    shared_rows: int  # rows that read their prompt from a segment another row reads too
    segments: Tensor | None = None  # long [R, W]: each slot's segment (-1: padding)
    parents: Tensor | None = None  # long [R, W]: the segment each slot also reads (a suffix's prompt; else its own)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.input_ids.shape[0]), int(self.input_ids.shape[1])


class _Bins:
    """First-fit bins of ``width`` slots: token, position, segment and parent segment per slot."""

    def __init__(self, width: int):
        self.width = width
        self.slots: list[list[tuple[int, int, int, int]]] = []
        self.segments = 0

    def room(self, r: int) -> int:
        return self.width - len(self.slots[r])

    def first_fit(self, need: int) -> int:
        for r in range(len(self.slots)):
            if self.room(r) >= need:
                return r
        self.slots.append([])
        return len(self.slots) - 1

    def put(self, r: int, tokens: np.ndarray, first_position: int, parent: int | None) -> list[int]:
        """A new segment of ``tokens`` in bin ``r``; returns its flat slots."""
        seg = self.segments
        self.segments += 1
        start = len(self.slots[r])
        self.slots[r].extend(
            (int(tok), first_position + i, seg, seg if parent is None else parent) for i, tok in enumerate(tokens)
        )
        return [r * self.width + start + i for i in range(len(tokens))]

    def segment_of(self, flat_slot: int) -> int:
        return self.slots[flat_slot // self.width][flat_slot % self.width][2]


def _groups(rows: list[np.ndarray], starts: list[int] | None) -> list[list[int]]:
    """Rows grouped by their prompt (``starts``: each row's first trained token; None: no sharing),
    largest total first; a group of one is a whole row."""
    if starts is None:
        groups = [[b] for b in range(len(rows))]
    else:
        by_key: dict[bytes, list[int]] = {}
        for b, (row, s) in enumerate(zip(rows, starts)):
            by_key.setdefault(row[:s].tobytes() if 0 < s < len(row) else b"row%d" % b, []).append(b)
        groups = list(by_key.values())
    return sorted(groups, key=lambda g: -sum(len(rows[b]) for b in g))


def pack_rows(
    input_ids: Tensor,
    lengths: Tensor,
    width: int | None = None,
    starts: Tensor | None = None,
    varlen: bool = False,
    pad_id: int = 0,
    flat: bool = False,
    multiple: int = 1,
) -> PackedRows:
    """Pack the rows of ``input_ids[B, T]`` (row ``b`` is its first ``lengths[b]`` tokens) into
    bins of ``width`` slots (default and minimum: the longest row). ``starts[b]``: the index of row
    ``b``'s first trained token; rows with the same tokens before it share one prompt segment per bin.
    ``flat``: one bin of all tokens, a prompt once in it, no block mask built (flex attention);
    ``varlen``: one bin of all tokens, prompts not shared (a variable-length kernel). A flat bin's
    width is its tokens rounded up to ``multiple``."""
    ids = input_ids.detach().cpu().numpy()
    n = [int(x) for x in lengths.detach().cpu().tolist()]
    B, T = ids.shape
    rows = [ids[b, : n[b]] for b in range(B)]
    longest = max(max(n, default=1), 1)
    if varlen:
        starts = None
    if varlen or flat:
        width = max(sum(n), 1)
    width = max(int(width or longest), longest)
    start_list = None if starts is None else [int(s) for s in starts.detach().cpu().tolist()]
    bins = _Bins(width)
    token_index = np.full((B, T), -1, dtype=np.int64)
    shared_rows = 0
    for group in _groups(rows, start_list):
        if len(group) == 1:
            b = group[0]
            if n[b]:
                token_index[b, : n[b]] = bins.put(bins.first_fit(n[b]), rows[b], 0, None)
            continue
        p = start_list[group[0]]
        prompt_slots: list[int] | None = None
        for b in sorted(group, key=lambda b: -n[b]):
            suffix = rows[b][p:]
            r = None if prompt_slots is None else prompt_slots[0] // width
            if r is None or bins.room(r) < len(suffix):  # this bin has no room left: the prompt again
                r = bins.first_fit(p + len(suffix))
                prompt_slots = bins.put(r, rows[b][:p], 0, None)
            else:
                shared_rows += 1
            token_index[b, :p] = prompt_slots
            token_index[b, p : n[b]] = bins.put(r, suffix, p, bins.segment_of(prompt_slots[0]))
    if varlen or flat:  # (the one bin's slot numbers are its positions: any width above its tokens keeps them)
        used = sum(len(s) for s in bins.slots)
        bins.width = -(-max(used, 1) // multiple) * multiple
    return _tensors(bins, token_index, varlen or flat, pad_id, shared_rows, input_ids.device)


def _tensors(bins: _Bins, token_index: np.ndarray, varlen: bool, pad_id: int, shared_rows: int, device) -> PackedRows:
    """The bins' tensors; ``varlen``: one flat bin, no block mask (its trailing padding one sequence)."""
    R, W = max(len(bins.slots), 1), bins.width
    table = np.zeros((R, W, 4), dtype=np.int64)
    table[..., 0] = pad_id
    table[..., 2:] = -1  # padding: segment -1 (it attends to the padding before it only)
    for r, slots in enumerate(bins.slots):
        if slots:
            table[r, : len(slots)] = slots
    used = sum(len(s) for s in bins.slots)
    if varlen:  # trailing padding restarts at position 0: a sequence of its own for the kernel
        tail = np.arange(W - used)
        table[0, used:, 1] = tail
    else:
        for r, slots in enumerate(bins.slots):
            table[r, len(slots) :, 1] = np.arange(W - len(slots))
    t = torch.from_numpy(table)
    attention = None
    if not varlen:
        seg, parent = t[..., 2], t[..., 3]
        causal = torch.ones(W, W, dtype=torch.bool, device=t.device).tril()  # (built on the host, then moved)
        same = seg[:, :, None] == seg[:, None, :]
        reads_parent = parent[:, :, None] == seg[:, None, :]
        attention = ((same | reads_parent) & causal)[:, None].to(device)
    return PackedRows(
        t[..., 0].to(device),
        t[..., 1].to(device),
        attention,
        torch.from_numpy(token_index).to(device),
        used,
        shared_rows,
        t[..., 2].to(device),
        t[..., 3].to(device),
    )


def cu_seqlens(packed: PackedRows) -> tuple[Tensor, int]:
    """A flat bin's sequences for a variable-length kernel: ``(cu_seqlens int32 [N + 1], longest)``,
    each segment (a row) one sequence, the trailing padding one more (so that every slot's output is
    computed). Refused for a bin whose suffixes read a shared prompt (another segment)."""
    seg = packed.segments[0].cpu()
    if packed.shape[0] != 1 or bool((packed.parents[0].cpu() != seg).any()):
        raise ValueError("a variable-length kernel takes one flat bin of whole rows (no shared prompts)")
    change = torch.nonzero(seg[1:] != seg[:-1]).flatten() + 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), change, torch.tensor([seg.numel()])])
    return bounds.to(torch.int32).to(packed.segments.device), int((bounds[1:] - bounds[:-1]).max())
