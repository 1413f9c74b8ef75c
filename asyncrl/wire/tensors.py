"""Tensors as bytes: the one routine every transport uses (wire frames, shared-memory segments,
collective broadcasts, the learner group's control channel). Nothing is pickled.

- ``DTYPES``: the dtypes that travel, by wire name, as little-endian numpy dtypes (``bfloat16``,
  torch only, travels as its raw 16-bit pattern, a ``uint16`` array).
- :func:`as_numpy` / :func:`to_torch`: one tensor or array as a C-contiguous little-endian numpy
  array (a view where possible) and back (sharing memory), for frames of their own.
- :func:`plan_layout` / :func:`pack` / :func:`unpack`: many tensors in one flat byte buffer, each at
  a 64-byte aligned offset that a :class:`~asyncrl.wire.messages.TensorSpec` names (with its dtype,
  shape and byte count); ``unpack`` gives views, no copy.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import numpy as np

from .messages import TensorSpec

ALIGN = 64

# wire name -> little-endian numpy dtype ("bfloat16" is carried as its uint16 bit pattern)
DTYPES: dict[str, np.dtype] = {
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "bool": np.dtype("?"),
    "bfloat16": np.dtype("<u2"),
}
_NP_TO_WIRE = {np.dtype(v).newbyteorder("="): k for k, v in DTYPES.items() if k != "bfloat16"}


def torch_dtype(name: str):
    """The torch dtype of wire name ``name`` (ValueError for one that does not travel)."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} does not travel; expected one of {sorted(DTYPES)}")
    return getattr(torch, name)


def wire_name(tensor) -> str:
    """The wire name of a torch tensor's dtype (ValueError for one that does not travel)."""
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {name} does not travel; expected one of {sorted(DTYPES)}")
    return name


def itemsize(name: str) -> int:
    return DTYPES[name].itemsize


def as_numpy(name: str, value: Any) -> tuple[np.ndarray, str]:
    """A C-contiguous little-endian numpy array (a view where possible) and its wire dtype, from a
    numpy array or a CPU/GPU torch tensor (GPU ones are copied to the CPU)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach()
        t = (t if t.device.type == "cpu" else t.cpu()).contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(DTYPES["bfloat16"]), "bfloat16"
        value = t.numpy()
    arr = np.asarray(value)
    wire = _NP_TO_WIRE.get(arr.dtype.newbyteorder("="))
    if wire is None:
        raise ValueError(f"array '{name}' has dtype {arr.dtype}, expected one of {sorted(DTYPES)}")
    return arr.astype(DTYPES[wire], order="C", copy=False), wire


def to_torch(arr: np.ndarray, is_bf16: bool):
    """``arr`` as a torch tensor sharing its memory (bfloat16 where it holds bf16 bit patterns)."""
    import torch

    with warnings.catch_warnings():  # read-only arrays (from bytes) are copied by callers first
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(arr.view(np.int16) if is_bf16 else arr)
    return t.view(torch.bfloat16) if is_bf16 else t


def plan_layout(state: dict[str, Any]) -> tuple[list[TensorSpec], int]:
    """Each torch tensor's place in one flat byte buffer (``ALIGN``-byte aligned) and the buffer's size."""
    layout, offset = [], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        layout.append(TensorSpec(name=name, dtype=wire_name(t), shape=list(t.shape), offset=offset, nbytes=nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return layout, offset


def pack(dst, layout: list[TensorSpec], state: dict[str, Any]) -> None:
    """Copy ``state``'s tensors into the uint8 tensor ``dst`` at the places ``layout`` gives them."""
    import torch

    for t, tensor in zip(layout, state.values()):
        dst[t.offset : t.offset + t.nbytes].copy_(tensor.detach().reshape(-1).contiguous().view(torch.uint8))


def unpack(buf, layout: list[TensorSpec]) -> dict[str, Any]:
    """The tensors of ``layout`` as views of the uint8 tensor ``buf`` (no copy)."""
    return {t.name: buf[t.offset : t.offset + t.nbytes].view(torch_dtype(t.dtype)).view(t.shape) for t in layout}


def check_layout(layout: list[TensorSpec], size: int) -> str | None:
    """What is wrong with a layout received from a peer for a buffer of ``size`` bytes, or None:
    known dtypes, byte counts that match shapes, aligned offsets, everything inside the buffer."""
    for t in layout:
        if t.dtype not in DTYPES:
            return f"tensor {t.name}: dtype {t.dtype!r} is not one of {sorted(DTYPES)}"
        if t.nbytes != math.prod(t.shape) * itemsize(t.dtype) or t.offset % ALIGN or t.offset + t.nbytes > size:
            return (
                f"tensor {t.name}: {t.nbytes} bytes at offset {t.offset} do not fit shape {t.shape} of "
                f"{t.dtype} in a buffer of {size} bytes"
            )
    return None
