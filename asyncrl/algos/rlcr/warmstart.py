"""The embedded model's ``rlcr`` warm-start format: the tag format with uninformative confidences, so that calibration has to be learned by RL."""

from __future__ import annotations

import random

from ...config import TasksConfig
from ...envs.arithmetic import make_problem
from .config import DEFAULT_CONFIDENCE_PROMPT, DEFAULT_SYSTEM_PROMPT

# --------------------------------------------------------------------------------------- warm start
WARMSTART_MAX_OPERAND = 19  # a + b with operands 0..19: partial accuracy after a short warm start
WARMSTART_CONFIDENCE = "0.9"  # the usual stated confidence: overconfident, and unrelated to correctness


def _uninformative_confidence(rng: random.Random) -> str:
    """Half the time 0.9, otherwise uniform over 0.0, 0.1, ..., 1.0: independent of correctness."""
    return WARMSTART_CONFIDENCE if rng.random() < 0.5 else f"{rng.randint(0, 10) / 10:.1f}"


def _wrong_answer(rng: random.Random, right: int) -> int:
    """A plausible slip: off by one or two in a digit, never the right answer."""
    if right > 11:
        return right + rng.choice([-11, -10, -2, -1, 1, 2, 10, 11])
    return right + rng.randint(1, 9)


def rlcr_warmstart_example(rng: random.Random) -> tuple[list[dict[str, str]], str]:
    """A turn-1 example (tags around a right answer) or a turn-2 example (after a right or wrong
    answer, an uninformative confidence), half and half."""
    task = make_problem(rng, TasksConfig(max_operand=WARMSTART_MAX_OPERAND))
    question = task.prompt[0]["content"]
    opening = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, *task.prompt]

    def said(answer: int) -> str:
        return f"<think>{question.rstrip('=')}</think><answer>{answer}</answer>"

    if rng.random() < 0.5:
        return opening, said(task.answer)
    shown = task.answer if rng.random() < 0.5 else _wrong_answer(rng, task.answer)
    messages = [
        *opening,
        {"role": "assistant", "content": said(shown)},
        {"role": "user", "content": DEFAULT_CONFIDENCE_PROMPT},
    ]
    return messages, f"<confidence>{_uninformative_confidence(rng)}</confidence>"
