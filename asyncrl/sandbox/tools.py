"""Model-chosen tool calls of a verifiers toolset, run in the bubblewrap sandbox.

A verifiers ``Toolset`` (``env.type=verifiers``) is the environment author's code, but which tool is
called, and with which arguments, is the model's choice: a ``read_file`` or ``run`` tool called by a
policy being trained is hostile input. So no tool runs in the actor's process. One
:class:`ToolSandbox` per task class and task config keeps a Python worker under bubblewrap
(:mod:`asyncrl.sandbox.bwrap`: new user, PID, network, IPC and mount namespaces, uid 65534, no
network, a read-only view of the Python install, its packages and the task's own package, a
private ``/tmp``, an empty environment) that builds the task's toolsets once and answers calls as
JSON lines; the actor's files, home directory, run directory and sockets are not there.

- A call that takes longer than ``timeout_s`` kills the worker (a new one starts at the next call)
  and is answered as an error the model sees, as a tool server would; so are a tool's exception,
  an unknown tool and arguments that are not a JSON object.
- A reply is at most ``MAX_REPLY_BYTES``; the worker's memory and file sizes are bounded (rlimits).
- Runtimes: a toolset's ``config.runtime`` must be verifiers' ``subprocess`` runtime (which this
  honours, more strictly) and its ``config.url`` unset; any other (docker, e2b, modal, prime, ...)
  or an external server is refused in one line (:func:`check_toolsets`), never silently replaced.
- Where bubblewrap does not work, a taskset with tools is refused in one line (no fallback).
"""

from __future__ import annotations

import collections
import json
import os
import select
import subprocess
import threading
import time
from pathlib import Path

from ..config import ConfigError
from . import bwrap

MAX_REPLY_BYTES = 1 << 20
MEMORY_BYTES = 4 << 30  # the worker's address space (the verifiers import alone takes a few hundred MB)
START_TIMEOUT_S = 120.0  # importing verifiers in a fresh interpreter takes seconds on a loaded machine
_SYSTEM_LIBS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64")


def check_toolsets(toolsets: list, where: str) -> None:
    """ConfigError (one line) for a toolset asyncrl cannot run in its sandbox: another runtime than
    verifiers' ``subprocess``, or an external server (``url``)."""
    for ts in toolsets:
        cfg = getattr(ts, "config", None)
        runtime = getattr(getattr(cfg, "runtime", None), "type", "subprocess")
        name = type(ts).__name__
        if getattr(cfg, "url", None):
            raise ConfigError(
                f"{where}: toolset {name} is served at {cfg.url} (config.url); asyncrl runs a "
                f"toolset's tools in its own bubblewrap sandbox and does not call external tool "
                f"servers: leave url unset"
            )
        if runtime != "subprocess":
            raise ConfigError(
                f"{where}: toolset {name} asks for runtime {runtime!r}; asyncrl runs tools in its "
                f"bubblewrap sandbox, which stands for verifiers' 'subprocess' runtime only, so a "
                f"{runtime!r} runtime is refused rather than ignored"
            )


def _import_root(module: str) -> tuple[str, str]:
    """``(path to bind, directory to put on sys.path)`` for ``module``'s top-level package (or the
    module file itself for a top-level module)."""
    top = __import__(module.split(".")[0])
    path = getattr(top, "__file__", None)
    if path is None:  # a namespace package
        path = next(iter(top.__path__))
        return path, str(Path(path).parent)
    path = os.path.realpath(path)
    if Path(path).name == "__init__.py":
        pkg = str(Path(path).parent)
        return pkg, str(Path(pkg).parent)
    return path, str(Path(path).parent)


def _site_dirs() -> list[str]:
    """The package directories of this interpreter (a virtual environment's site-packages)."""
    import site

    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    return [os.path.realpath(d) for d in dict.fromkeys(dirs) if os.path.isdir(d)]


# The worker: runs inside the sandbox as its program file. SPEC is filled in by ToolSandbox.
_WORKER = r"""
import asyncio, importlib, inspect, json, os, resource, site, sys
SPEC = json.loads(%r)
for name, limit in (("RLIMIT_AS", SPEC["memory"]), ("RLIMIT_FSIZE", 64 << 20), ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), (limit, limit))
out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # what tools print goes to stderr, never into the replies
sys.stdout = sys.stderr
for d in SPEC["site"]:
    site.addsitedir(d)
sys.path.insert(0, SPEC["root"])

def obj(path):
    mod, _, qual = path.partition(":")
    o = importlib.import_module(mod)
    for part in qual.split("."):
        o = getattr(o, part)
    return o

def reply(**kw):
    text = json.dumps(kw, default=str)
    if len(text) > SPEC["max_reply"]:
        text = json.dumps({"ok": False, "error": f"the tool's reply is {len(text)} bytes; at most {SPEC['max_reply']}"})
    out.write(text + "\n")

try:
    from verifiers.v1.utils.decorators import discover_decorated
    config = obj(SPEC["config_cls"]).model_validate_json(SPEC["config"])
    impls = {}
    for toolset in obj(SPEC["task_cls"]).toolsets(config):
        for fn in discover_decorated(toolset, "tool"):
            impls[getattr(fn, "tool_name", None) or fn.__name__] = fn
except BaseException as e:
    reply(ready=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    raise SystemExit(1)
reply(ready=True, tools=sorted(impls))
for line in sys.stdin:
    try:
        req = json.loads(line)
        fn = impls.get(req["name"])
        if fn is None:
            reply(ok=False, error=f"no tool {req['name']!r}; tools: {', '.join(sorted(impls))}")
            continue
        args = json.loads(req["arguments"] or "{}")
        if not isinstance(args, dict):
            raise ValueError("arguments must be a JSON object")
        result = fn(**args)
        if inspect.isawaitable(result):
            result = asyncio.run(asyncio.wait_for(result, SPEC["timeout"]))
        reply(ok=True, result=result if isinstance(result, str) else json.dumps(result, default=str))
    except BaseException as e:
        reply(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
"""


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether ``fd`` has something to read (or its writer is gone) within ``timeout_s``. ``poll``,
    not ``select``: select takes no descriptor past 1,023, and an actor whose endpoint serves a
    thousand agents holds more than that (the tools' pipes then failed with "filedescriptor out of
    range in select()")."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0.0, timeout_s) * 1000))


class ToolSandbox:
    """One sandboxed worker serving the tools of ``task_cls.toolsets(config)`` (module doc)."""

    def __init__(self, task_cls: type, config, timeout_s: float = 60.0):
        reason = bwrap.unavailable()
        if reason is not None:
            raise ConfigError(
                f"env.type=verifiers: this taskset's tools run only in the bubblewrap sandbox, "
                f"which does not work here: {reason}"
            )
        self.timeout_s = float(timeout_s)
        bind, root = _import_root(task_cls.__module__)
        config_cls = type(config)
        spec = {
            "site": _site_dirs(),
            "root": root,
            "task_cls": f"{task_cls.__module__}:{task_cls.__qualname__}",
            "config_cls": f"{config_cls.__module__}:{config_cls.__qualname__}",
            "config": config.model_dump_json(),
            "timeout": self.timeout_s,
            "max_reply": MAX_REPLY_BYTES,
            "memory": MEMORY_BYTES,
        }
        self._program = (_WORKER % json.dumps(spec)).encode()
        self._binds = [*spec["site"], bind]
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.tools: list[str] = []
        self.starts = 0

    # -- the worker -------------------------------------------------------------------------------
    def _argv(self, program_fd: int) -> list[str]:
        probe = bwrap.probe()
        install = bwrap.python_install()
        system = tuple(d for d in _SYSTEM_LIBS if os.path.lexists(d))
        roots = tuple(os.path.realpath(d) + os.sep for d in system)
        # the system's library directories whole (packages' extension modules load more of them than the
        # standard library does), and the interpreter's own libraries that lie elsewhere (libpython)
        libs = tuple(
            (real, path)
            for real, path in install.libs
            if not (real.startswith(roots) or os.path.realpath(path).startswith(roots))
        )
        install = bwrap.PythonInstall(install.executable, install.dirs, libs, system)
        return bwrap.sandbox_argv(
            [install.executable, "-I", "-S", "-B", bwrap.PROGRAM_PATH],
            install,
            program_fd=program_fd,
            tmp_mb=64,
            features=probe.features,
            bwrap=probe.bwrap,
            extra_ro=tuple(self._binds),
        )

    def _start(self) -> None:
        fd = os.memfd_create("asyncrl-tools")
        try:
            os.write(fd, self._program)
            os.lseek(fd, 0, os.SEEK_SET)
            self._proc = subprocess.Popen(
                self._argv(fd),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(fd,),
                env={},
                start_new_session=True,
            )
        finally:
            os.close(fd)
        self._stderr = collections.deque(maxlen=20)  # the last lines, for a failure's reason
        threading.Thread(target=self._drain, args=(self._proc.stderr, self._stderr), daemon=True).start()
        self.starts += 1
        first = self._read(START_TIMEOUT_S)
        if not first or not first.get("ready"):
            self.close()
            why = (first or {}).get("error") or (list(self._stderr) or ["it did not start"])[-1]
            raise RuntimeError(f"the sandboxed tool worker could not build the toolsets: {why}")
        self.tools = list(first.get("tools", []))

    @staticmethod
    def _drain(stream, keep) -> None:
        """Read what the worker (and its tools) print on stderr, keeping the last lines."""
        try:
            while chunk := stream.read1(1 << 16):  # (chunks: a line without an end costs no memory)
                keep.extend(t[:300] for t in chunk.decode("utf-8", "replace").splitlines() if t.strip())
        except (OSError, ValueError):
            pass

    def _read(self, timeout_s: float) -> dict | None:
        """The worker's next reply line, or None when it does not come within ``timeout_s`` (or the
        worker is gone)."""
        proc = self._proc
        deadline = time.monotonic() + timeout_s
        buf = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not _readable(proc.stdout.fileno(), left):
                return None
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                return None
            buf += chunk
            if b"\n" in buf:
                line = buf.split(b"\n", 1)[0]
                try:
                    return json.loads(line)
                except ValueError:
                    return None
            if len(buf) > 2 * MAX_REPLY_BYTES:
                return None

    def call(self, name: str, arguments: str) -> str:
        """The tool's result as the model sees it (errors included: ``error: ...``)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._proc.stdin.write((json.dumps({"name": name, "arguments": arguments}) + "\n").encode())
                self._proc.stdin.flush()
            except OSError:
                self.close()
                return "error: the tool sandbox ended; try again"
            rep = self._read(self.timeout_s + 5)
            if rep is None:
                self.close()  # hung, or killed by its limits: the next call starts a fresh worker
                return f"error: the tool {name!r} did not answer within {self.timeout_s:g} s"
        if not rep.get("ok"):
            return f"error: {rep.get('error', 'the tool failed')}"
        return rep.get("result", "")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:  # (first: the stderr reader holds its stream until the worker is gone)
            try:
                os.killpg(proc.pid, 9)  # bwrap; the sandbox's processes die with it (--die-with-parent)
            except (ProcessLookupError, PermissionError):
                proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:
                pass


__all__ = ["ToolSandbox", "check_toolsets", "MAX_REPLY_BYTES"]
