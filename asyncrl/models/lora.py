"""LoRA adapters on the policy (``model.lora``, docs/guide/lora.md).

- The learner wraps its model with ``peft`` (:func:`with_adapters`): the base weights are frozen and
  the optimizer holds the adapters only.
- Weight sync sends the adapter tensors only (:func:`adapter_tensors`), named by the plain model's
  module, e.g. ``model.layers.0.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
  ([out, r]). Every ``sync.type`` carries them unchanged: it ships whatever tensors it is given.
- The Hugging Face engine applies them in place (:class:`MergedAdapters`): each targeted weight
  becomes ``W0 + (alpha / r) * B @ A``, computed from a kept copy of the base weight ``W0`` (so
  nothing drifts over many versions and generation costs what the base model costs).
- Checkpoints hold the adapters in peft's format (``adapter_model.safetensors`` and
  ``adapter_config.json``, whose ``base_model_name_or_path`` names the base model);
  ``asyncrl export --merge RUN`` writes a plain Hugging Face model with them merged (:func:`export_merged`).

Names and the in-place merge are :mod:`asyncrl.weights.adapters` (the engines use them too).
"""

from __future__ import annotations

import importlib
import json
import os
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from ..config import ConfigError, LoraSettings
from ..weights.adapters import (
    ADAPTER,
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    MergedAdapters,
    adapter_config,
    adapter_tensors,
    internal_name,
    is_adapter_name,
    targeted,
)


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def peft_config(lora: LoraSettings, base: str | Path | None = None):
    """peft's ``LoraConfig`` for ``lora``: the fields of the ``adapter_config.json`` that checkpoints write."""
    from peft import LoraConfig

    return LoraConfig(**{k: v for k, v in adapter_config(lora, base).items() if k != "peft_type"})


def require_peft() -> None:
    try:
        importlib.import_module("peft")
    except ImportError as e:
        raise ConfigError(f"model.lora needs peft ({e}): pip install 'asyncrl[lora]'") from None


def with_adapters(model, model_cfg, seed: int, base: str | Path | None = None):
    """``model`` wrapped with fresh LoRA adapters when ``model_cfg.lora`` is set (``B = 0``: the wrapped
    model computes exactly the base model; ``A`` is drawn from ``seed``, so every rank of a learner
    group draws the same), else ``model`` itself. Only the adapters require gradients."""
    if model_cfg.lora is None:
        return model
    require_peft()
    from peft import get_peft_model

    targeted(model, model_cfg.lora)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings():  # (peft 0.21 reads a property transformers 5.2x renamed; not ours to fix)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped = get_peft_model(model, peft_config(model_cfg.lora, base), adapter_name=ADAPTER)
    finally:
        torch.random.set_rng_state(state)
    for name, p in wrapped.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    return wrapped


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter entries of an in-memory state dict (what a LoRA checkpoint holds), names unchanged."""
    return {n: t for n, t in state.items() if is_adapter_name(n)}


def read_adapters(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(in-memory name -> tensor, adapter_config)`` of a peft adapter directory."""
    from safetensors.torch import load_file

    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    return {internal_name(k): v for k, v in load_file(str(directory / ADAPTER_FILE)).items()}, config


def settings_of(adapter_config: dict) -> LoraSettings:
    return LoraSettings(
        rank=adapter_config["r"],
        alpha=adapter_config["lora_alpha"],
        dropout=adapter_config.get("lora_dropout", 0.0),
        target_modules=sorted(adapter_config["target_modules"]),
    )


def export_merged(adapter_dir: Path, base_dir: Path, out: Path, dtype: str = "float32") -> Path:
    """A plain Hugging Face model directory in ``out``: the base model in ``base_dir`` with the adapters
    of ``adapter_dir`` merged (what peft's ``merge_and_unload`` computes), and the base's tokenizer."""
    from .loading import load_model, load_tokenizer

    tensors, config = read_adapters(adapter_dir)
    lora = settings_of(config)
    model = load_model(base_dir, dtype)
    MergedAdapters(model, lora).apply(adapter_tensors(tensors))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(base_dir).save_pretrained(out)
    return out


class Exported(NamedTuple):
    checkpoint: Path
    out: Path
    merged: bool  # LoRA adapters were merged (False: a full-weight checkpoint, copied)


def export_run(run_dir: Path, out: Path | None = None, merge: bool = False, step: int | None = None) -> Exported:
    """``asyncrl export``: the newest intact checkpoint of ``run_dir`` (or ``step_<step>``) as a plain
    Hugging Face model directory, ``out`` (default ``<run>/export/step_<N>``). A LoRA checkpoint needs
    ``merge``: its adapters are merged into the base model its ``adapter_config.json`` names (or,
    when that directory is gone, the run's own ``model`` config resolves it again, rebuilding the
    embedded model). The files are written with the usual mode (0644 under the common umask), even
    those copied from a checkpoint's private ones. A problem: ConfigError, one line."""
    import shutil

    from ..config import load_config
    from ..rundir.layout import CONFIG
    from .loading import resolve_model_path

    run_dir = Path(run_dir)
    ckpt, out = export_paths(run_dir, out, step)
    model_dir = ckpt / "model"
    if not (model_dir / ADAPTER_CONFIG).exists():  # full weights: already a Hugging Face model
        shutil.copytree(model_dir, out, dirs_exist_ok=True)
        return Exported(ckpt, usual_modes(out), merged=False)
    if not merge:
        raise ConfigError(
            f"{ckpt} holds LoRA adapters (model.lora): export them merged into the base model with --merge"
        )
    base = json.loads((model_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").exists():
        cfg = load_config(str(run_dir / CONFIG), [])
        base = resolve_model_path(cfg.model, cfg.seed)
    return Exported(ckpt, usual_modes(export_merged(model_dir, Path(base), out)), merged=True)


def export_paths(run_dir: Path, out: Path | None, step: int | None, suffix: str = "") -> tuple[Path, Path]:
    """``(checkpoint, out)`` for an export: the newest intact checkpoint (or ``step_<step>``, checked),
    and ``out`` or ``<run>/export/<checkpoint name><suffix>``, which must be empty. ConfigError otherwise."""
    from ..rundir.layout import checkpoint_dir, select_checkpoint, verify_checkpoint

    if step is None:
        ckpt, _ = select_checkpoint(run_dir)
        if ckpt is None:
            raise ConfigError(f"{run_dir}: no intact checkpoint to export (is it a run directory?)")
    else:
        ckpt = checkpoint_dir(run_dir, step)
        problem = verify_checkpoint(ckpt) if ckpt.is_dir() else "no such checkpoint"
        if problem:
            raise ConfigError(f"{ckpt}: cannot export it: {problem}")
    out = Path(out) if out is not None else run_dir / "export" / (ckpt.name + suffix)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; give another --out or remove it")
    return ckpt, out


def usual_modes(out: Path) -> Path:
    """Every file in ``out`` with the mode a new file gets here (a checkpoint's weights are written
    private, 0600; an exported model is meant to be shared like any other model directory)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in Path(out).rglob("*"):
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)
    return out
