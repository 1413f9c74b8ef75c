"""Learner checkpoints: ``<run>/checkpoints/step_<version>/`` with the model (safetensors via
``save_pretrained``), optimizer state, learner state (version, seen episode ids), the unconsumed
buffer and ``manifest.json``.

Promises:
- A checkpoint is built in ``.tmp_step_<version>``: every file is written and fsynced, then the
  manifest (each file's size and CRC32C) is written last, then the directory is renamed into place.
  A failure while writing (disk full, ...) removes the temp directory and re-raises.
- ``select_checkpoint`` verifies checkpoints newest first against their manifests and returns the
  newest intact one, with the damaged ones it skipped and the file at fault in each.
- ``load_checkpoint`` errors name the file that failed to load.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import crc32c

from .buffer import fsync_path

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the checkpoint and the file at fault."""


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name.split("_")[1])


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories (``step_<n>``), oldest first; temp and quarantined ones are not listed."""
    root = checkpoint_root(run_dir)
    if not root.exists():
        return []
    cands = [p for p in root.glob("step_*") if p.is_dir() and p.name.split("_")[1].isdigit()]
    return sorted(cands, key=checkpoint_step)


def file_crc32c(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = crc32c.crc32c(chunk, value)
    return value


_verified: dict[tuple, str | None] = {}  # a start checks twice (before and after taking the lock)


def verify_checkpoint(path: Path) -> str | None:
    """None when every file listed in the manifest has its recorded size and CRC32C; otherwise one
    line naming the file at fault and what is wrong with it. Results are remembered for this
    process while no file of the checkpoint changes size or modification time."""
    path = Path(path)
    key = (str(path),) + tuple(sorted((str(f), f.stat().st_size, f.stat().st_mtime_ns)
                                      for f in path.rglob("*") if f.is_file()))
    if key not in _verified:
        _verified[key] = _verify(path)
    return _verified[key]


def _verify(path: Path) -> str | None:
    man_path = path / MANIFEST
    if not man_path.exists():
        return f"{man_path}: missing (an interrupted write, or a checkpoint from before manifests)"
    try:
        manifest = json.loads(man_path.read_text())
        files = manifest["files"]
        assert manifest.get("format") == MANIFEST_FORMAT and isinstance(files, dict) and files
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"{man_path}: not a manifest of format {MANIFEST_FORMAT}"
    for rel, want in files.items():
        f = path / rel
        if not f.is_file():
            return f"{f}: missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f}: {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if f"{file_crc32c(f):08x}" != want["crc32c"]:
            return f"{f}: checksum does not match the manifest (damaged bytes)"
    return None


def select_checkpoint(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest intact checkpoint (None if there is none) and the damaged newer ones skipped on
    the way, each with the problem found."""
    damaged = []
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            return ckpt, damaged
        damaged.append((ckpt, problem))
    return None, damaged


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest intact checkpoint, or None."""
    return select_checkpoint(run_dir)[0]


def quarantine(path: Path) -> Path:
    """Move a damaged checkpoint aside (``damaged-step_<n>[.k]``, kept for inspection) so that it is
    neither resumed from, counted among the kept ones, nor overwritten."""
    target = path.with_name(f"damaged-{path.name}")
    k = 1
    while target.exists():
        target = path.with_name(f"damaged-{path.name}.{k}")
        k += 1
    path.rename(target)
    return target


def save_checkpoint(run_dir: Path, version: int, model, tokenizer, optimizer, buffer, extra_state: dict,
                    keep: int, write_extra=None, states: tuple[dict, dict] | None = None) -> Path:
    """Write ``step_<version>`` and keep the newest ``keep`` checkpoints. ``write_extra(dir)``, if
    given, writes more files into the checkpoint before it is sealed (the experience replay pool).

    The optimizer state is saved keyed by parameter name (``distributed.optimizer_state``), so that
    one process, DDP and FSDP2 read each other's checkpoints. ``states``: the full ``(model state,
    optimizer state)`` already gathered from a process group's shards (rank 0's); without it they
    are taken from ``model`` and ``optimizer`` here (one process)."""
    import torch

    from .distributed import optimizer_state

    if states is None:
        states = ({k: v.detach().cpu() for k, v in model.state_dict().items()}, optimizer_state(model, optimizer))
    model_state, optim_state = states
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{version:08d}"
    tmp = root / f".tmp_step_{version:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        model.save_pretrained(tmp / "model", state_dict=model_state, safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        torch.save(optim_state, tmp / "optimizer.pt")  # local file, never sent over the wire
        buffer.save(tmp / "buffer.bin")
        if write_extra is not None:
            write_extra(tmp)
        state = {"version": version, "seen": sorted(buffer.seen), **extra_state}
        (tmp / "state.json").write_text(json.dumps(state))
        _seal(tmp, version)
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _seal(directory: Path, version: int) -> None:
    """fsync every file, then write the manifest (size and CRC32C of each) last."""
    files = {}
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        fsync_path(f)
        files[f.relative_to(directory).as_posix()] = {"size": f.stat().st_size, "crc32c": f"{file_crc32c(f):08x}"}
    manifest = {"format": MANIFEST_FORMAT, "version": version, "files": files}
    with open(directory / MANIFEST, "w") as fh:
        fh.write(json.dumps(manifest, indent=1))
        fh.flush()
        os.fsync(fh.fileno())
    for d in {f.parent for f in directory.rglob("*")} | {directory}:
        fsync_path(d)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (a second save at the same step) is moved
    aside first and removed after, so a crash in between leaves one of the two in place."""
    old = final.with_name(f".old_{final.name}")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def clean_partial(run_dir: Path) -> list[Path]:
    """Remove what an interrupted save left (``.tmp_step_*``, ``.old_step_*``); returns them."""
    root = checkpoint_root(run_dir)
    left = sorted(root.glob(".tmp_step_*")) + sorted(root.glob(".old_step_*")) if root.exists() else []
    for p in left:
        shutil.rmtree(p, ignore_errors=True)
    return left


def read_checkpoint(path: Path, model) -> tuple[dict, dict, dict]:
    """``(model state, optimizer state by parameter name, state.json)`` of a checkpoint, checked
    against ``model`` (a one-process module: the unwrapped model of any mode has the same names).
    Any failure raises CheckpointError naming the file."""
    import torch
    from safetensors.torch import load_file

    from .distributed import by_name

    weights = {}
    for f in sorted((path / "model").glob("*.safetensors")):
        weights.update(_load(f, load_file))
    expected = set(model.state_dict())
    missing = [m for m in expected - set(weights) if not m.endswith("lm_head.weight")]  # tied embeddings
    unexpected = sorted(set(weights) - expected)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not match the model: missing {sorted(missing)[:5]}, "
                              f"unexpected {unexpected[:5]}")
    optim = _load(path / "optimizer.pt", lambda f: torch.load(f, weights_only=True))
    names = [n for n, _ in model.named_parameters()]
    try:
        optim = by_name(optim, names)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path / 'optimizer.pt'}: not an optimizer state of this model ({e})") from e
    return weights, optim, _load(path / "state.json", lambda f: json.loads(f.read_text()))


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Load weights and optimizer state into a one-process ``model``/``optimizer``; returns
    ``state.json``. Any failure raises CheckpointError naming the file."""
    from .distributed import load_states

    weights, optim, state = read_checkpoint(path, model)
    try:
        load_states(model, optimizer, weights, optim)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be loaded into the model: {str(e)[:300]}") from e
    return state


def _load(f: Path, reader):
    try:
        return reader(f)
    except Exception as e:  # safetensors, torch and json each raise their own types
        raise CheckpointError(f"{f}: cannot be loaded ({type(e).__name__}: {str(e)[:200]})") from e
