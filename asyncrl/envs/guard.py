"""User code at the boundary: every environment and reward call is guarded.

:class:`GuardedEnv` wraps an environment (and so the reward function a ``SingleTurnEnv`` calls) so
that one bad call never kills a run:

- an exception, a call that runs past ``env.call_timeout_s``, a reward that is not a number or a
  dict of numbers with ``reward``, or a non-finite (NaN/inf) score becomes an :class:`EnvFailure`
  whose one-line message names the function, the task id and what was wrong. Callers record the
  conversation as failed (it is not trained on) and go on;
- when more than ``env.max_failure_rate`` of the last ``FAILURE_WINDOW`` calls failed (after at
  least ``MIN_CALLS_FOR_RATE``), the next call raises :class:`TooManyFailures`: the user's code is
  broken, not unlucky, and the run stops with the last error;
- a call that never returns is abandoned after its timeout (Python cannot kill a thread: it stays
  parked as a daemon thread and is counted in ``abandoned``), and :func:`request_stop` (called from
  the learner's and actors' signal handlers) makes pending and later calls fail at once, so a hung
  reward function never blocks a stop.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from typing import Any, Callable

from ..types import Task

FAILURE_WINDOW = 200
MIN_CALLS_FOR_RATE = 20
_STOP = threading.Event()


class EnvFailure(Exception):
    """One environment or reward call failed; ``str(e)`` is a one-line explanation."""


class TooManyFailures(RuntimeError):
    """Too many recent environment or reward calls failed (``env.max_failure_rate``)."""


def request_stop() -> None:
    """Make pending and later guarded calls fail at once (the process is stopping)."""
    _STOP.set()


def stopping() -> bool:
    """Whether :func:`request_stop` was called."""
    return _STOP.is_set()


class _Worker:
    """A daemon thread that runs guarded calls one after another for one calling thread. Starting a
    thread per call cost the quick-start actor a third of its wall time (192 calls per step); a
    worker is replaced only when a call it runs is abandoned (it stays parked with that call)."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="asyncrl-guarded-calls", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            fn, box, done = self.calls.get()
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed back to the caller's thread
                box["error"] = e
            done.set()


_workers = threading.local()  # the calling thread's worker


class CallTimeout(EnvFailure):
    """A guarded call that gave no result within ``env.call_timeout_s`` (or its caller's budget)."""


def call_with_timeout(
    fn: Callable[[], Any], timeout_s: float | None, what: str, tick: Callable[[], Any] | None = None
) -> Any:
    """``fn()`` on the calling thread's worker thread, waited for at most ``timeout_s`` seconds
    (None: no limit) and abandoned when :func:`request_stop` is called. Exceptions propagate; a
    timeout (CallTimeout) or a stop raises EnvFailure naming ``what`` (and the next call gets a new
    worker). ``tick()``, if given, runs on the calling thread at least every half second while it
    waits (the learner answers its actors during a slow evaluation)."""
    if _STOP.is_set():
        raise EnvFailure(f"{what}: not called, the process is stopping")
    worker = getattr(_workers, "worker", None)
    if worker is None:
        worker = _workers.worker = _Worker()
    box: dict[str, Any] = {}
    done = threading.Event()
    worker.calls.put((fn, box, done))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    step = 0.05
    while not done.wait(step):
        stopping = _STOP.is_set()
        if stopping or (deadline is not None and time.monotonic() >= deadline):
            _workers.worker = None  # this one is busy with the abandoned call for good
            if stopping:
                raise EnvFailure(f"{what}: abandoned, the process is stopping")
            raise CallTimeout(f"{what}: no result after {timeout_s:g} s (env.call_timeout_s)")
        if tick is not None:
            tick()
        step = min(step * 2, 0.5)
    if "error" in box:
        raise box["error"]
    return box.get("value")


class ScoresError(ValueError):
    """A reward/evaluate result that is not a finite float or a dict of them with ``reward``."""


def validate_scores(value: Any) -> dict[str, float]:
    """Named scores from a reward result (a finite number, or a dict of finite numbers with
    ``reward``); ScoresError says what was returned and what was expected."""
    expected = "expected a finite float or a dict of finite floats with a 'reward' key"
    if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
        raise ScoresError(f"returned {_short(value)} ({type(value).__name__}); {expected}")
    items = value.items() if isinstance(value, dict) else [("reward", value)]
    scores = {}
    for key, v in items:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise ScoresError(f"returned {_short(v)} for score {key!r}; {expected}")
        scores[str(key)] = float(v)
    if "reward" not in scores:
        raise ScoresError(f"returned a dict without 'reward' ({sorted(scores)}); {expected}")
    return scores


def check_scores(value: Any, what: str, task: Task) -> dict[str, float]:
    """:func:`validate_scores` as an EnvFailure naming ``what`` and the task."""
    try:
        return validate_scores(value)
    except ScoresError as e:
        raise EnvFailure(f"{what} {e} (task {task.id})") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class GuardedEnv:
    """An environment whose calls are guarded (module doc). ``name`` is how messages call the user
    code (``env.reward arithmetic``, ``env.type my.module:Env``); ``max_failure_rate=None`` never
    stops (the learner's evaluation records failures and carries on)."""

    def __init__(self, env, name: str, timeout_s: float | None, max_failure_rate: float | None):
        self.env = env
        self.name = name
        self.timeout_s = timeout_s
        self.max_failure_rate = max_failure_rate
        self.calls = 0
        self.failures = 0
        self.timeouts = 0  # failures that were timeouts (or calls refused past ``deadline``)
        self.by_method: dict[str, list[int]] = {}  # method -> [calls, timeouts]
        self.tick: Callable[[], Any] | None = None  # run while waiting (see call_with_timeout)
        self.deadline: float | None = None  # monotonic time after which calls fail at once (a budget)
        self.last_error: str | None = None
        self._recent: deque[bool] = deque(maxlen=FAILURE_WINDOW)

    def __getattr__(self, attr: str) -> Any:  # anything else an environment offers
        return getattr(self.env, attr)

    def reset(self, task: Task) -> list[dict[str, str]]:
        return self._guard("reset", task, lambda: self.env.reset(task))

    def step(self, task: Task, history: list[dict[str, str]], response: str):
        return self._guard("step", task, lambda: self.env.step(task, history, response))

    def evaluate(self, task: Task, history: list[dict[str, str]]) -> dict[str, float]:
        what = f"{self.name}"
        return self._guard("evaluate", task, lambda: check_scores(self.env.evaluate(task, history), what, task))

    def _guard(self, method: str, task: Task, fn: Callable[[], Any]) -> Any:
        what = f"{self.name} ({method}, task {task.id})"
        self.check_rate()
        self.calls += 1
        counts = self.by_method.setdefault(method, [0, 0])
        counts[0] += 1
        timeout = self.timeout_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.timeouts += 1
                counts[1] += 1
                self._record(f"{what}: not called, over the evaluation's time budget (eval.timeout_s)")
                raise CallTimeout(self.last_error)
            timeout = left if timeout is None else min(timeout, left)
        try:
            value = call_with_timeout(fn, timeout, what, self.tick)
        except CallTimeout as e:
            self.timeouts += 1
            counts[1] += 1
            self._record(str(e))
            raise
        except EnvFailure as e:
            self._record(str(e))
            raise
        except ScoresError as e:  # from scores_from inside the environment: the reward's result
            msg = f"{self.name} {e} (task {task.id})"
            self._record(msg)
            raise EnvFailure(msg) from None
        except Exception as e:  # noqa: BLE001 - user code may raise anything; it fails this call only
            msg = f"{what} raised {type(e).__name__}: {str(e)[:300]}"
            self._record(msg)
            raise EnvFailure(msg) from e
        self._recent.append(False)
        return value

    def record(self, failure: str | None) -> None:
        """Count one call of an environment that runs its own calls: ``failure`` None if it went well."""
        self.calls += 1
        if failure is None:
            self._recent.append(False)
        else:
            self._record(failure)

    def _record(self, msg: str) -> None:
        self.failures += 1
        self.last_error = msg
        self._recent.append(True)

    def check_rate(self) -> None:
        """TooManyFailures when too many recent calls failed (also called by environments that run
        their own calls: ``env.type=agent``)."""
        if self.max_failure_rate is None or len(self._recent) < MIN_CALLS_FOR_RATE:
            return
        rate = sum(self._recent) / len(self._recent)
        if rate > self.max_failure_rate:
            raise TooManyFailures(
                f"{sum(self._recent)} of the last {len(self._recent)} calls of {self.name} failed "
                f"(more than env.max_failure_rate={self.max_failure_rate:g}); last error: "
                f"{self.last_error}"
            )
