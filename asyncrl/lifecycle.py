"""Process lifecycle: children of ``asyncrl run`` never outlive it.

``asyncrl run`` starts the learner, the actors and the UI with ``ASYNCRL_PARENT_PID`` set to its own
pid. A child that finds it calls :func:`watch_parent`, which arms two independent mechanisms:

1. Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)``: the kernel sends SIGTERM the moment the parent dies
   (SIGKILL and OOM kills included). The parent may already be gone by the time the child arms it,
   so the child checks its parent pid right after.
2. A portable fallback, a daemon thread that polls ``os.getppid()`` (a child is re-parented when its
   parent dies) and sends the process SIGTERM itself.

SIGTERM asks for the process's own orderly stop (the learner checkpoints, the actor stops after its
batch). If the process is still alive ``grace_s`` later (stuck in a reward function, say), the
watcher ends it with ``os._exit``: nothing acknowledged is lost that way, because the learner's
write-ahead log is fsynced before every acknowledgement and checkpoints are renamed into place.

Processes started by hand (``asyncrl learn``/``serve`` in a shell) have no such parent and are not
watched: actors waiting for a restarting learner is how a run resumes.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import signal
import sys
import threading
import time
from pathlib import Path

PARENT_ENV = "ASYNCRL_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child that must die with this process (see :func:`watch_parent`)."""
    out = dict(os.environ if env is None else env)
    out[PARENT_ENV] = str(os.getpid())
    return out


def watch_parent(grace_s: float = 20.0, poll_s: float = 0.5) -> int | None:
    """Arm the parent-death watch if ``ASYNCRL_PARENT_PID`` names this process's parent.

    Returns the watched parent pid (None when not started by ``asyncrl run``). The variable is
    removed from ``os.environ`` so that this process's own children are not watched against it.
    If the parent is already gone, this process is sent SIGTERM at once.
    """
    raw = os.environ.pop(PARENT_ENV, None)
    if not raw:
        return None
    try:
        parent = int(raw)
    except ValueError:
        print(f"[asyncrl] ignoring {PARENT_ENV}={raw!r}: expected a process id", file=sys.stderr)
        return None
    _set_pdeathsig(signal.SIGTERM)
    thread = threading.Thread(target=_watch, args=(parent, grace_s, poll_s), name="asyncrl-parent-watch", daemon=True)
    thread.start()
    return parent


def _set_pdeathsig(sig: int) -> bool:
    """Ask the Linux kernel to send ``sig`` when the parent dies; False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int, grace_s: float, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    print(f"[asyncrl] pid {os.getpid()}: parent {parent} is gone; stopping", file=sys.stderr, flush=True)
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the process's own orderly stop (a no-op twice)
    except OSError:
        pass
    time.sleep(grace_s)
    print(
        f"[asyncrl] pid {os.getpid()}: still running {grace_s:g} s after its parent died; exiting now",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def freeze_startup_heap(young_threshold: int = 10_000) -> None:
    """Called by ``asyncrl learn`` once the learner has imported its libraries and built its model
    (not by the Learner class, so a program that embeds it keeps its own collector settings).

    Every object alive then (modules, the model, the tokenizer: about 400k) moves to the collector's
    permanent generation, and the young generation is collected less often. In a steady run this
    changes little (a quick-start learner spends 0.02 s of 13 s in the collector after start-up),
    but when episodes pile up (a flood of actors, a backlog after a pause) every full collection
    would walk all of those objects again while the learner decodes: in ``bench/bench_core.py``'s
    ingest stages, decoding 2000 queued 8-trajectory episodes took 76 us each with the default
    settings and 50 us with these. Costs one full collection at start-up. Frozen objects are not
    freed by the cycle collector (reference counting still frees them), which suits objects that
    live as long as the process; at exit they are unfrozen."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # collected as usual at exit (no leak reports from extensions)
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, older, oldest)


class _Tolerant:
    """A text stream whose reader may go away (``asyncrl run ... | tee log`` and Ctrl-C: tee dies
    first). The first write that finds the pipe closed points the file descriptor at /dev/null, so
    that nothing later (this process, its C libraries, the children it starts) fails on it; the
    process goes on. Any other error is raised as before."""

    def __init__(self, stream):
        self._stream = stream
        self.closed_reader = False

    def _gone(self) -> None:
        self.closed_reader = True
        try:
            fd = self._stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        except (OSError, ValueError, AttributeError):
            pass

    def write(self, text: str) -> int:
        if not self.closed_reader:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.closed_reader:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def tolerate_closed_output() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` survive a reader that went away (see :class:`_Tolerant`):
    a closed terminal pipe never stops training."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Tolerant):
            setattr(sys, name, _Tolerant(stream))


class _OncePerMessage:
    """A ``logging.Filter`` that lets each distinct (logger, level, message) through once."""

    def __init__(self):
        self.seen: set[tuple] = set()

    def filter(self, record) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def warn_once_per_message() -> None:
    """No library warning floods a log: each distinct warning (category and text, wherever it is
    raised from) is shown once per process, and so is each distinct WARNING-or-worse log record of
    the libraries (transformers, torch, vLLM: records propagated to the root logger's handlers)."""
    import logging
    import warnings

    seen: set[tuple] = set()
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if key not in seen:
            seen.add(key)
            show(message, category, filename, lineno, file, line)

    if getattr(warnings.showwarning, "__name__", "") != "showwarning_once":
        showwarning.__name__ = "showwarning_once"
        warnings.showwarning = showwarning
    try:  # transformers logs through a handler of its own, made on first use: make it now
        from transformers.utils import logging as hf_logging

        hf_logging.get_logger()
    except ImportError:
        pass
    once = _OncePerMessage()
    for name in ("", "transformers", "torch", "vllm", "accelerate"):
        logger = logging.getLogger(name)
        for h in logger.handlers:
            if not any(isinstance(f, _OncePerMessage) for f in h.filters):
                h.addFilter(once)
        if not any(isinstance(f, _OncePerMessage) for f in logger.filters):
            logger.addFilter(once)
