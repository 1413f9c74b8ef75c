"""Running model-written Python (Absolute Zero ``code_o``) in a sandboxed subprocess.

What it promises, layer by layer (each layer alone stops the hostile cases it names):

1. Static check before anything runs (``check_code``): the AST may import only whitelisted
   modules (no ``os``, ``sys``, ``subprocess``, ``socket``, ...), may not call ``eval``/``exec``/
   ``open``/``__import__``/..., and may not touch any attribute or name that starts with ``_``
   (which closes ``().__class__.__subclasses__()`` and ``random._os`` style escapes).
2. The child process: ``python -I -S -B`` (isolated, no site, no bytecode) with an empty
   environment, in a fresh temporary directory, in its own session (so a timeout kills the whole
   process group), under ``resource`` limits that a trusted stub sets before it execs the program:
   CPU seconds, address space, file size (stdout goes to a file, so gigabytes of output end in
   SIGXFSZ), open files, and no new processes (RLIMIT_NPROC; the kernel does not enforce it for
   root, hence layer 3).
3. Inside the child, before the code runs: process creation (``os.fork``, ``os.system``,
   ``os.exec*``, ``os.spawn*``, ``posix_spawn``, ...) is replaced by a function that raises, and
   ``socket``, ``ssl``, ``subprocess``, ``multiprocessing``, ``ctypes`` cannot be imported: no
   network, no children, even as root.
4. A wall-clock timeout, and a determinism check: the program runs twice and the outputs must match.

Every failure is a ``SandboxResult`` with ``ok=False`` and a one-line ``reason``; nothing raises.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

ALLOWED_IMPORTS = ("math", "itertools", "functools", "collections", "heapq", "bisect", "string",
                   "re", "operator", "fractions", "decimal", "statistics", "typing", "dataclasses",
                   "copy", "random")
BANNED_CALLS = ("eval", "exec", "compile", "open", "__import__", "input", "breakpoint", "globals",
                "locals", "vars", "getattr", "setattr", "delattr", "memoryview", "help", "exit", "quit")

# Runs in the child before the untrusted code: no processes, no network, whatever is imported.
_PRELUDE = r'''
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
'''


class SandboxLimits(BaseModel):
    """Resource limits of one sandboxed run."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(3.0, gt=0, description="Wall-clock limit of one run (seconds).")
    cpu_s: int = Field(2, ge=1, description="CPU-time limit (RLIMIT_CPU, seconds).")
    memory_mb: int = Field(256, ge=32, description="Address-space limit (RLIMIT_AS, MiB).")
    max_output_bytes: int = Field(65536, ge=64, description="Largest stdout accepted (RLIMIT_FSIZE).")
    max_code_chars: int = Field(4000, ge=16, description="Longest program text accepted.")
    determinism_runs: int = Field(2, ge=1, description="Runs whose outputs must all match.")


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    output: str = ""  # stdout (stripped) when ok
    reason: str | None = None
    seconds: float = 0.0


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


def _check_node(node: ast.AST) -> str | None:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if isinstance(node, ast.ImportFrom) and node.level:
            return "relative imports are not allowed"
        for name in names:
            if name.split(".")[0] not in ALLOWED_IMPORTS:
                return f"import of {name!r} is not allowed (allowed: {', '.join(ALLOWED_IMPORTS)})"
    elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
        return f"access to attribute {node.attr!r} is not allowed (no private or dunder attributes)"
    elif isinstance(node, ast.Name) and (node.id.startswith("__") or node.id in BANNED_CALLS):
        return f"use of {node.id!r} is not allowed"
    elif isinstance(node, (ast.Global, ast.Nonlocal)):
        return f"{type(node).__name__.lower()} statements are not allowed"
    return None


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


def _command(prog: Path, lim: SandboxLimits) -> list[str]:
    return [sys.executable, "-I", "-S", "-B", "-c", _LIMITER, str(lim.cpu_s), str(lim.memory_mb * 1024 * 1024),
            str(lim.max_output_bytes), str(prog)]


def run_python(code: str, limits: SandboxLimits | None = None, check: bool = True) -> SandboxResult:
    """Run ``code`` (which prints its result) ``determinism_runs`` times; ``ok`` only when every
    run exits 0 within the limits and all outputs agree. ``check=False`` skips the static check
    (tests use it to show that the run-time layers hold on their own)."""
    lim = limits or SandboxLimits()
    if check:
        reason = check_code(code, lim.max_code_chars)
        if reason:
            return SandboxResult(False, reason=f"rejected before running: {reason}")
    outputs, t0 = [], time.perf_counter()
    for _ in range(lim.determinism_runs):
        res = _run_once(code, lim)
        if not res.ok:
            return res
        outputs.append(res.output)
    if len(set(outputs)) > 1:
        return SandboxResult(False, reason=f"nondeterministic: {len(set(outputs))} different outputs "
                                           f"in {len(outputs)} runs", seconds=time.perf_counter() - t0)
    return SandboxResult(True, output=outputs[0], seconds=time.perf_counter() - t0)


def _run_once(code: str, lim: SandboxLimits) -> SandboxResult:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-") as tmp:
        prog, out_path, err_path = Path(tmp) / "prog.py", Path(tmp) / "stdout", Path(tmp) / "stderr"
        prog.write_text(_PRELUDE + "\n" + code)
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen(_command(prog, lim), cwd=tmp, env={}, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=err, start_new_session=True, close_fds=True)
            except OSError as e:
                return SandboxResult(False, reason=f"could not start the sandbox: {e}")
            try:
                code_ = proc.wait(timeout=lim.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return SandboxResult(False, reason=f"timeout: still running after {lim.timeout_s:g} s "
                                                   f"(wall clock)", seconds=time.perf_counter() - t0)
            finally:
                _kill_group(proc)  # whatever it left behind in its session
        seconds = time.perf_counter() - t0
        stdout = out_path.read_bytes()[: lim.max_output_bytes]
        stderr = err_path.read_bytes()[-2000:].decode("utf-8", "replace")
    if code_ != 0:
        return SandboxResult(False, reason=_explain(code_, stderr, lim), seconds=seconds)
    return SandboxResult(True, output=stdout.decode("utf-8", "replace").strip(), seconds=seconds)


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
        return f"killed by signal {signal.Signals(sig).name}"
    last = next((ln for ln in reversed(stderr.strip().splitlines()) if ln.strip()), "")
    if "MemoryError" in last:
        return f"memory limit: MemoryError under {lim.memory_mb} MiB"
    if "PermissionError" in last and "process creation" in last:
        return "process creation blocked (fork/exec/system)"
    if "halted; None in sys.modules" in last:
        return f"blocked in the sandbox (no network, no processes): {last[:200]}"
    if "OSError" in last and "File too large" in last:
        return f"output limit: more than {lim.max_output_bytes} bytes written"
    return f"exit code {code}: {last[:300]}" if last else f"exit code {code}"
