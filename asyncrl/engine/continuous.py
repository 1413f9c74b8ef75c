"""Continuous generation for in-flight weight updates (``actor.weight_update: inflight``).

In ``batch`` mode an engine call runs to the end of its longest sequence, and new weights wait for
the batch. In ``inflight`` mode the actor's thread owns the engine and calls its ``step()``: one
decode step over every sequence in flight. Rollouts run on their own threads, and their
``engine.generate`` calls queue their prompts here (:class:`ContinuousBatcher`) and wait; the owner admits
queued prompts as sequences finish (so a batch no longer waits for its longest sequence: the next
batch's prompts take the free rows), and applies new weights between two steps. Every token records
the policy version of the weights that produced it (``Generation.versions``).

Sampling in this mode is not reproducible from a seed: which rows share a forward pass depends on
timing.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from ..config import SamplingConfig
from .base import Generation


class EngineStopped(RuntimeError):
    """The engine's owner stopped serving while a call waited (the actor is stopping)."""


@dataclass
class Call:
    """One ``generate`` call waiting for its generations."""

    prompts: list[list[int]]
    sampling: SamplingConfig
    results: list = field(default_factory=list)
    left: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.prompts)
        self.left = len(self.prompts)


@dataclass
class Row:
    """One sequence in flight: the prompt, what was generated so far, and each token's version."""

    call: Call
    index: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: str | None = None  # "stop" or "length" once done

    @property
    def sampling(self) -> SamplingConfig:
        return self.call.sampling


class ContinuousBatcher:
    """Generate calls from any thread, served by the owner thread's ``step()`` (thread-safe)."""

    def __init__(self, owner: int | None = None) -> None:
        self.owner = threading.get_ident() if owner is None else owner
        self.cond = threading.Condition()
        self.pending: deque[Row] = deque()
        self.stopped: str | None = None

    def is_owner(self) -> bool:
        return threading.get_ident() == self.owner

    def submit(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Generation]:
        """Queue ``prompts`` and wait until the owner has generated them all."""
        call = Call([list(map(int, p)) for p in prompts], sampling)
        if not call.prompts:
            return []
        for i, p in enumerate(call.prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        with self.cond:
            if self.stopped:
                raise EngineStopped(self.stopped)
            self.pending.extend(Row(call, i, p) for i, p in enumerate(call.prompts))
            self.cond.notify_all()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.results

    def take(self) -> list[Row]:
        """Every queued row (owner thread)."""
        with self.cond:
            rows = list(self.pending)
            self.pending.clear()
        return rows

    def num_pending(self) -> int:
        return len(self.pending)

    def wait_for_work(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a queued prompt; True if one is queued."""
        with self.cond:
            if not self.pending:
                self.cond.wait(timeout_s)
            return bool(self.pending)

    @staticmethod
    def finish(row: Row, gen: Generation) -> None:
        call = row.call
        call.results[row.index] = gen
        call.left -= 1
        if call.left == 0:
            call.done.set()

    def stop(self, reason: str, in_flight: list[Row] = ()) -> None:
        """Fail every waiting call (queued or in flight) with :class:`EngineStopped`."""
        with self.cond:
            self.stopped = reason
            rows = list(self.pending) + list(in_flight)
            self.pending.clear()
        for row in rows:
            if not row.call.done.is_set():
                row.call.error = EngineStopped(reason)
                row.call.done.set()
