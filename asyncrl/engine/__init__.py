"""Generation engines by ``engine.type``: ``hf`` (transformers, CPU or GPU) and ``vllm`` (vLLM).

Every engine keeps the ``Engine`` contract of ``asyncrl.engine.base``. An engine is made from the
model directory and the tokenizer (:func:`make_engine`); each kind loads the weights its own way.
"""

from __future__ import annotations

from pathlib import Path

from ..config import Config, ConfigError
from .base import Engine, Generation


def _hf(cfg: Config, model_dir: Path, tokenizer) -> Engine:
    from ..models.loading import load_model
    from .hf import HFEngine

    return HFEngine(load_model(model_dir, cfg.model.dtype, cfg.engine.device), tokenizer, device=cfg.engine.device)


def _vllm(cfg: Config, model_dir: Path, tokenizer) -> Engine:
    from .vllm import VLLMEngine, require_vllm

    require_vllm()
    context = _context_length(model_dir)
    return VLLMEngine(model_dir, tokenizer, cfg.engine, max_model_len=cfg.engine.max_model_len or context,
                      seed=cfg.seed, dtype=cfg.model.dtype)


ENGINES = {"hf": _hf, "vllm": _vllm}


def make_engine(cfg: Config, model_dir: str | Path, tokenizer) -> Engine:
    """The ``engine.type`` engine over the model in ``model_dir``."""
    if cfg.engine.type not in ENGINES:
        raise ConfigError(f"engine.type: unknown engine {cfg.engine.type!r}; available: {', '.join(ENGINES)}")
    return ENGINES[cfg.engine.type](cfg, Path(model_dir), tokenizer)


def _context_length(model_dir: Path) -> int | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return getattr(config, "max_position_embeddings", None)


__all__ = ["ENGINES", "Engine", "Generation", "make_engine"]
