"""Base models (no chat template) are welcome: plain-text prompts with the tokenizer's BOS, a
documented plain-text rendering of later turns, and a full run that evaluates and trains."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from asyncrl.config import ConfigError, load_config
from asyncrl.models.tokenizer import BOS, build_char_tokenizer
from asyncrl.prompts import delta_tokens, prompt_format, render_tokens, set_prompt_format
from tests.conftest import read_jsonl, run_cli

MESSAGES = [{"role": "user", "content": "12+34="}]


def _base_tokenizer(tmp_path) -> PreTrainedTokenizerFast:
    """The embedded character tokenizer as a base model's would be: no chat template, and a
    post-processor that puts BOS in front of every encoded text (as Llama's does)."""
    tok = build_char_tokenizer()
    bos_id = tok.convert_tokens_to_ids(BOS)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "tok")
    return AutoTokenizer.from_pretrained(tmp_path / "tok")


def test_a_tokenizer_without_a_chat_template_gets_plain_text_prompts_with_bos(tmp_path):
    tok = _base_tokenizer(tmp_path)
    assert not getattr(tok, "chat_template", None)
    assert set_prompt_format(tok, "auto") == "raw"
    ids = render_tokens(tok, MESSAGES)
    assert ids[0] == tok.convert_tokens_to_ids(BOS)
    assert tok.decode(ids[1:]) == "12+34="
    # later turns of a multi-turn environment: "\n" + content + "\n", no BOS in the middle
    extra = delta_tokens(
        tok, MESSAGES + [{"role": "assistant", "content": "45"}], [{"role": "user", "content": "wrong, try again"}]
    )
    assert tok.decode(extra) == "\nwrong, try again\n"


def test_raw_can_be_forced_on_a_chat_model_and_chat_on_a_base_model_is_a_clear_error(tmp_path):
    chat = build_char_tokenizer()
    assert set_prompt_format(chat, "auto") == "chat"
    assert chat.decode(render_tokens(chat, MESSAGES)) == "<|user|>12+34=<|end|><|assistant|>"
    assert set_prompt_format(chat, "raw") == "raw" and prompt_format(chat) == "raw"
    assert chat.decode(render_tokens(chat, MESSAGES)) == "12+34="
    with pytest.raises(ConfigError, match="has no chat template.*tasks.prompt_format=raw"):
        set_prompt_format(_base_tokenizer(tmp_path), "chat", where=" in /models/base")
    with pytest.raises(ConfigError):
        load_config(None, ["tasks.prompt_format=jinja"])


@pytest.mark.slow
def test_a_run_on_a_base_model_evaluates_and_trains(tmp_path, tiny_overrides, model_cache):
    built = next(p.parent for p in model_cache.glob("*/config.json"))
    base = tmp_path / "base-model"
    shutil.copytree(built, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    _base_tokenizer(tmp_path).save_pretrained(base)  # a template-less tokenizer with BOS
    assert json.loads((base / "tokenizer_config.json").read_text()).get("chat_template") is None
    assert not list(base.glob("*.jinja"))
    common = [
        *tiny_overrides,
        f"model.path={base}",
        f"run_root={tmp_path}",
        "train.total_steps=2",
        "train.batch_tasks=2",
        "actor.tasks_per_batch=2",
        "sampling.n=2",
        "sampling.max_new_tokens=4",
        "eval.size=4",
        "eval.every=1",
        "log.progress=false",
        "log.sample_every=1",
        "checkpoint.every=0",
    ]
    res = run_cli("run", "-c", "configs/quickstart.yaml", *common, "name=base", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    events = read_jsonl(tmp_path / "base" / "events.jsonl")
    assert [e["version"] for e in events if e["kind"] == "eval"] == [0, 1, 2]
    sample = next(e for e in events if e["kind"] == "sample")
    assert sample["tokens"][0] == BOS and "<|user|>" not in sample["tokens"]

    res = run_cli(
        "learn", "-c", "configs/quickstart.yaml", *common, "name=chat", "tasks.prompt_format=chat", timeout=300
    )
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.count("\n") == 1 and "has no chat template" in res.stderr, res.stderr
