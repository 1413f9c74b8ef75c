"""Process lifecycle of ``asyncrl run``: children die with their parent, stop signals always work
(also when the launch inherited SIGINT as ignored, and while the CPU is saturated), a second stop
signal exits cleanly, and start-up waits for a slow learner instead of a fixed deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl import OPENMP_SPINCOUNT
from asyncrl.lifecycle import PARENT_ENV
from asyncrl.schedulers.local import LearnerExited, wait_for_addresses
from tests.conftest import ROOT, alive, cli, descendants, kill_tree, read_jsonl, subprocess_env

pytestmark = pytest.mark.slow

RUN = [
    "sampling.n=2",
    "sampling.max_new_tokens=4",
    "actor.tasks_per_batch=2",
    "train.batch_tasks=2",
    "train.total_steps=100000",
    "eval.size=4",
    "eval.every=0",
    "log.progress=false",
    "checkpoint.every=0",
    "actor.heartbeat_s=0.5",
]


def _env_without_openmp_settings() -> dict:
    """The test environment without the OpenMP wait settings (this process's own ``import asyncrl``
    set one), as a user's shell has it."""
    return {k: v for k, v in subprocess_env().items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}


def _start_run(tmp_path, tiny_overrides, name: str, ignore_sigint: bool = False) -> subprocess.Popen:
    """``asyncrl run`` in its own session, from an environment without OpenMP wait settings; with
    ``ignore_sigint`` it starts with SIGINT ignored, as every background job of a non-interactive
    shell does (``trap '' INT`` is inherited by exec)."""
    cmd = cli(
        "run",
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        *RUN,
        f"run_root={tmp_path}",
        f"name={name}",
    )
    if ignore_sigint:
        cmd = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *cmd]
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(
        cmd, cwd=ROOT, env=_env_without_openmp_settings(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _wait_training(proc: subprocess.Popen, run_dir, log, timeout: float = 240) -> set[int]:
    """Wait until the run has trained a step; returns the launcher's descendants (learner, actor)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        if read_jsonl(run_dir / "metrics.jsonl"):
            kids = descendants(proc.pid)
            if len(kids) >= 2:
                return kids
        time.sleep(0.2)
    raise AssertionError(f"no training step after {timeout:.0f}s: {log.read_text()[-3000:]}")


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.time() + timeout
    while alive(pids) and time.time() < deadline:
        time.sleep(0.2)
    return alive(pids)


class _BusyCPU:
    """Two processes spinning, so that the stop happens on a saturated 2-core machine."""

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def test_children_die_when_the_parent_is_killed(tmp_path, tiny_overrides):
    proc = _start_run(tmp_path, tiny_overrides, "orphans")
    kids: set[int] = set()
    try:
        kids = _wait_training(proc, tmp_path / "orphans", tmp_path / "orphans.log")
        # the learner and the actor are forked from the launcher (asyncrl.schedulers.fork): they share its
        # OpenMP runtime, loaded after `import asyncrl` bounded its spinning (OPENMP_SPINCOUNT, asyncrl/__init__.py;
        # test_importing_asyncrl_bounds_openmp_spinning_unless_the_user_chose)
        names = {pid: open(f"/proc/{pid}/comm").read().strip() for pid in kids}
        assert sorted(names.values()) == ["asyncrl-learn", "asyncrl-serve"], names
        proc.send_signal(signal.SIGKILL)  # no chance to clean up
        proc.wait(timeout=30)
        left = _wait_gone(kids, timeout=45)
        assert not left, f"children still alive 45 s after their parent was killed: {sorted(left)}"
    finally:
        kill_tree(proc, kids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_stops_the_run_and_all_children_on_a_busy_cpu(tmp_path, tiny_overrides, sig):
    name = f"stop-{sig.name}"
    proc = _start_run(tmp_path, tiny_overrides, name, ignore_sigint=True)
    kids: set[int] = set()
    try:
        kids = _wait_training(proc, tmp_path / name, tmp_path / f"{name}.log")
        with _BusyCPU():
            t0 = time.time()
            proc.send_signal(sig)  # to the launcher only, not its process group
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"asyncrl run still running 30 s after {sig.name}") from None
            left = _wait_gone(kids, timeout=max(1.0, 30 - (time.time() - t0)))
        log = (tmp_path / f"{name}.log").read_text()
        assert code == 128 + sig, log[-3000:]
        assert not left, f"children alive after {sig.name}: {sorted(left)}"
        assert "Traceback" not in log, log[-3000:]
        stops = [e for e in read_jsonl(tmp_path / name / "events.jsonl") if e["kind"] == "learner_stop"]
        assert stops and stops[0]["interrupted"], "the learner did not stop in order (no learner_stop event)"
    finally:
        kill_tree(proc, kids)


def test_a_second_stop_signal_kills_the_children_and_exits_cleanly(tmp_path, tiny_overrides):
    proc = _start_run(tmp_path, tiny_overrides, "twice", ignore_sigint=True)
    kids: set[int] = set()
    try:
        kids = _wait_training(proc, tmp_path / "twice", tmp_path / "twice.log")
        proc.send_signal(signal.SIGINT)
        deadline = time.time() + 30
        while "stopping (SIGINT)" not in (tmp_path / "twice.log").read_text() and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        assert not _wait_gone(kids, timeout=30)
        log = (tmp_path / "twice.log").read_text()
        assert code == 130 and "second stop signal" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    finally:
        kill_tree(proc, kids)


def test_a_child_whose_parent_is_already_gone_stops_at_once(tmp_path):
    """The race PR_SET_PDEATHSIG leaves open: the parent died before the child armed it."""
    code = (
        "import time; from asyncrl.lifecycle import watch_parent; watch_parent(grace_s=5); "
        "time.sleep(60); print('survived')"
    )
    env = dict(subprocess_env(), **{PARENT_ENV: "999999999"})  # not our parent
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == -signal.SIGTERM and "survived" not in res.stdout, res.stdout + res.stderr
    assert "parent 999999999 is gone" in res.stderr


def test_start_up_waits_for_a_slow_learner_and_says_so(tmp_path, capsys):
    """No fixed deadline: a learner that takes longer than any report interval to bind is waited
    for while it is alive; one that dies first is an error naming its exit code."""
    addr = tmp_path / "addresses.json"
    slow = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import json, sys, time; time.sleep(3); "
            f"open({str(addr)!r}, 'w').write(json.dumps({{'control': 'tcp://127.0.0.1:1'}}))",
        ]
    )
    try:
        assert wait_for_addresses(addr, slow, report_s=0.5) == {"control": "tcp://127.0.0.1:1"}
    finally:
        kill_tree(slow)
    assert "is still starting after" in capsys.readouterr().out
    dying = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(LearnerExited, match="code 3"):
        wait_for_addresses(tmp_path / "never.json", dying)


def test_a_process_started_by_hand_is_not_watched():
    code = "from asyncrl.lifecycle import watch_parent; print(watch_parent())"
    env = {k: v for k, v in subprocess_env().items() if k != PARENT_ENV}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "None", res.stderr
    assert os.environ.get(PARENT_ENV) is None


def test_freezing_the_start_up_heap_still_collects_what_comes_after():
    """``asyncrl learn`` freezes the objects alive after start-up (the collector stops walking them);
    cyclic garbage made afterwards is still collected."""
    code = (
        "import gc, json\n"
        "from asyncrl.lifecycle import freeze_startup_heap\n"
        "before = gc.get_freeze_count()\n"
        "freeze_startup_heap()\n"
        "class Node: pass\n"
        "a = Node(); a.self = a; del a\n"
        "print(json.dumps([before, gc.get_freeze_count(), gc.get_threshold()[0], gc.collect()]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    before, frozen, young, collected = json.loads(out.stdout)
    assert before == 0 and frozen > 1000, (before, frozen)
    assert young == 10_000
    assert collected >= 1  # the node, made after the freeze


@pytest.mark.parametrize(
    "given, expected",
    [({}, OPENMP_SPINCOUNT), ({"GOMP_SPINCOUNT": "500"}, "500"), ({"OMP_WAIT_POLICY": "active"}, None)],
)
def test_importing_asyncrl_bounds_openmp_spinning_unless_the_user_chose(given, expected):
    """``import asyncrl`` sets GOMP_SPINCOUNT before torch is loaded (so libgomp reads it), and keeps a
    spin count or wait policy the user set."""
    code = "import asyncrl, os, sys; assert 'torch' not in sys.modules; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**_env_without_openmp_settings(), **given},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(expected)
