"""A task with long-tailed response lengths: copy a string, where most strings are short and a few are
long (the shape of reasoning or agent traces, where a few answers run far longer than the rest).

Used by ``bench/bench_inflight.py`` (``actor.weight_update: batch`` against ``inflight``) and runnable
on its own with the embedded model, which learns the format in its warm start:

    asyncrl run -c examples/longtail.yaml

- ``copy_format(rng)``: the warm-start format (``model.embedded.warmstart_formats``).
- ``tasks(n, seed, long_share)``: the task source (``tasks.type: examples.longtail:tasks``).
- ``reward(task, response)``: 1 for an exact copy, else the share of leading characters copied right
  (so that partial copies of long strings still give a signal), and ``exact`` as a score.
"""

from __future__ import annotations

import random

from asyncrl.types import Task

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
SHORT = (2, 5)  # characters
LONG = (24, 40)


def _string(rng: random.Random, long_share: float) -> str:
    lo, hi = LONG if rng.random() < long_share else SHORT
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(lo, hi)))


def _prompt(s: str) -> list[dict]:
    return [{"role": "user", "content": f"copy {s}"}]


def copy_format(rng: random.Random) -> tuple[list[dict], str]:
    """A warm-start example: (chat messages, completion text)."""
    s = _string(rng, long_share=0.25)
    return _prompt(s), s


def tasks(n: int = 20000, seed: int = 0, long_share: float = 0.1) -> list[Task]:
    """``n`` copy tasks, a ``long_share`` of them long."""
    rng = random.Random(seed)
    return [
        Task(id=f"copy-{seed}-{i}", prompt=_prompt(s), answer=s)
        for i, s in ((i, _string(rng, long_share)) for i in range(n))
    ]


def reward(task: Task, response: str) -> dict:
    target, got = str(task.answer), response.strip()
    if got == target:
        return {"reward": 1.0, "exact": 1.0}
    prefix = 0
    for a, b in zip(target, got):
        if a != b:
            break
        prefix += 1
    return {"reward": 0.5 * prefix / max(len(target), len(got)), "exact": 0.0}
