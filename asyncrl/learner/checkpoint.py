"""Learner checkpoints: ``<run>/checkpoints/step_<version>/`` with the model (safetensors via
``save_pretrained``; with ``model.lora`` the adapters only, in peft's format, whose
``adapter_config.json`` names the base model), optimizer state, learner state (version, seen episode ids), the unconsumed
buffer and ``manifest.json``.

Promises:
- A checkpoint is built in ``.tmp_step_<version>``: every file is written and fsynced, then the
  manifest (each file's size and CRC32C) is written last, then the directory is renamed into place.
  A failure while writing (disk full, ...) removes the temp directory and re-raises.
- ``select_checkpoint`` (``asyncrl.rundir.layout``, with the listing) verifies checkpoints newest first against their manifests and returns the
  newest intact one, with the damaged ones it skipped and the file at fault in each.
- ``load_checkpoint`` errors name the file that failed to load.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from ..models.lora import adapter_state, is_lora, read_adapters, settings_of
from ..rundir.layout import (
    CRITIC,
    MANIFEST,
    MANIFEST_FORMAT,
    CheckpointError,
    checkpoint_dir,
    checkpoint_root,
    file_crc32c,
    fsync_path,
    list_checkpoints,
    replace_dir,
)
from ..weights.adapters import ADAPTER, ADAPTER_CONFIG, write_adapters


def save_checkpoint(
    run_dir: Path,
    version: int,
    model,
    tokenizer,
    optimizer,
    buffer,
    extra_state: dict,
    keep: int,
    write_extra=None,
    states: tuple[dict, dict] | None = None,
) -> Path:
    """Write ``step_<version>`` and keep the newest ``keep`` checkpoints. ``write_extra(dir)``, if
    given, writes more files into the checkpoint before it is sealed (the experience replay pool).

    The optimizer state is saved keyed by parameter name (``distributed.optimizer_state``), so that
    one process, DDP and FSDP2 read each other's checkpoints. ``states``: the full ``(model state,
    optimizer state)`` already gathered from a process group's shards (rank 0's); without it they
    are taken from ``model`` and ``optimizer`` here (one process)."""
    import torch

    from .training.distributed import optimizer_state

    if states is None:
        states = ({k: v.detach().cpu() for k, v in model.state_dict().items()}, optimizer_state(model, optimizer))
    model_state, optim_state = states
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(run_dir, version)
    tmp = final.with_name(f".tmp_{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        if is_lora(model):  # the adapters, and the base model's name (asyncrl export --merge merges them)
            config = model.peft_config[ADAPTER]
            write_adapters(
                tmp / "model", adapter_state(model_state), settings_of(config.to_dict()), config.base_model_name_or_path
            )
        else:
            model.save_pretrained(tmp / "model", state_dict=model_state, safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        torch.save(optim_state, tmp / "optimizer.pt")  # local file, never sent over the wire
        buffer.save(tmp / "buffer.bin")
        if write_extra is not None:
            write_extra(tmp)
        state = {"version": version, "seen": sorted(buffer.seen), **extra_state}
        (tmp / "state.json").write_text(json.dumps(state))
        _seal(tmp, version)
        replace_dir(tmp, final)
    except Exception as e:  # a full disk: OSError, or the writers' own errors (torch.save's RuntimeError "file
        try:  # write failed", safetensors' SafetensorError): all an OSError, which stops the learner in one line
            full = shutil.disk_usage(root).free < 1 << 20
        except OSError:
            full = False
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) or not (full or "writ" in str(e).lower()):
            raise
        raise OSError(
            errno.ENOSPC if full else errno.EIO,
            f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:160]}",
            str(tmp),
        ) from None
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


def read_checkpoint(path: Path, model) -> tuple[dict, dict, dict]:
    """``(model state, optimizer state by parameter name, state.json)`` of a checkpoint, checked
    against ``model`` (a one-process module: the unwrapped model of any mode has the same names).
    Any failure raises CheckpointError naming the file."""
    import torch
    from safetensors.torch import load_file

    from .training.distributed import by_name

    weights = {}
    lora = is_lora(model)
    if lora != (path / "model" / ADAPTER_CONFIG).exists():
        raise CheckpointError(
            f"checkpoint {path} holds {'full weights' if lora else 'LoRA adapters'}; this run "
            f"has model.lora {'on' if lora else 'off'}: resume with the model.lora it was "
            f"written with"
        )
    if lora:
        weights = _load(path / "model", lambda d: read_adapters(d)[0])
    else:
        for f in sorted((path / "model").glob("*.safetensors")):
            weights.update(_load(f, load_file))
    expected = set(adapter_state(model.state_dict()) if lora else model.state_dict())
    missing = [m for m in expected - set(weights) if not m.endswith("lm_head.weight")]  # tied embeddings
    unexpected = sorted(set(weights) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not match the model: missing {sorted(missing)[:5]}, unexpected {unexpected[:5]}"
        )
    optim = _load(path / "optimizer.pt", lambda f: torch.load(f, weights_only=True))
    names = [n for n, p in model.named_parameters() if p.requires_grad]  # the optimizer's parameters, in order
    try:
        optim = by_name(optim, names)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path / 'optimizer.pt'}: not an optimizer state of this model ({e})") from e
    return weights, optim, _load(path / "state.json", lambda f: json.loads(f.read_text()))


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Load weights and optimizer state into a one-process ``model``/``optimizer``; returns
    ``state.json``. Any failure raises CheckpointError naming the file."""
    from .training.distributed import load_states

    weights, optim, state = read_checkpoint(path, model)
    try:
        load_states(model, optimizer, weights, optim)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be loaded into the model: {str(e)[:300]}") from e
    return state


def write_critic(directory: Path, states: tuple[dict, dict]) -> None:
    """The critic's trainable state and optimizer state into ``directory/critic/`` (a checkpoint being built)."""
    import torch
    from safetensors.torch import save_file

    weights, optim = states
    (directory / CRITIC).mkdir()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / CRITIC / "model.safetensors"))
    torch.save(optim, directory / CRITIC / "optimizer.pt")  # local file, never sent over the wire


def read_critic(path: Path, critic) -> tuple[dict, dict] | None:
    """A checkpoint's critic states, checked against ``critic`` (its trainable parameters' names);
    None when the checkpoint has no critic (a run that did not use one: the critic starts afresh).
    Any failure raises CheckpointError naming the file."""
    import torch
    from safetensors.torch import load_file

    from ..models.critic import trainable_names
    from .training.distributed import unwrap

    if not (path / CRITIC).is_dir():
        return None
    weights = _load(path / CRITIC / "model.safetensors", load_file)
    expected = trainable_names(unwrap(critic))
    if set(weights) != expected:
        raise CheckpointError(
            f"{path / CRITIC / 'model.safetensors'} does not match this run's critic: missing "
            f"{sorted(expected - set(weights))[:5]}, unexpected {sorted(set(weights) - expected)[:5]}"
        )
    return weights, _load(path / CRITIC / "optimizer.pt", lambda f: torch.load(f, weights_only=True))


def _load(f: Path, reader):
    try:
        return reader(f)
    except Exception as e:  # safetensors, torch and json each raise their own types
        raise CheckpointError(f"{f}: cannot be loaded ({type(e).__name__}: {str(e)[:200]})") from e
