"""Answer verifiers: is an extracted answer right for a gold answer?

Each verifier is ``fn(gold, answer_text) -> bool`` and never raises on model output (bad output is
simply not right). A gold may be a list of acceptable answers; any match counts.

- ``numeric``: the answer must be exactly a number (``46``, ``-3``, ``0.25``) equal to the gold;
  the built-in arithmetic tasks use it.
- ``math``: symbolic equivalence with Hugging Face ``math-verify`` (``\\frac{1}{2}`` == ``0.5``).
  The package is optional: it is imported on first use, with a clear error if it is missing.
- ``exact_match``: normalised exact match for short-answer QA (lower case, no punctuation, no
  articles, single spaces; ``asyncrl.envs.base.normalize_answer``).
- ``auto`` picks per task: ``task.metadata["verifier"]`` if set, ``numeric`` for a numeric gold,
  ``exact_match`` otherwise.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Callable

from .base import normalize_answer

Verifier = Callable[[Any, str], bool]
VERIFIERS = ("auto", "numeric", "math", "exact_match")
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)$")


def _golds(gold: Any) -> list[Any]:
    return list(gold) if isinstance(gold, (list, tuple)) else [gold]


def _as_fraction(value: Any) -> Fraction | None:
    """An exact rational for a number or a plain decimal string; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Fraction(value)
    text = str(value).strip()
    if not _NUMBER.match(text):
        return None
    return Fraction(text)


def verify_numeric(gold: Any, answer: str) -> bool:
    """The answer is a plain decimal number (surrounding spaces allowed) equal to a gold."""
    got = _as_fraction(answer)
    return got is not None and any(_as_fraction(g) == got for g in _golds(gold))


def verify_exact_match(gold: Any, answer: str) -> bool:
    """Normalised exact match against any gold."""
    norm = normalize_answer(answer)
    return any(norm == normalize_answer(str(g)) for g in _golds(gold))


def require_math_verify():
    """The ``math_verify`` module, or an ImportError that says how to install it."""
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "the 'math' verifier needs the math-verify package: pip install math-verify (or pip install -e '.[dev]')"
        ) from e
    return math_verify


def _as_math(text: str) -> str:
    """Math-verify reads LaTeX reliably only between delimiters: an extracted answer (``1+x^2``,
    ``\\frac12``) is put in ``$...$`` unless it already has delimiters or a ``\\boxed``."""
    text = text.strip()
    if any(d in text for d in ("$", "\\boxed", "\\(", "\\[")):
        return text
    return f"${text}$"


def verify_math(gold: Any, answer: str) -> bool:
    """Symbolic equivalence with math-verify; unparsable output is not right."""
    mv = require_math_verify()
    try:
        target = mv.parse(_as_math(answer))
        if not target:
            return False
        return any(mv.verify(mv.parse(_as_math(str(g))), target) for g in _golds(gold))
    except Exception:  # math-verify can raise on pathological input; model output must never crash us
        return False


_BY_NAME: dict[str, Verifier] = {"numeric": verify_numeric, "math": verify_math, "exact_match": verify_exact_match}


def resolve_verifier(name: str, gold: Any = None, metadata: dict | None = None) -> str:
    """The concrete verifier name for ``name`` (``auto`` looks at the task)."""
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; valid: {', '.join(VERIFIERS)}")
    if name != "auto":
        return name
    chosen = (metadata or {}).get("verifier")
    if chosen:
        return resolve_verifier(str(chosen))
    numeric = all(isinstance(g, (int, float)) and not isinstance(g, bool) for g in _golds(gold))
    return "numeric" if numeric else "exact_match"


_ANY_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (``-3``, ``1,234``, ``0.25``; thousands commas dropped), or None."""
    found = _ANY_NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def last_number_reward(task, response: str) -> float:
    """``env.reward: last_number``: 1.0 when the last number in the reply equals the task's answer (a
    number, or a list of acceptable ones), else 0.0. What a chat model's free-form reply is scored by
    (GSM8K's usual rule): it may explain itself, as long as it ends on its answer."""
    got = last_number(response)
    return 1.0 if got is not None and verify_numeric(task.answer, got) else 0.0


def verify(name: str, gold: Any, answer: str, metadata: dict | None = None) -> bool:
    """Run the verifier ``name`` (``auto`` resolved per task) on one answer."""
    return _BY_NAME[resolve_verifier(name, gold, metadata)](gold, answer)
