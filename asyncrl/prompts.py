"""From chat messages to prompt tokens.

Prompt formats (``tasks.prompt_format``, decided per tokenizer by :func:`set_prompt_format`):

- ``chat``: the tokenizer's chat template renders the messages (instruct models);
- ``raw``: plain text, as TRL's "standard" (non-conversational) format does for base models. The
  opening messages' contents are joined with newlines and tokenized as is, with the special tokens
  the tokenizer adds for generation (BOS for Llama-style tokenizers). In a multi-turn conversation
  each later environment message is appended as ``"\n" + content + "\n"`` after the model's reply,
  and the model continues from there.
- ``auto`` (default): ``chat`` when the tokenizer has a chat template, else ``raw``.
"""

from __future__ import annotations

import weakref
from typing import Any

from .config import ConfigError

PROMPT_FORMATS = ("auto", "chat", "raw")
_FORMATS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def set_prompt_format(tokenizer, setting: str = "auto", where: str = "") -> str:
    """Decide how prompts are rendered for ``tokenizer`` (see the module doc) and return it:
    ``"chat"`` or ``"raw"``. ``setting='chat'`` on a tokenizer without a chat template is a
    ConfigError saying what to set instead. ``where`` names the tokenizer in messages."""
    if setting not in PROMPT_FORMATS:
        raise ConfigError(f"tasks.prompt_format: {setting!r} is not one of {', '.join(PROMPT_FORMATS)}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if setting == "chat" and not has_template:
        raise ConfigError(
            f"tasks.prompt_format is 'chat' but the tokenizer{where} has no chat template (a base "
            f"model?); set tasks.prompt_format=raw for plain-text prompts, or auto"
        )
    fmt = "chat" if setting != "raw" and has_template else "raw"
    _FORMATS[tokenizer] = fmt
    return fmt


def prompt_format(tokenizer) -> str:
    """``"chat"`` or ``"raw"``: as set by :func:`set_prompt_format`, else decided as ``auto``."""
    fmt = _FORMATS.get(tokenizer)
    if fmt is None:
        fmt = "chat" if getattr(tokenizer, "chat_template", None) else "raw"
    return fmt


def _raw_text(messages: list[dict[str, str]]) -> str:
    return "\n".join(str(m["content"]) for m in messages)


def render_tokens(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the opening ``messages`` in the tokenizer's prompt format (module doc)."""
    if prompt_format(tokenizer) == "raw":
        return list(tokenizer(_raw_text(messages), add_special_tokens=True)["input_ids"])
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def delta_tokens(tokenizer, history: list[dict[str, str]], new: list[dict[str, str]]) -> list[int]:
    """Tokens that the prompt format adds for ``new`` messages after ``history`` (plus the next
    assistant header). Chat: rendered as the text difference so templates with preambles stay exact.
    When ``history`` ends on an assistant turn, whose tokens (the model's, up to its end-of-turn token)
    are already there, they start with what the template writes after that token (:func:`turn_end`:
    ChatML's newline), so the conversation's tokens are the template's, turn boundaries included.
    Raw: ``"\n" + contents + "\n"``."""
    if prompt_format(tokenizer) == "raw":
        return list(tokenizer("\n" + _raw_text(new) + "\n", add_special_tokens=False)["input_ids"])
    prev = tokenizer.apply_chat_template(history, add_generation_prompt=False, tokenize=False)
    full = tokenizer.apply_chat_template(history + new, add_generation_prompt=True, tokenize=False)
    delta = (
        full[len(prev) :]
        if full.startswith(prev)
        else tokenizer.apply_chat_template(new, add_generation_prompt=True, tokenize=False)
    )
    if history and history[-1].get("role") == "assistant":
        delta = turn_end(tokenizer) + delta
    return list(tokenizer(delta, add_special_tokens=False)["input_ids"])


_TURN_ENDS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_SENTINEL = "\u2063asyncrl-turn\u2063"


def turn_end(tokenizer) -> str:
    """What the chat template writes after the end-of-turn token that closes an assistant message:
    ``"\n"`` for ChatML (``<|im_end|>\n``), ``""`` for Llama 3 (``<|eot_id|>``) or when the template
    closes an assistant turn some other way. Found once per tokenizer, from an assistant message
    rendered around a marker."""
    known = _TURN_ENDS.get(tokenizer)
    if known is not None:
        return known
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses this conversation: nothing to add
        text = ""
    tail = text[text.rfind(_SENTINEL) + len(_SENTINEL) :] if _SENTINEL in text else ""
    ends = [t for t in {getattr(tokenizer, "eos_token", None), *_eos_texts(tokenizer)} if t]
    end = next((tail[len(t) :] for t in sorted(ends, key=len, reverse=True) if tail.startswith(t)), "")
    _TURN_ENDS[tokenizer] = end
    return end


def _eos_texts(tokenizer) -> list[str]:
    """The texts of the tokenizer's special tokens that can end a turn (its EOS and end-of-turn tokens)."""
    names = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>", "<|endoftext|>")
    vocab = getattr(tokenizer, "get_vocab", lambda: {})()
    return [t for t in names if t in vocab]
