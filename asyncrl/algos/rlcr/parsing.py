"""RLCR's tags: parsing answers and confidences, the Brier reward, and the token masks of the learned spans."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...engine.base import Generation


# --------------------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class Parsed:
    """One turn's parse: ``value`` (answer text or confidence float) and the learnable char span."""

    ok: bool
    value: Any = None
    reason: str = ""  # why it failed ("" when ok)
    span: tuple[int, int] | None = None  # [start, end) chars of the learnable region; None: whole turn


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_THINK = re.compile(r"<think>.*?</think>", re.S)
_CONFIDENCE = re.compile(r"<confidence>(.*?)</confidence>", re.S)
_DECIMAL = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)$")


def _span(text: str, open_tags: tuple[str, ...], last: re.Match) -> tuple[int, int]:
    """From the first of ``open_tags`` (before the last match) to the end of the last match."""
    starts = [i for i in (text.find(t) for t in open_tags) if 0 <= i <= last.start()]
    return min(starts), last.end()


def parse_answer(text: str) -> Parsed:
    """Turn 1: the last ``<answer>..</answer>`` (stripped), which must follow a ``<think>..</think>``.
    The learnable span runs from the first ``<think>`` to the end of the last ``</answer>``."""
    matches = list(_ANSWER.finditer(text))
    if not matches:
        return Parsed(False, reason="no <answer>...</answer>")
    last = matches[-1]
    if not _THINK.search(text, 0, last.start()):
        return Parsed(False, reason="no <think>...</think> before the answer")
    return Parsed(True, last.group(1).strip(), span=_span(text, ("<think>", "<answer>"), last))


def parse_confidence(text: str) -> Parsed:
    """Turn 2: the last ``<confidence>..</confidence>`` as a decimal number in [0, 1]. The learnable
    span runs from the first ``<analysis>`` (if any, else ``<confidence>``) to the last close tag."""
    matches = list(_CONFIDENCE.finditer(text))
    if not matches:
        return Parsed(False, reason="no <confidence>...</confidence>")
    last = matches[-1]
    raw = last.group(1).strip()
    if not _DECIMAL.match(raw):
        return Parsed(False, reason=f"confidence {raw[:20]!r} is not a number")
    value = float(raw)
    if not 0.0 <= value <= 1.0:
        return Parsed(False, reason=f"confidence {raw} is outside [0, 1]")
    return Parsed(True, value, span=_span(text, ("<analysis>", "<confidence>"), last))


def brier_reward(acc_reward: float, confidence: float | None) -> float:
    """``1 - (acc_reward - confidence)^2``; 0 when the confidence did not parse (``None``)."""
    if confidence is None:
        return 0.0
    return 1.0 - (float(acc_reward) - float(confidence)) ** 2


# --------------------------------------------------------------------------------------- masks
def token_char_offsets(tokenizer, token_ids, text: str) -> np.ndarray:
    """``[L + 1]``: token ``i`` covers chars ``[off[i], off[i+1])`` of ``text`` (the decode of
    ``token_ids`` without special tokens, which cover no chars)."""
    ids = [int(t) for t in token_ids]
    pieces = tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=True)
    off = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)
    if off[-1] != len(text):  # merges that decode differently alone (byte-level BPE): decode prefixes
        prefixes = tokenizer.batch_decode([ids[:i] for i in range(len(ids) + 1)], skip_special_tokens=True)
        off = np.array([len(p) for p in prefixes], dtype=np.int64)
    return off


def span_mask(tokenizer, gen: Generation, span: tuple[int, int] | None, eos_ids: set[int]) -> np.ndarray:
    """uint8 ``[L]`` over a turn's generated tokens: 1 on the tokens that cover chars ``span`` of
    ``gen.text`` and on an EOS token right after them; all ones when ``span`` is None."""
    n = len(gen.token_ids)
    if span is None:
        return np.ones(n, dtype=np.uint8)
    off = token_char_offsets(tokenizer, gen.token_ids, gen.text)
    start, end = span
    covering = np.nonzero((off[1:] > start) & (off[:-1] < end))[0]
    mask = np.zeros(n, dtype=np.uint8)
    if covering.size:
        first, last = int(covering[0]), int(covering[-1])
        if last + 1 < n and int(gen.token_ids[last + 1]) in eos_ids and off[last + 1] == end:
            last += 1
        mask[first : last + 1] = 1
    return mask
