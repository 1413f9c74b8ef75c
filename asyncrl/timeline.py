"""Where a process spends its time (issue 67): a :class:`StateClock` per actor and for the learner.

A process says which state it is in (``enter``; ``during`` for a state with an end). The clock keeps
the exact seconds per state (``totals``) and the spans ``[state, start, end]`` (unix times) since they
were last taken; the actor sends them in its heartbeat (``Status.spans``, ``Status.states``), the
learner writes its own as ``timeline`` events, and the UI's Timeline tab draws both.

A span shorter than ``min_span_s`` (default 50 ms) right after another is drawn as part of the one
before it, so that an in-flight actor that switches between decode steps and waiting every few
milliseconds does not send thousands of spans; the totals stay exact.

The states:
- actor: ``generating``, ``environment`` (in-flight: rollouts run tools or rewards, no decode step to
  run), ``waiting for credits``, ``waiting for weights``, ``applying weights``, ``waiting for the
  learner`` (no session);
- learner: ``starting``, ``waiting for episodes``, ``training``, ``publishing weights``,
  ``evaluating``, ``checkpointing``, ``stopping`` (after the last step: the final evaluation and
  checkpoint are drawn as such).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

ACTOR_STATES = (
    "generating",
    "environment",
    "applying weights",
    "waiting for weights",
    "waiting for credits",
    "waiting for the learner",
)
LEARNER_STATES = ("training", "publishing weights", "evaluating", "checkpointing", "waiting for episodes")
MAX_SPANS = 512  # kept between two takes (past it the oldest are dropped)


class StateClock:
    def __init__(self, state: str, min_span_s: float = 0.05, max_spans: int = MAX_SPANS):
        self._lock = threading.Lock()
        self.state, self.since = state, time.time()
        self.min_span_s, self.max_spans = min_span_s, max_spans
        self.totals: dict[str, float] = {}
        self._spans: list[list] = []  # closed spans [state, start, end], oldest first

    def enter(self, state: str, at: float | None = None) -> str:
        """Be in ``state`` from ``at`` (unix time; default now, never before the current state's
        start); returns the state left."""
        with self._lock:
            left = self.state
            if state != left:
                now = max(time.time() if at is None else at, self.since)
                self._close(now)
                self.state, self.since = state, now
            return left

    @contextmanager
    def during(self, state: str):
        """``state`` for the block, then back to the state before it."""
        left = self.enter(state)
        try:
            yield
        finally:
            self.enter(left)

    def _close(self, now: float) -> None:
        d = now - self.since
        if d <= 0:
            return
        self.totals[self.state] = self.totals.get(self.state, 0.0) + d
        last = self._spans[-1] if self._spans else None
        if last is not None and abs(last[2] - self.since) < 1e-6 and (last[0] == self.state or d < self.min_span_s):
            last[2] = now  # (the same state again, or a blip: the span before it goes on)
        else:
            self._spans.append([self.state, self.since, now])
        if len(self._spans) > self.max_spans:  # (not taken for long: the oldest go; the totals keep them)
            del self._spans[0]

    def take(self) -> tuple[list[list], dict[str, float]]:
        """The spans since the last take, the current one cut at now (the next take continues it),
        rounded to milliseconds, and the seconds per state since the clock started."""
        with self._lock:
            now = time.time()
            self._close(now)
            self.since = now
            spans, self._spans = self._spans, []
            return [[s, round(a, 3), round(b, 3)] for s, a, b in spans], {
                k: round(v, 3) for k, v in self.totals.items()
            }

    def put_back(self, spans: list[list]) -> None:
        """Spans that could not be sent go first in the next take (within ``max_spans``)."""
        with self._lock:
            self._spans = [list(s) for s in spans] + self._spans
            del self._spans[: max(len(self._spans) - self.max_spans, 0)]
