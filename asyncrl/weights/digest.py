"""A receipt for each weight version: the digest of the tensors the learner published, and the
actor's check that its engine holds exactly what arrived.

- :func:`weights_digest` is SHA-256 over every tensor in name order: its name, dtype, shape and the
  CRC32C of its raw bytes (the hardware instruction: about 10 GB/s on one core, ten times SHA-256 of
  the bytes, so that the learner's step barely notices it; large tensors on threads of their own,
  the library releases the interpreter lock). It detects a damaged transfer and an update that did
  not take (2^-32 odds per changed tensor of missing it); it is not a signature: the channel's
  CURVE keys say who sent it. The learner computes it over the tensors it sends (LoRA: the adapter
  tensors) and puts it in the ``weights`` message; the actor computes it over what it received,
  before its engine takes any of it.
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

import crc32c
import torch

_POOL: ThreadPoolExecutor | None = None
_SMALL = 8 << 20  # tensors under 8 MiB are hashed on the calling thread


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
    return crc32c.crc32c(_tensor_bytes(t)).to_bytes(4, "little")


def tensor_crcs(named: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """Each tensor's CRC32C (4 bytes), large tensors on the thread pool."""
    big = {n: _pool().submit(_hash_tensor, t) for n, t in named.items() if t.numel() * t.element_size() >= _SMALL}
    return {n: big[n].result() if n in big else _hash_tensor(t) for n, t in named.items()}


def weights_digest(named: dict[str, torch.Tensor]) -> str:
    """The SHA-256 of ``named`` (name order; each tensor's name, dtype, shape and bytes' CRC32C), as hex."""
    crcs = tensor_crcs(named)
    out = hashlib.sha256()
    for n in sorted(named):
        t = named[n]
        out.update(f"{n}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode())
        out.update(crcs[n])
    return out.hexdigest()


def short(digest: str | None) -> str:
    """The first 12 hex digits, for messages."""
    return (digest or "none")[:12]
