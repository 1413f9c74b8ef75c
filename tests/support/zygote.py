"""A preloaded process that forks the ``asyncrl`` commands the tests start, as ``asyncrl
run`` forks its own children (:mod:`asyncrl.schedulers.fork`): ``conftest.run_cli`` and the tests that start learners and
actors by hand (``conftest.start_cli`` with a log file, ``ResumableRun``) would otherwise pay about
5 s of CPU importing torch and transformers for every process.

``python -m tests.support.zygote STATUS_DIR``: imports what the commands need, then reads one JSON request a
line on stdin (``{"args": [...], "env": {...}, "log": path, "stderr": path or null}``) and answers one line, ``{"pid": N}``
(``null``: it could not fork safely; the caller starts the process with exec instead). Each child
is in a session of its own (so ``kill_tree`` reaches it as before), reads /dev/null, and writes to
its log. The zygote reaps its children and writes each exit code to ``STATUS_DIR/<pid>``, which
:class:`ZygoteChild`, the test's handle, reads. It exits when its stdin closes.
"""

from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
from pathlib import Path

from asyncrl.schedulers.fork import ProcessHandle


class ZygoteChild(ProcessHandle):
    """The test's handle on a process the zygote forked: its exit code comes from the status file."""

    def __init__(self, pid: int, status_dir: Path, args: list[str]):
        self.pid, self.args, self.returncode = pid, ["asyncrl", *args], None
        self._status = status_dir / str(pid)

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        return self.returncode


class Zygote:
    """The test process's zygote, started on first use."""

    def __init__(self, status_dir: Path, env: dict):
        self.status_dir = status_dir
        status_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", str(status_dir)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def start(self, args: list[str], env: dict, log: Path, stderr: Path | None = None) -> ZygoteChild | None:
        """``asyncrl <args>`` writing to ``log`` (and its errors to ``stderr`` when given, else to ``log``)."""
        if self.proc.poll() is not None:
            return None
        req = {"args": list(args), "env": env, "log": str(log), "stderr": str(stderr) if stderr else None}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        pid = json.loads(line)["pid"] if line else None
        return ZygoteChild(pid, self.status_dir, list(args)) if pid else None

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def _serve(status_dir: Path) -> None:
    from asyncrl.commands.cli import main
    from asyncrl.schedulers import fork

    fork.preload()

    def child(stderr: str | None, args: list[str]) -> int:
        os.setsid()
        for path, fd, flags in ((os.devnull, 0, os.O_RDONLY), (stderr, 2, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            if path:
                opened = os.open(path, flags, 0o644)
                os.dup2(opened, fd)
                os.close(opened)
        return main(args)

    requests = sys.stdin
    while True:
        _reap(status_dir)
        ready, _, _ = select.select([requests], [], [], 0.1)
        if not ready:
            continue
        line = requests.readline()
        if not line:
            return
        req = json.loads(line)
        pid = None
        if fork.safe_to_fork():
            with open(req["log"], "w") as log:
                pid = fork.ForkedProcess(
                    req["args"], req["env"], log, target=functools.partial(child, req["stderr"])
                ).pid
            (status_dir / str(pid)).unlink(missing_ok=True)  # (a status left by an earlier process of this pid)
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()


def _reap(status_dir: Path) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        tmp = status_dir / f".{pid}"
        tmp.write_text(str(os.waitstatus_to_exitcode(status)))
        tmp.rename(status_dir / str(pid))


if __name__ == "__main__":
    _serve(Path(sys.argv[1]))
