"""64.8: ``model.path=org/name`` (what a TRL or verl user types) resolves from the local Hugging Face
cache, offline (huggingface_hub's own lookup, a cache laid out as its downloads lay it out), and says
how to get the model in one line when it is not there."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.config import ModelConfig
from asyncrl.models.loading import load_policy, resolve_model_path
from asyncrl.models.tokenizer import build_char_tokenizer


def _cached(hub, repo_id: str, commit: str = "0" * 40):
    """A model in ``hub`` as ``hf download`` leaves it: models--org--name/{refs/main, snapshots/<commit>/...}."""
    root = hub / f"models--{repo_id.replace('/', '--')}"
    snap = root / "snapshots" / commit
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
        )
    ).save_pretrained(snap)
    tok.save_pretrained(snap)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    return snap


def test_a_model_id_in_the_local_cache_is_found_offline(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    snap = _cached(hub, "someorg/tiny-chat")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = ModelConfig(path="someorg/tiny-chat")
    assert resolve_model_path(cfg) == snap
    model, tok, path = load_policy(cfg)
    assert path == snap and model.config.hidden_size == 16
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path(ModelConfig(path="someorg/not-here"))
    msg = str(e.value)
    assert "\n" not in msg and "not in the local Hugging Face cache" in msg and "hf download someorg/not-here" in msg
    with pytest.raises(FileNotFoundError, match="is not a directory"):  # a path that is no id: as before
        resolve_model_path(ModelConfig(path=str(tmp_path / "nothing" / "here")))
