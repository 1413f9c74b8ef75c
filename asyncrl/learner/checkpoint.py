"""Learner checkpoints: ``<run>/checkpoints/step_<version>/`` with the model (safetensors via
``save_pretrained``), optimizer state, learner state (version, seen episode ids) and the unconsumed
buffer. Written to a temp dir and renamed, so a crash never leaves a half checkpoint behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = checkpoint_root(run_dir)
    cands = sorted(root.glob("step_*"), key=lambda p: int(p.name.split("_")[1])) if root.exists() else []
    cands = [c for c in cands if (c / "state.json").exists()]
    return cands[-1] if cands else None


def save_checkpoint(run_dir: Path, version: int, model, tokenizer, optimizer, buffer, extra_state: dict,
                    keep: int, write_extra=None) -> Path:
    """``write_extra(dir)``, if given, writes more files into the checkpoint before it is renamed into
    place (the experience replay pool)."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{version:08d}"
    tmp = root / f".tmp_step_{version:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "model")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")  # local file, never sent over the wire
    buffer.save(tmp / "buffer.bin")
    state = {"version": version, "seen": sorted(buffer.seen), **extra_state}
    if write_extra is not None:
        write_extra(tmp)
    (tmp / "state.json").write_text(json.dumps(state))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(root.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model, optimizer) -> dict:
    from safetensors.torch import load_file

    weights = {}
    for f in sorted((path / "model").glob("*.safetensors")):
        weights.update(load_file(f))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    real_missing = [m for m in missing if not m.endswith("lm_head.weight")]  # tied embeddings
    if real_missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {real_missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    return json.loads((path / "state.json").read_text())
