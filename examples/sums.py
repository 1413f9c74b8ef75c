"""Tasks for a real chat model (examples/smollm2.yaml): sums of two numbers, asked after two worked examples.

``tasks.type: examples.sums:tasks`` asks "What is 17 + 25?" for every pair of numbers in ``[low, high]``
(900 questions for 0-29), each after the same two solved exchanges in the chat ("What is 12 + 5?" /
"12 + 5 = 17", "What is 3 + 14?" / "3 + 14 = 17"), which show the answer format. ``env.reward:
last_number`` scores a reply by the last number in it. The held-out set (tasks.eval_size) is carved out
of the questions and never trained on.

Why the examples in the prompt: asked cold, SmolLM2-135M-Instruct answers in prose ("24 + 12 = 36\\n\\nThis
is a classic example of...") and only 6% of its samples end on the right number, so most groups of 8
are all wrong and GRPO has nothing to learn from; after the two examples 49% of its samples are right
and most groups mix right and wrong (`asyncrl probe`, docs/guide/real-model.md).
"""

from __future__ import annotations

import random

EXAMPLES = [("What is 12 + 5?", "12 + 5 = 17"), ("What is 3 + 14?", "3 + 14 = 17")]


def tasks(low: int = 0, high: int = 29, seed: int = 0) -> list[dict]:
    """Every sum ``a + b`` with ``a, b`` in ``[low, high]`` once (the examples' own left out), shuffled."""
    shots = [m for q, a in EXAMPLES for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    out = []
    for a in range(low, high + 1):
        for b in range(low, high + 1):
            question = f"What is {a} + {b}?"
            if question in {q for q, _ in EXAMPLES}:
                continue
            out.append(
                {"id": f"sum:{a}+{b}", "prompt": [*shots, {"role": "user", "content": question}], "answer": a + b}
            )
    random.Random(seed).shuffle(out)
    return out
