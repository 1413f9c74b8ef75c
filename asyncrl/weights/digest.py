"""A receipt for each weight version: the digest of the tensors the learner published, and the
actor's check that its engine holds exactly what arrived.

- :func:`weights_digest` is SHA-256 over every tensor in name order: its name, dtype, shape and raw
  bytes (a tensor's bytes are hashed on a thread of their own: hashlib gives up the interpreter lock
  for large buffers, so a 0.5B bf16 version is hashed on every core). The learner computes it over
  the tensors it sends (LoRA: the adapter tensors) and puts it in the ``weights`` message; the actor
  computes it over what it received, before its engine takes any of it.
- ``Engine.loaded_mismatch`` (the HF engine reads its parameters back; see the engine) says whether
  the engine holds what arrived, in the engine's own dtype.

A version whose received digest differs from the published one, or that the engine did not take, is
not generated with: the actor says so in one line naming itself and the version, and asks for the
weights again. Every episode carries the digest of each version that generated it, and the learner
refuses an episode whose digest is not the one it published for that version.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

_POOL: ThreadPoolExecutor | None = None
_SMALL = 1 << 20  # tensors under 1 MiB are hashed on the calling thread


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="digest")
    return _POOL


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _hash_tensor(t: torch.Tensor) -> bytes:
    return hashlib.sha256(_tensor_bytes(t)).digest()


def weights_digest(named: dict[str, torch.Tensor]) -> str:
    """The SHA-256 of ``named`` (name order; each tensor's name, dtype, shape and bytes), as hex."""
    names = sorted(named)
    big = {
        n: _pool().submit(_hash_tensor, named[n]) for n in names if named[n].numel() * named[n].element_size() >= _SMALL
    }
    out = hashlib.sha256()
    for n in names:
        t = named[n]
        inner = big[n].result() if n in big else _hash_tensor(t)
        out.update(f"{n}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode())
        out.update(inner)
    return out.hexdigest()


def short(digest: str | None) -> str:
    """The first 12 hex digits, for messages."""
    return (digest or "none")[:12]
