"""Built-in arithmetic tasks: ``a op b =`` with an exact numeric verifier.

The prompt is one user message such as ``"12+34="``; the ideal reply is ``"46"`` (then EOS). The
format is kept minimal because the embedded model is character-level and tiny.
"""

from __future__ import annotations

import random
import re
from typing import Iterator

from ..types import Task

_INT = re.compile(r"-?\d+")


def render_question(a: int, op: str, b: int) -> str:
    return f"{a}{op}{b}="


def compute(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}; expected one of + - *")


def make_problem(rng: random.Random, cfg) -> Task:
    """Draw one problem. ``cfg`` is a TasksConfig (min_operand, max_operand, ops)."""
    a = rng.randint(cfg.min_operand, cfg.max_operand)
    b = rng.randint(cfg.min_operand, cfg.max_operand)
    op = rng.choice(list(cfg.ops))
    q = render_question(a, op, b)
    return Task(
        id=f"arith:{a}{op}{b}",
        prompt=[{"role": "user", "content": q}],
        answer=compute(a, op, b),
        metadata={"a": a, "b": b, "op": op},
    )


def arithmetic_tasks(cfg, seed: int) -> Iterator[Task]:
    """An endless stream of problems, reproducible for a seed."""
    rng = random.Random(seed)
    while True:
        yield make_problem(rng, cfg)


def parse_int(text: str) -> int | None:
    """The first integer in the reply (after stripping whitespace), or None if there is none."""
    m = _INT.match(text.strip())
    return int(m.group()) if m else None


def arithmetic_reward(task: Task, response: str) -> float:
    """1.0 if the reply is exactly the right integer (surrounding whitespace allowed), else 0.0."""
    text = response.strip()
    value = parse_int(text)
    if value is None or str(value) != text:
        return 0.0
    try:
        return 1.0 if value == int(task.answer) else 0.0
    except (TypeError, ValueError):
        return 0.0
