"""Filesystem weight sync: the learner writes ``weights-<version>.safetensors`` atomically and
actors load it from the path they are sent. For actors that share a filesystem with the learner."""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import load_file, save_file


def save_weights_file(state: dict, version: int, sync_cfg, run_dir: Path) -> str | None:
    """Write the tensors for filesystem sync and return the path; None for other transports."""
    if sync_cfg.type != "filesystem":
        return None
    directory = Path(sync_cfg.dir or Path(run_dir) / "weights").resolve()
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"weights-{version:08d}.safetensors"
    tmp = final.with_suffix(".tmp")
    save_file(state, str(tmp), metadata={"version": str(version)})
    os.replace(tmp, final)
    for old in sorted(directory.glob("weights-*.safetensors"))[:-sync_cfg.keep]:
        old.unlink(missing_ok=True)
    return str(final)


def load_weights_file(path: str) -> dict:
    if not Path(path).exists():
        raise OSError(f"weights file {path} does not exist (filesystem sync needs a shared filesystem)")
    return load_file(path)
