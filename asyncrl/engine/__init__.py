"""Generation engines by ``engine.type``: ``hf`` (transformers, CPU or GPU) and ``vllm`` (vLLM).

Every engine keeps the ``Engine`` contract of ``asyncrl.engine.base``. An engine is made from the
model directory, the tokenizer and a loader of the model (:func:`make_engine`): the ``hf`` engine
runs the model the loader returns, ``vllm`` loads the directory its own way. (Engines import no
model-building code: ``asyncrl.models`` and ``asyncrl.engine`` stand side by side.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..config import Config
from ..registry import Registry
from .base import Engine, Generation


def _hf(cfg: Config, model_dir: Path, tokenizer, load_model) -> Engine:
    from .hf import HFEngine

    if load_model is None:
        raise ValueError("engine.type=hf runs a loaded model: give make_engine a load_model")
    return HFEngine(
        load_model(), tokenizer, device=cfg.engine.device, lora=cfg.model.lora, record_routing=cfg.model.routing_replay
    )


def _vllm(cfg: Config, model_dir: Path, tokenizer, load_model=None) -> Engine:
    from .vllm import VLLMEngine, require_vllm

    require_vllm()
    context = _context_length(model_dir)
    return VLLMEngine(
        model_dir,
        tokenizer,
        cfg.engine,
        max_model_len=cfg.engine.max_model_len or context,
        seed=cfg.seed,
        dtype=cfg.model.dtype,
        lora=cfg.model.lora,
    )


ENGINES: Registry[Callable[..., Engine]] = Registry("engine", {"hf": _hf, "vllm": _vllm})


def make_engine(
    cfg: Config, model_dir: str | Path, tokenizer, load_model: Callable[[], object] | None = None
) -> Engine:
    """The ``engine.type`` engine over the model in ``model_dir``; ``load_model()`` returns the
    loaded model for an engine that runs one in this process (``hf``), called only by such."""
    factory = ENGINES.resolve(cfg.engine.type, "engine.type", what="factory")
    return factory(cfg, Path(model_dir), tokenizer, load_model)


def _context_length(model_dir: Path) -> int | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return getattr(config, "max_position_embeddings", None)


__all__ = ["ENGINES", "Engine", "Generation", "make_engine"]
