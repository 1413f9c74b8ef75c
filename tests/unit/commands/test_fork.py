"""``asyncrl.schedulers.fork``: a child forked from the launcher looks like a freshly started
``asyncrl <args>`` (environment, argv, output, signals, descriptors, exit handlers, exit code), and
the launcher forks only while that is safe. Real forks of this process; each child runs a small
function in place of ``asyncrl``'s ``main``."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.schedulers.fork import ForkedProcess

from tests.conftest import ROOT


def _wait_for(path, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not path.exists() and time.time() < deadline:
        time.sleep(0.02)
    assert path.exists(), f"the child wrote no {path} in {timeout:.0f} s"


def test_a_child_gets_its_environment_argv_output_and_exit_code(tmp_path):
    log = tmp_path / "child.log"

    def child(args):
        print("to stdout", flush=False)  # unbuffered, as with PYTHONUNBUFFERED: no flush needed
        print("to stderr", file=sys.stderr)
        (tmp_path / "seen.json").write_text(json.dumps({"args": args, "argv": sys.argv, "env": dict(os.environ)}))
        return 3

    with open(log, "w") as out:
        proc = ForkedProcess(["serve", "--index", "1"], {"ONLY": "this"}, out, target=child)
    assert proc.wait(timeout=60) == 3 and proc.poll() == 3
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["args"] == ["serve", "--index", "1"]
    assert seen["argv"][1:] == ["serve", "--index", "1"] and seen["argv"][0].endswith("asyncrl/__main__.py")
    assert seen["env"] == {"ONLY": "this"}
    assert log.read_text().splitlines() == ["to stdout", "to stderr"]


@pytest.mark.parametrize("outcome, code, text", [("exit-message", 1, "a reason"), ("raise", 1, "ValueError: boom"),
                                                 ("exit-none", 0, "")])
def test_how_a_child_ends_gives_its_exit_code(tmp_path, outcome, code, text):
    def child(args):
        if outcome == "exit-message":
            sys.exit("a reason")
        if outcome == "raise":
            raise ValueError("boom")
        sys.exit()

    with open(tmp_path / "child.log", "w") as out:
        proc = ForkedProcess(["learn"], {}, out, target=child)
    assert proc.wait(timeout=60) == code
    assert text in (tmp_path / "child.log").read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_launchers_signal_handlers_are_not_the_childs(tmp_path, sig):
    """The launcher handles SIGINT and SIGTERM itself; a child has a new interpreter's: SIGTERM ends it,
    SIGINT raises KeyboardInterrupt, which ends it by the signal."""
    caught = []
    old = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        def child(args):
            (tmp_path / "ready").write_text("")
            time.sleep(120)
            return 0

        proc = ForkedProcess(["serve"], {}, target=child)
        _wait_for(tmp_path / "ready")
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == -sig
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    assert caught == []  # (and the launcher's handler never ran in the child: it would have exited 0 at once)


def test_descriptors_exec_would_close_are_closed_and_exit_handlers_are_the_childs_own(tmp_path):
    private = open(tmp_path / "launcher-private", "w")  # close-on-exec, as Python opens every file
    shared_r, shared_w = os.pipe()
    os.set_inheritable(shared_w, True)
    def launchers_handler():
        (tmp_path / "launcher-handler-ran").write_text("")

    atexit.register(launchers_handler)
    try:
        def child(args):
            fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
            (tmp_path / "fds.json").write_text(json.dumps(fds))
            atexit.register(lambda: (tmp_path / "child-handler-ran").write_text(""))
            return 0

        proc = ForkedProcess(["learn"], {}, target=child)
        assert proc.wait(timeout=60) == 0
        fds = json.loads((tmp_path / "fds.json").read_text())
        assert private.fileno() not in fds and shared_r not in fds  # (both close-on-exec)
        assert shared_w in fds and {0, 1, 2} <= set(fds)
        assert (tmp_path / "child-handler-ran").exists()
        assert not (tmp_path / "launcher-handler-ran").exists()
    finally:
        atexit.unregister(launchers_handler)
        private.close()
        os.close(shared_r)
        os.close(shared_w)


def test_the_launcher_forks_only_while_no_thread_pool_has_started():
    """After the imports (NumPy's OpenBLAS pool is running: it is fork-safe) forking is allowed; once a
    torch operation has started OpenMP's pool, or while a Python thread runs, it is not, and the
    process is started with exec instead. In a fresh interpreter, as the launcher is."""
    code = """
import threading, time, torch
from asyncrl.schedulers import fork
before = fork.safe_to_fork()
fork.preload(("torch",))
after_imports = fork.safe_to_fork()
t = threading.Thread(target=time.sleep, args=(1,)); t.start()
with_a_thread = fork.safe_to_fork(); t.join()
a = torch.ones(512, 512); (a @ a).sum(); (torch.ones(4_000_000) * 2).sum()
after_a_matmul = fork.safe_to_fork()
proc = fork.start(["--help"], {}, open("/dev/null", "w"), fork=True)
assert proc.wait() == 0
print(before, after_imports, with_a_thread, after_a_matmul, type(proc).__name__)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "2"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-5:] == ["False", "True", "False", "False", "Popen"], out.stdout
