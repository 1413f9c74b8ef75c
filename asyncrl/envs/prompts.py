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

from ..config import ConfigError

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
        raise ConfigError(f"tasks.prompt_format is 'chat' but the tokenizer{where} has no chat template (a base "
                         f"model?); set tasks.prompt_format=raw for plain-text prompts, or auto")
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
    Raw: ``"\n" + contents + "\n"``."""
    if prompt_format(tokenizer) == "raw":
        return list(tokenizer("\n" + _raw_text(new) + "\n", add_special_tokens=False)["input_ids"])
    prev = tokenizer.apply_chat_template(history, add_generation_prompt=False, tokenize=False)
    full = tokenizer.apply_chat_template(history + new, add_generation_prompt=True, tokenize=False)
    delta = full[len(prev):] if full.startswith(prev) else tokenizer.apply_chat_template(
        new, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(delta, add_special_tokens=False)["input_ids"])
