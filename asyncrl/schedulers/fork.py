"""How the local scheduler starts a process: forked from the launcher once it has imported the
libraries every asyncrl process loads (``launch.start: fork``, the default), or as a fresh
``python -m asyncrl ...`` (``exec``).

Importing torch and transformers costs a process about 5 s of CPU (transformers alone scans its
model folder and every installed package's metadata on import). A run of one learner and two actors
paid that three times before its first step; forked, it pays it once, in the launcher, and the
children start with the libraries already in memory (shared until written).

A forked child is made to look like a freshly started interpreter running ``asyncrl <args>``:
- its environment is the one it would have been given (``os.environ`` replaced);
- its output goes where a started process's would (``stdout``: a file or the launcher's terminal),
  unbuffered as with ``PYTHONUNBUFFERED``;
- signal handlers the launcher installed are reset (SIGINT raises KeyboardInterrupt again), the
  launcher's exit handlers are dropped, and every descriptor a new program would not have inherited
  (close-on-exec) is closed;
- NumPy's global generator is reseeded (Python's ``random`` reseeds itself on fork);
- ``sys.argv`` is ``[asyncrl's __main__, *args]``, the process name (``ps -o comm``, ``top``) is
  ``asyncrl-<command>``; ``ps -o args`` still shows the launcher's command line.
It ends with ``os._exit`` after its own exit handlers: it never returns into the launcher's code.

Forking copies a thread pool's state without its threads: a child of a process whose OpenMP or
tokenizer pool has run would hang in its first parallel region. So the launcher forks only while it
has no Python thread but its main one and no more native threads than it had once its imports were
done (:func:`preload` counts them: NumPy's OpenBLAS starts its pool on import, and OpenBLAS stops
and restarts it around a fork); otherwise it falls back to ``exec``. It runs no tensor operation.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import gc
import importlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

PRELOAD = ("torch", "transformers", "asyncrl.learner.learner", "asyncrl.actor.actor")
_PR_SET_NAME = 15


_threads_after_preload: int | None = None


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    """Import what the children will need, and count this process's threads then (the first time
    only: a later call, say a second launch in one process, must not count pools started since)."""
    global _threads_after_preload
    for name in modules:
        importlib.import_module(name)
    if _threads_after_preload is None:
        _threads_after_preload = _native_threads()


def safe_to_fork() -> bool:
    """After :func:`preload`: one Python thread, and no native thread started since."""
    n = _native_threads()
    return _threads_after_preload is not None and threading.active_count() == 1 and 0 < n <= _threads_after_preload


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc: 0, and processes start the usual way
        return 0


class ProcessHandle:
    """The part of :class:`subprocess.Popen`'s interface the schedulers use (``pid``, ``returncode``,
    ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``), for a process this one did not
    start with Popen; subclasses say how ``poll`` learns its exit code."""

    pid: int
    args: list[str]
    returncode: int | None = None

    def poll(self) -> int | None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (never signal a pid that has been reaped and may be reused)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # (ended since: poll() will say how)
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedProcess(ProcessHandle):
    """A child forked from this process that runs ``asyncrl <args>``."""

    def __init__(self, args: list[str], env: dict[str, str], stdout, target):
        """``target(args) -> exit code`` is what the child runs: the ``main`` of the ``asyncrl`` command
        this process runs. ``stdout``: an open file for its output and errors, or None for ours."""
        self.args = ["asyncrl", *args]
        self.returncode = None
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()  # nothing buffered is written twice
            except (OSError, ValueError, AttributeError):
                pass
        out_fd = stdout.fileno() if stdout is not None else None
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _run_child(list(args), env, out_fd, target)
        self.pid = pid

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def command(args: list[str]) -> list[str]:
    """``asyncrl <args>`` as a fresh process runs it: ``python -m asyncrl <args>``."""
    return [sys.executable, "-m", "asyncrl", *args]


def start(args: list[str], env: dict[str, str], stdout=None, fork: bool = True):
    """``asyncrl <args>`` as a child process: forked when ``fork`` and :func:`safe_to_fork`, else
    started with ``python -m asyncrl``. ``stdout``: an open file for its output (and its errors), or
    None for this process's own."""
    main = _running_command()
    if fork and main is not None and safe_to_fork():
        return ForkedProcess(args, env, stdout, target=main)
    argv = command(args)
    if stdout is None:
        return subprocess.Popen(argv, env=env)
    return subprocess.Popen(argv, env=env, stdout=stdout, stderr=subprocess.STDOUT)


def _run_child(args: list[str], env: dict[str, str], out_fd: int | None, target) -> None:
    code = 1
    try:
        gc.freeze()  # the launcher's objects are never collected here (none closes a descriptor)
        _as_new_process(args, env, out_fd)
        code = target(args)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:  # as an interpreter does: die of the signal
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - the child reports and ends; it never returns
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            _flush()
            os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)


def _as_new_process(args: list[str], env: dict[str, str], out_fd: int | None) -> None:
    atexit._clear()
    if out_fd is not None:
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
    _close_on_exec_descriptors()
    os.environ.clear()
    os.environ.update(env)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if callable(handler):  # a Python handler (the launcher's): what a new interpreter has
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    sys.stdout = _unbuffered(1, sys.stdout)
    sys.stderr = _unbuffered(2, sys.stderr)
    sys.argv = [sys.modules["asyncrl"].__path__[0] + "/__main__.py", *args]
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    _set_name(f"asyncrl-{args[0]}" if args else "asyncrl")


def _running_command():
    """The ``asyncrl`` command's ``main``, when this process has loaded it (it runs the command); else
    None, and processes are started with exec."""
    return getattr(sys.modules.get("asyncrl.commands.cli"), "main", None)


def _close_on_exec_descriptors() -> None:
    """Close what ``exec`` would have closed: every descriptor above 2 marked close-on-exec."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2:
            continue
        try:
            if fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC:
                os.close(fd)
        except OSError:  # (the listing's own descriptor, gone already)
            pass


def _unbuffered(fd: int, like) -> io.TextIOWrapper:
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False),
        encoding=getattr(like, "encoding", None) or "utf-8",
        errors=getattr(like, "errors", None) or "backslashreplace",
        write_through=True,
    )


def _set_name(name: str) -> None:
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
