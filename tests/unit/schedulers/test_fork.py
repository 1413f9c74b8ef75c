"""``asyncrl.schedulers.fork``: a child forked from the launcher looks like a freshly started
``asyncrl <args>`` (environment, argv, output, signals, descriptors, exit handlers, exit code), and
the launcher forks only while that is safe. Real forks, made from a fresh interpreter as the
launcher makes them (``tests/support/fork_cases.py``); each child runs a small function in place of
``asyncrl``'s ``main``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT, subprocess_env


def _case(tmp_path, *args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.fork_cases", *args[:1], str(tmp_path), *args[1:]],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_child_gets_its_environment_argv_output_and_exit_code(tmp_path):
    seen = _case(tmp_path, "environment")
    assert seen["code"] == 3 and seen["poll"] == 3
    assert seen["args"] == ["serve", "--index", "1"]
    assert seen["argv"][1:] == ["serve", "--index", "1"] and seen["argv"][0].endswith("asyncrl/__main__.py")
    assert seen["env"] == {"ONLY": "this"}
    assert seen["log"].splitlines() == ["to stdout", "to stderr"]


@pytest.mark.parametrize(
    "outcome, code, text", [("exit-message", 1, "a reason"), ("raise", 1, "ValueError: boom"), ("exit-none", 0, "")]
)
def test_how_a_child_ends_gives_its_exit_code(tmp_path, outcome, code, text):
    seen = _case(tmp_path, "ending", outcome)
    assert seen["code"] == code and text in seen["log"], seen


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_launchers_signal_handlers_are_not_the_childs(tmp_path, sig):
    """The launcher handles SIGINT and SIGTERM itself; a child has a new interpreter's: SIGTERM ends it,
    SIGINT raises KeyboardInterrupt, which ends it by the signal (had the launcher's handler run in
    the child, it would have gone on sleeping)."""
    seen = _case(tmp_path, "signals", sig.name)
    assert seen["ready"] and seen["code"] == -sig and seen["caught"] == [], seen


def test_descriptors_exec_would_close_are_closed_and_exit_handlers_are_the_childs_own(tmp_path):
    seen = _case(tmp_path, "descriptors")
    assert seen["code"] == 0
    opened = set(seen["fds"].values())  # what each of the child's descriptors is
    assert seen["private"] not in opened  # close-on-exec, as Python opens every file
    assert seen["shared"] in opened and {"0", "1", "2"} <= set(seen["fds"])  # made inheritable
    assert seen["child_handler"] and not seen["launcher_handler"]


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
    env = {k: v for k, v in subprocess_env().items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-5:] == ["False", "True", "False", "False", "Popen"], out.stdout
