"""Forks for ``tests/unit/schedulers/test_fork.py``, made from a fresh interpreter as ``asyncrl run``
forks (a pytest worker has threads of its own, and a fork of a process with threads is what the
launcher never does). ``python -m tests.support.fork_cases CASE DIR``: forks a child that runs the case's
function in place of ``asyncrl``'s ``main`` and prints one JSON line of what was observed."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path

from asyncrl.schedulers.fork import ForkedProcess


def _wait_for(path: Path, timeout: float = 120.0) -> bool:
    deadline = time.time() + timeout
    while not path.exists() and time.time() < deadline:
        time.sleep(0.02)
    return path.exists()


def environment(d: Path) -> dict:
    def child(args):
        print("to stdout", flush=False)  # unbuffered, as with PYTHONUNBUFFERED: no flush needed
        print("to stderr", file=sys.stderr)
        (d / "seen.json").write_text(json.dumps({"args": args, "argv": sys.argv, "env": dict(os.environ)}))
        return 3

    with open(d / "child.log", "w") as out:
        proc = ForkedProcess(["serve", "--index", "1"], {"ONLY": "this"}, out, target=child)
    code = proc.wait(timeout=120)
    return {
        "code": code,
        "poll": proc.poll(),
        **json.loads((d / "seen.json").read_text()),
        "log": (d / "child.log").read_text(),
    }


def ending(d: Path, outcome: str) -> dict:
    def child(args):
        if outcome == "exit-message":
            sys.exit("a reason")
        if outcome == "raise":
            raise ValueError("boom")
        sys.exit()

    with open(d / "child.log", "w") as out:
        proc = ForkedProcess(["learn"], {}, out, target=child)
    return {"code": proc.wait(timeout=120), "log": (d / "child.log").read_text()}


def signals(d: Path, name: str) -> dict:
    """This process handles SIGINT and SIGTERM itself, as the launcher does."""
    caught = []
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, frame: caught.append(signum))

    def child(args):
        (d / "ready").write_text("")
        time.sleep(120)
        return 0

    proc = ForkedProcess(["serve"], {}, None, target=child)
    ready = _wait_for(d / "ready")
    proc.send_signal(getattr(signal, name))
    return {"ready": ready, "code": proc.wait(timeout=120), "caught": caught}


def descriptors(d: Path) -> dict:
    private = open(d / "launcher-private", "w")  # close-on-exec, as Python opens every file
    shared = open(d / "launcher-inheritable", "w")
    os.set_inheritable(shared.fileno(), True)  # (as a descriptor passed on with pass_fds)
    atexit.register(lambda: (d / "launcher-handler-ran").write_text(""))

    def child(args):
        links = {}
        for n in os.listdir("/proc/self/fd"):
            try:
                links[n] = os.readlink(f"/proc/self/fd/{n}")
            except OSError:  # (the listing's own descriptor)
                pass
        (d / "fds.json").write_text(json.dumps(links))
        atexit.register(lambda: (d / "child-handler-ran").write_text(""))
        return 0

    proc = ForkedProcess(["learn"], {}, None, target=child)
    code = proc.wait(timeout=120)
    out = {
        "code": code,
        "fds": json.loads((d / "fds.json").read_text()),
        "private": str(d / "launcher-private"),
        "shared": str(d / "launcher-inheritable"),
        "child_handler": (d / "child-handler-ran").exists(),
        "launcher_handler": (d / "launcher-handler-ran").exists(),
    }
    (d / "launcher-handler-ran").unlink(missing_ok=True)  # (this process's own exit writes it again)
    private.close()
    shared.close()
    return out


if __name__ == "__main__":
    case, folder, *rest = sys.argv[1:]
    print(json.dumps(globals()[case](Path(folder), *rest)), flush=True)
