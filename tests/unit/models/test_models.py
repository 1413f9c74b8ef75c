"""The character tokenizer, the embedded tiny model (build + cache) and policy loading."""

from __future__ import annotations

import hashlib
import json
import random
import string

import pytest
import torch
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from asyncrl.commands.init_model import init_model
from asyncrl.config import Config, EmbeddedModelConfig, ModelConfig
from asyncrl.models import tiny
from asyncrl.models.loading import load_policy, load_tokenizer
from asyncrl.models.tokenizer import SPECIAL_TOKENS, build_char_tokenizer
from asyncrl.prompts import prompt_format, render_tokens, set_prompt_format


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_round_trip_every_character(tok):
    text = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace("\x0c", "")
    text = "  lead and trail  \n" + text + "\n\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.unk_token_id not in ids
    assert len(tok.encode("12+34=")) == 6  # no BOS added


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "12+34="}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|user|>12+34=<|end|><|assistant|>"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>") and ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert len(ids) == 1 + 6 + 1 + 1
    full = msgs + [{"role": "assistant", "content": "46"}]
    assert tok.apply_chat_template(full, tokenize=False) == "<|user|>12+34=<|end|><|assistant|>46<|end|>"


def test_special_tokens_are_single_ids(tok):
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.pad_token_id == 0 and tok.eos_token == "<|end|>" and tok.bos_token == "<bos>"
    for t in SPECIAL_TOKENS:
        assert tok.encode(f"a{t}b", add_special_tokens=False) == [tok.convert_tokens_to_ids(c) for c in ("a", t, "b")]
    ids = tok.encode("46<|end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "46" and ids[-1] == tok.eos_token_id


def test_save_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    text = "<|system|>be brief<|end|><|user|>7 * 8 = ?\n<|end|><|assistant|>"
    for loaded in (AutoTokenizer.from_pretrained(tmp_path), PreTrainedTokenizerFast.from_pretrained(tmp_path)):
        assert loaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
        assert loaded.chat_template == tok.chat_template
        assert (loaded.pad_token_id, loaded.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
        assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text


def test_default_parameter_count():
    n = tiny.count_parameters(EmbeddedModelConfig())
    assert 500_000 <= n <= 5_000_000


def _tiny_cfg(tmp_path, **kw) -> EmbeddedModelConfig:
    base = dict(
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        max_positions=32,
        warmup_steps=20,
        warmup_batch_size=16,
        warmup_lr=3e-3,
        cache_dir=str(tmp_path),
    )
    return EmbeddedModelConfig(**{**base, **kw})


def test_embedded_model_builds_and_is_cached(tmp_path, monkeypatch):
    cfg = _tiny_cfg(tmp_path / "cache")
    path = tiny.build_embedded_model(cfg, seed=0, progress=False)
    info = json.loads((path / tiny.META_FILE).read_text())
    assert info["seed"] == 0 and 1 <= info["steps"] <= 20 and 0 <= info["expected_accuracy"] <= 1
    assert info["num_parameters"] == tiny.count_parameters(cfg)
    assert info["built_with"] == {
        "cpu_kernels": torch.backends.cpu.get_cpu_capability(),  # (64.1: what else decides it)
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    assert [p.name for p in path.parent.iterdir() if not p.name.startswith(".")] == [path.name]

    def fail(*a, **k):
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tiny, "_build_into", fail)
    assert tiny.build_embedded_model(cfg, seed=0, progress=False) == path
    model, tokenizer, loaded_path = load_policy(ModelConfig(embedded=cfg), seed=0)
    assert loaded_path == path and model.dtype == torch.float32
    assert (
        tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=False)
        == "<|user|>1+2=<|end|><|assistant|>"
    )
    with pytest.raises(AssertionError, match="rebuilt"):  # another seed is another model
        tiny.build_embedded_model(cfg, seed=1, progress=False)


def test_build_is_deterministic(tmp_path):
    a = tiny.build_embedded_model(_tiny_cfg(tmp_path / "a", warmup_steps=5), seed=3, progress=False)
    b = tiny.build_embedded_model(_tiny_cfg(tmp_path / "b", warmup_steps=5), seed=3, progress=False)
    assert a.name == b.name
    ma, _, _ = load_policy(ModelConfig(path=str(a)))
    mb, _, _ = load_policy(ModelConfig(path=str(b)))
    for (na, pa), (nb, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


def test_cache_key_covers_model_settings(tmp_path):
    cfg = _tiny_cfg(tmp_path)
    key = tiny.cache_key(cfg, 0)
    assert tiny.cache_key(cfg.model_copy(update={"cache_dir": "/elsewhere"}), 0) == key
    assert tiny.cache_key(cfg, 1) != key
    assert tiny.cache_key(cfg.model_copy(update={"hidden_size": 64}), 0) != key
    assert tiny.cache_key(cfg.model_copy(update={"warmstart_formats": ["arithmetic", "echo_test"]}), 0) != key


def test_cache_key_of_the_defaults_is_unchanged_by_the_newer_options(tmp_path):
    """prompt_format and heldout_size enter the key only when set off their defaults, so models
    cached before these options existed are still found."""
    cfg = _tiny_cfg(tmp_path)
    fields = cfg.model_dump(mode="json", exclude={"cache_dir", "prompt_format", "heldout_size"})
    blob = json.dumps({"cfg": fields, "seed": 0, "build": tiny.BUILD_VERSION}, sort_keys=True)
    assert tiny.cache_key(cfg, 0).endswith(hashlib.sha256(blob.encode()).hexdigest()[:16])
    assert tiny.cache_key(cfg.model_copy(update={"prompt_format": "raw"}), 0) != tiny.cache_key(cfg, 0)
    assert tiny.cache_key(cfg.model_copy(update={"heldout_size": 300}), 0) != tiny.cache_key(cfg, 0)


def test_raw_prompt_build_is_a_base_model_warm_started_on_plain_text(tmp_path):
    """prompt_format raw: the saved tokenizer has no chat template (auto then renders raw prompts)
    and the warm start trained on exactly those raw prompt ids."""
    seen = []

    def fmt(rng):
        seen.append(1)
        return [{"role": "user", "content": "12+34="}], "46"

    cfg = _tiny_cfg(tmp_path, warmstart_formats=["probe"], warmup_steps=2, prompt_format="raw")
    stream = tiny._example_stream(_raw_tok(), [fmt], random.Random(0), set())
    assert next(stream).prompt_ids == _raw_tok()("12+34=", add_special_tokens=False)["input_ids"]
    path = tiny.build_embedded_model(cfg, progress=False, formats={"probe": fmt})
    tokenizer = load_tokenizer(path)
    assert not getattr(tokenizer, "chat_template", None) and prompt_format(tokenizer) == "raw"
    assert tokenizer.decode(render_tokens(tokenizer, [{"role": "user", "content": "12+34="}])) == "12+34="
    assert seen


def _raw_tok():
    tok = build_char_tokenizer()
    tok.chat_template = None
    set_prompt_format(tok, "raw")
    return tok


def test_heldout_size_keeps_that_many_problems_out_of_the_warm_start(tmp_path):
    """The build's held-out problems are the first of the run's arithmetic held-out draw, so a run
    with tasks.eval_size = heldout_size evaluates on problems the warm start never trained on."""
    from asyncrl.config import TasksConfig
    from asyncrl.envs.tasks import split_tasks

    held = tiny.heldout_tasks(600)
    _, run_heldout = split_tasks(TasksConfig(ops=["+"], eval_size=600))
    assert [t.prompt for t in held] == [t.prompt for t in run_heldout]
    excluded = {tiny._prompt_key(t.prompt) for t in held}
    stream = tiny._example_stream(
        build_char_tokenizer(), [tiny.BUILTIN_FORMATS["arithmetic"]], random.Random(0), excluded
    )
    tok = build_char_tokenizer()
    texts = {tok.decode(next(stream).prompt_ids) for _ in range(3000)}
    assert not texts & {tok.apply_chat_template(t.prompt, add_generation_prompt=True, tokenize=False) for t in held}


def test_unknown_warmstart_format(tmp_path):
    with pytest.raises(ValueError, match="unknown.*nope"):
        tiny.build_embedded_model(_tiny_cfg(tmp_path, warmstart_formats=["nope"]), progress=False)


def test_a_warmstart_format_given_by_the_caller_is_used(tmp_path):
    """An algorithm's formats reach the build through the caller (models/ never imports algos/)."""
    seen = []

    def echo(rng):
        seen.append(1)
        return [{"role": "user", "content": "a"}], "a"

    cfg = _tiny_cfg(tmp_path, warmstart_formats=["echo_test"], warmup_steps=2)
    path = tiny.build_embedded_model(cfg, progress=False, formats={"echo_test": echo})
    assert seen and (path / tiny.META_FILE).exists()


def test_collate_masks_the_prompt(tok):
    ex = tiny._Example(prompt_ids=[4, 24, 25], target_ids=[26, 3])
    batch = tiny.collate_examples([ex, tiny._Example([4], [3])], pad_id=0)
    assert batch["input_ids"].tolist() == [[4, 24, 25, 26, 3], [4, 3, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 26, 3], [-100, 3, -100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


def test_load_policy_missing_directory(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_policy(ModelConfig(path=str(missing)))


def test_init_model_prints_summary(tmp_path, capsys):
    cfg = Config(model=ModelConfig(embedded=_tiny_cfg(tmp_path, warmup_steps=2)))
    path = init_model(cfg)
    out = capsys.readouterr().out
    assert str(path) in out and "parameters" in out and "accuracy" in out
    assert f"built with: {torch.backends.cpu.get_cpu_capability()} CPU kernels, torch {torch.__version__}" in out


def test_expected_accuracy_is_the_probability_of_the_exact_answer(tok):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        tiny.embedded_llama_config(EmbeddedModelConfig(hidden_size=32, num_layers=1, num_heads=2), len(tok))
    )
    tasks = tiny.heldout_tasks(3)
    probs = []
    for t in tasks:  # unpadded, one task at a time
        prompt = tok.encode(
            tok.apply_chat_template(t.prompt, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )
        target = tok.encode(str(t.answer), add_special_tokens=False) + [tok.eos_token_id]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + target])).logits[0, len(prompt) - 1 : -1]
        probs.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(target)[:, None]).sum().exp().item())
    assert tiny.expected_accuracy(model, tok, tasks) == pytest.approx(sum(probs) / 3, rel=1e-4)
