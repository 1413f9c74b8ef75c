"""Tasks for a real chat model (examples/smollm2.yaml): which of two numbers is larger, or smaller.

``tasks.type: examples.compare_numbers:tasks`` asks about every pair of distinct numbers in
``[low, high]`` once, in a random order and direction: "Which number is larger, 79 or 8? Reply with the
number only." (or "smaller"), with the number as the answer. ``env.reward: last_number`` scores a reply
by the last number in it. 4,950 questions for 0-99; the held-out set (tasks.eval_size) is carved out of
them, so no held-out pair is ever trained on in any order or direction.

SmolLM2-135M-Instruct starts near where GRPO has signal (measured, README "A real model"): it
rambles ("To solve this problem, we need to consider...") and ends on the right number in about a
quarter of its samples, so most groups of 8 mix right and wrong replies.
"""

from __future__ import annotations

import random


def tasks(low: int = 0, high: int = 99, seed: int = 0, size: int | None = None) -> list[dict]:
    """One question per pair, shuffled with ``seed`` (the first ``size`` of them when given)."""
    rng, out = random.Random(seed), []
    for a in range(low, high + 1):
        for b in range(a + 1, high + 1):
            x, y = (a, b) if rng.random() < 0.5 else (b, a)
            word, pick = rng.choice((("larger", max), ("smaller", min)))
            out.append({"id": f"cmp:{word}:{x}:{y}",
                        "prompt": f"Which number is {word}, {x} or {y}? Reply with the number only.",
                        "answer": pick(x, y)})
    rng.shuffle(out)
    return out[:size] if size else out
