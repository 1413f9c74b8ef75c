"""The learner's attention over packed rows (``train.attention``), without a dense block mask.

A packed forward (:mod:`.packing`) must keep every row from seeing another's tokens. Four ways:

- ``varlen``: one flat bin, each row a sequence of its own, through torch's variable-length flash
  kernel (``torch.nn.attention.varlen.varlen_attn``, cumulative sequence lengths: no mask at all).
  CUDA, bfloat16/float16. Prompts are not shared (a suffix would read another sequence).
- ``flex``: one flat bin with shared prompts, through flex attention: the document mask (a slot reads
  the earlier slots of its segment and its segment's prompt) as a ``BlockMask``, so the blocks no
  segment reaches are never computed. Compiled on CUDA. torch runs it on CPU without a backward.
- ``mask``: bins of the longest rows and a dense ``[bins, 1, W, W]`` block mask given to SDPA or eager
  attention (the CPU's path; on CUDA SDPA's dense mask costs more than the padding it saves).
- ``padded``: every row padded to the longest (the reference; ``train.packing=false`` is the same).

``auto`` is ``mask`` on a CPU and, on CUDA, the fastest of ``varlen``, ``flex`` and ``padded`` on the
first micro-batch of the run (each run twice, the second timed; with ``train.deterministic`` the first
that is available, since another path rounds differently). The choice is printed with the times.

Sliding-window layers (``sliding_window`` in a layer's attention call: Mistral, Qwen2 with
``use_sliding_window``, Gemma's local layers) are handled by ``varlen`` (the kernel's window) and
``flex`` (in the mask); the dense ``mask`` path cannot tell layers apart and is refused for such a
model in one line (``auto`` takes ``padded`` there on a CPU).

The two new paths are attention functions registered with transformers (``AttentionInterface``) under
``asyncrl_varlen`` and ``asyncrl_flex``; :func:`packed_attention` switches the model's implementation to
one of them for one forward and hands them the packed layout. Their backward runs inside autograd's
graph, so nothing reads the switched setting after the forward (no activation checkpointing here).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import inspect
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .packing import PackedRows, attention_kind, cu_seqlens, model_config

__all__ = ["PATHS", "available", "choose", "document_mask", "measure", "packed_attention", "sliding_window_of"]

PATHS = ("auto", "varlen", "flex", "mask", "padded")
_NAMES = {"varlen": "asyncrl_varlen", "flex": "asyncrl_flex"}
FLEX_BLOCK = 128  # flex attention's block size: a flat bin's width is rounded up to it


@dataclass
class _Layout:
    """What a registered attention function needs of the packed forward in progress."""

    packed: PackedRows
    cu: Tensor | None = None  # varlen: int32 [N + 1]
    longest: int = 0
    masks: dict = field(default_factory=dict)  # flex: BlockMask by sliding window (None: full)


_ACTIVE: contextvars.ContextVar[_Layout | None] = contextvars.ContextVar("asyncrl_packed_attention", default=None)


def _layout() -> _Layout:
    layout = _ACTIVE.get()
    if layout is None:
        raise RuntimeError(
            "an asyncrl packed-attention function was called outside a packed forward "
            "(asyncrl.learner.training.attention.packed_attention)"
        )
    return layout


# --- varlen ------------------------------------------------------------------------------------------


def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> frozenset:
    """A function's keyword names, read once (not at every layer of every forward)."""
    return frozenset(inspect.signature(fn).parameters)


def _kernel_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, scale: float | None, window: int | None
) -> Tensor:
    """torch's flash variable-length kernel on ``[T, H, D]`` tensors, causal (within ``window``). Its
    keyword arguments changed across torch releases (``is_causal`` in 2.10-2.11, ``window_size`` later;
    ``enable_gqa`` later still): taken from its signature."""
    fn = _torch_varlen()
    params = _parameters(fn)
    kw: dict = {"scale": scale}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    if "window_size" in params:
        kw["window_size"] = (window - 1 if window else -1, 0)
    elif window:
        raise ValueError(
            f"train.attention=varlen: this torch's varlen_attn has no sliding window (a layer's "
            f"window is {window}); use train.attention=flex or padded"
        )
    else:
        kw["is_causal"] = True
    return fn(q, k, v, cu, cu, longest, longest, **kw)


def reference_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, scale: float | None, window: int | None
) -> Tensor:
    """What the kernel computes, one sequence at a time through SDPA (any device and dtype): the
    check of the layout's arithmetic on a CPU, where the kernel does not run."""
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        n = b - a
        i = torch.arange(n, device=q.device)
        allowed = i[None, :] <= i[:, None]
        if window:
            allowed &= i[:, None] - i[None, :] < window
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), attn_mask=allowed, scale=scale
        ).transpose(0, 1)
    return out


VARLEN_KERNEL = _kernel_varlen  # (tests on a CPU put reference_varlen here)


def _varlen_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    scaling=None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap=None,
    **kwargs,
):
    """transformers' attention-function contract: ``query [1, H, T, D]``, ``key``/``value`` ``[1, Hkv, T, D]``
    -> ``([1, T, H, D], None)``."""
    layout = _layout()
    if softcap:
        raise ValueError("train.attention=varlen: attention logit soft-capping is not supported; use padded")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    out = VARLEN_KERNEL(q, k, v, layout.cu, layout.longest, scaling, sliding_window)
    return out[None], None


# --- flex --------------------------------------------------------------------------------------------

_COMPILED: dict = {}


def _flex_fn(device: torch.device):
    """flex attention, compiled on CUDA (once per process; torch's automatic dynamic shapes take
    the micro-batches' widths), eager elsewhere (torch runs it on a CPU without a backward)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _COMPILED:
        _COMPILED["cuda"] = torch.compile(flex_attention)
    return _COMPILED["cuda"]


def document_mask(packed: PackedRows, window: int | None):
    """The flat bin's document mask as a flex ``mask_mod``: slot q reads slot kv <= q of its own segment
    or of its segment's parent (a suffix's prompt), within ``window`` positions (None: no window)."""
    seg, parent, pos = packed.segments[0], packed.parents[0], packed.position_ids[0]

    def reads(b, h, q, kv):
        ok = (kv <= q) & ((seg[kv] == seg[q]) | (seg[kv] == parent[q]))
        return ok & (pos[q] - pos[kv] < window) if window else ok

    return reads


def _block_mask(layout: _Layout, window: int | None):
    """:func:`document_mask` as a ``BlockMask`` (blocks it never reaches are skipped), once per window."""
    mask = layout.masks.get(window)
    if mask is None:
        from torch.nn.attention.flex_attention import create_block_mask

        W = layout.packed.shape[1]
        mask = create_block_mask(
            document_mask(layout.packed, window),
            None,
            None,
            W,
            W,
            device=layout.packed.segments.device,
            BLOCK_SIZE=FLEX_BLOCK,
        )
        layout.masks[window] = mask
    return mask


def _flex_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    scaling=None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap=None,
    **kwargs,
):
    layout = _layout()
    if softcap:
        raise ValueError("train.attention=flex: attention logit soft-capping is not supported here; use padded")
    out = _flex_fn(query.device)(
        query,
        key,
        value,
        block_mask=_block_mask(layout, sliding_window),
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(_NAMES["varlen"], _varlen_attention)
    AttentionInterface.register(_NAMES["flex"], _flex_attention)


_register()


# --- the switch ----------------------------------------------------------------------------------------


def _config(model):
    """The model's config (:func:`.packing.model_config`); ValueError without one."""
    config = model_config(model)
    if config is None:
        raise ValueError("train.attention: the model has no config to set its attention implementation on")
    return config


@contextlib.contextmanager
def packed_attention(model, path: str, packed: PackedRows):
    """For one forward: the model's attention is ``path``'s registered function, reading ``packed``."""
    layout = _Layout(packed)
    if path == "varlen":
        layout.cu, layout.longest = cu_seqlens(packed)
    config = _config(model)
    before = config._attn_implementation
    token = _ACTIVE.set(layout)
    config._attn_implementation = _NAMES[path]
    try:
        yield
    finally:
        config._attn_implementation = before
        _ACTIVE.reset(token)


# --- which path --------------------------------------------------------------------------------------


def sliding_window_of(model) -> int | None:
    """The smallest sliding window any layer of ``model`` attends within (None: every layer full)."""
    config = _config(model)
    config = getattr(config, "get_text_config", lambda: config)()
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    return None if getattr(config, "use_sliding_window", True) is False else int(window)


def available(path: str, model, device: str | torch.device, training: bool = True) -> str | None:
    """Why ``path`` cannot run ``model`` on ``device`` (None: it can)."""
    device = torch.device(device)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    impl = attention_kind(model)
    if path == "padded":
        return None
    if path == "mask":
        window = sliding_window_of(model)
        return (
            (
                f"the model has sliding-window layers (window {window}), which one dense block mask cannot "
                f"express; train.attention=flex or varlen on CUDA, or padded"
            )
            if window
            else None
        )
    if impl and impl not in ("sdpa", "eager", *_NAMES.values()):
        return f"the model's own attention ({impl}) packs with position ids: train.attention=mask"
    if path == "varlen":
        if _torch_varlen() is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen"
        if device.type != "cuda":
            return "torch's varlen_attn is a CUDA kernel (this learner runs on " + device.type + ")"
        if dtype not in (torch.bfloat16, torch.float16):
            return (
                f"torch's varlen_attn takes bfloat16 or float16 (the model is {str(dtype).split('.')[-1]}: model.dtype)"
            )
        return None
    if path == "flex":
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
            return f"torch {torch.__version__} has no flex attention"
        if training and device.type != "cuda":
            return "torch runs flex attention's backward on CUDA only"
        return None
    raise ValueError(f"train.attention: unknown path {path!r}; one of {', '.join(PATHS)}")


def choose(
    setting: str, packing: bool, model, device, deterministic: bool = False, recompute: bool = False
) -> tuple[str | None, list[str]]:
    """``(path, candidates)``: the path ``setting`` (train.attention) gives for ``model`` on ``device``,
    or None with the candidates :func:`measure` times (auto on CUDA). A named path that cannot run is
    a ValueError saying why. ``recompute`` (gradient checkpointing: the backward runs the layers again,
    after the forward's layout was handed back) leaves varlen and flex out."""
    if not packing or setting == "padded":
        return "padded", []
    if setting != "auto":
        why = available(setting, model, device)
        if recompute and setting in _NAMES:
            why = "train.gradient_checkpointing recomputes the layers in the backward, where this path's layout is gone"
        if why:
            raise ValueError(f"train.attention={setting}: {why}; use mask or padded")
        return setting, []
    if torch.device(device).type != "cuda":
        return ("mask" if available("mask", model, device) is None else "padded"), []
    if recompute:  # (on CUDA the dense mask costs more than the padding it saves)
        return "padded", []
    candidates = [p for p in ("varlen", "flex") if available(p, model, device) is None] + ["padded"]
    return (candidates[0], []) if deterministic or len(candidates) == 1 else (None, candidates)


def measure(candidates: list[str], run, sync=None) -> tuple[str, dict[str, float]]:
    """The fastest of ``candidates``: ``run(path)`` twice each (the first warms up and compiles), the
    second timed. A path that fails is left out (its error in the times as NaN)."""
    times: dict[str, float] = {}
    for path in candidates:
        try:
            run(path)
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            run(path)
            if sync is not None:
                sync()
            times[path] = time.perf_counter() - t0
        except Exception as e:  # (a compile failure, a kernel this card lacks, out of memory): not a candidate
            times[path] = float("nan")
            print(
                f"[learner] train.attention=auto: {path} failed on the first micro-batch "
                f"({type(e).__name__}: {str(e)[:300]}); left out",
                flush=True,
            )
    ok = {p: t for p, t in times.items() if t == t}
    if not ok:
        raise RuntimeError("train.attention=auto: every candidate failed on the first micro-batch")
    return min(ok, key=ok.get), times
