"""``asyncrl run --scheduler ray`` on a local Ray cluster that asyncrl starts itself (127.0.0.1): a
learner group with keys beside another Ray cluster on this host, nothing listening beyond loopback,
Ctrl-C leaving no process; an actor that fails for good is the learner's stop reason; misconfigured
clusters fail in seconds with one line. Across hosts: ``tests/e2e/test_ray_hosts.py``."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, kill_tree, read_jsonl, run_cli

# Ray reads its settings (token auth) when first imported: only the cluster fixture imports it here,
# after setting them. make test installs the ray extra, so CI never skips these.
if importlib.util.find_spec("ray") is None:
    pytest.skip("the ray extra is not installed (pip install '.[ray]')", allow_module_level=True)

from tests.support.ray_cluster import DEADLINE_S, Driver, _cmdline, _descendants, _listening, _metrics, ray_env  # noqa: E402,F401


@pytest.fixture
def foreign_cluster(ray_env):
    """Another Ray cluster on this host, as another user's would be: started by ``ray start --head``
    in Ray's default temp dir, so that ``/tmp/ray/ray_current_cluster`` names it (issue 41.9: a run
    found it there and crashed with ``ValueError: num_cpus``). Its head is stopped afterwards."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--include-dashboard=false",
            "--num-cpus=1",
            "--disable-usage-stats",
        ],
        env=ray_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    marker = Path("/tmp/ray/ray_current_cluster")
    try:
        deadline = time.time() + DEADLINE_S
        while time.time() < deadline and not (marker.exists() and marker.read_text().strip().endswith(f":{port}")):
            assert head.poll() is None, "the foreign Ray head did not start"
            time.sleep(0.5)
        assert marker.read_text().strip().endswith(f":{port}")
        yield port
    finally:
        head.send_signal(signal.SIGTERM)  # (--block: the head stops what it started)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        kill_tree(head)
        if marker.exists() and marker.read_text().strip().endswith(f":{port}"):
            marker.unlink()


@pytest.mark.slow
def test_a_learner_group_with_keys_on_a_local_cluster_and_nothing_left_after_ctrl_c(ray_env, tmp_path, foreign_cluster):
    """A run on a local cluster that asyncrl starts, with a 2-process learner group and CURVE keys
    handed out through Ray (``launch.ray.secure=always``), beside another Ray cluster on this host: it
    starts a cluster of its own and trains; Ctrl-C leaves no process of it (asyncrl, raylet, GCS, Ray
    workers)."""
    run = tmp_path / "local"
    driver = Driver(
        [
            "-c",
            "configs/quickstart.yaml",
            "--scheduler",
            "ray",
            "--learner-procs",
            "2",
            f"run_root={tmp_path}",
            "name=local",
            "train.total_steps=100000",
            "actor.num=2",
            "eval.size=20",
            "eval.every=100000",
            "launch.ray.secure=always",
        ],
        ray_env,
    )
    try:
        driver.wait_for(lambda: len(_metrics(run)) >= 3, "three training steps")
        assert "CURVE keys on" in driver.text and (run / "keys" / "server" / "server.key_secret").is_file()
        assert "2 learner processes (ddp)" in driver.text
        actors_keys = [p for p in _descendants(driver.proc.pid) if "-m asyncrl serve" in _cmdline(p)]
        assert actors_keys and all("wire.curve_dir=" in _cmdline(p) for p in actors_keys)  # each its own bundle
        assert not any(
            (Path(d) / "server.key_secret").exists()  # and never the learner's secret
            for p in actors_keys
            for d in re.findall(r"wire.curve_dir=(\S+)", _cmdline(p))
        )
        pids = _descendants(driver.proc.pid)
        assert any("raylet" in _cmdline(p) for p in pids) and any("-m asyncrl " in _cmdline(p) for p in pids)
        # nothing of the run listens beyond loopback (Ray's GCS, raylet, workers; the learner, the relay)
        listening = _listening(pids | {driver.proc.pid})
        wide = [
            (a, p, _cmdline(p)[:200])
            for a, p in listening
            if not a.startswith(("127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:"))
        ]  # (the last: v4-mapped loopback)
        assert listening and not wide, wide
        driver.proc.send_signal(signal.SIGINT)
        assert driver.proc.wait(timeout=120) != 0
        driver.check_stopped_output()
        deadline = time.time() + 60
        while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.5)
        left = [(p, _cmdline(p)) for p in pids if Path(f"/proc/{p}").exists() and _cmdline(p)]
        assert not left, left
    finally:
        kill_tree(driver.proc)


@pytest.mark.slow
def test_an_actor_that_fails_for_good_is_the_learners_stop_reason(ray_env, tmp_path, tiny_overrides):
    """42.5: an actor whose reward always raises, with no restarts left: the driver says which actor
    and why in one line, and the learner (on its node) gives that as its stop reason, exit code 1."""
    proc = run_cli(
        "run",
        "-c",
        "configs/quickstart.yaml",
        *tiny_overrides,
        "--scheduler",
        "ray",
        f"run_root={tmp_path}",
        "name=broken",
        "launch.ray.max_restarts=0",
        "env.reward=tests.support.plugins:broken_reward",
        "train.total_steps=50",
        "eval.size=4",
        "eval.every=0",
        "log.progress=false",
        "checkpoint.every=0",
        cwd=ROOT,
        env=ray_env,
        timeout=DEADLINE_S,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    said = [x for x in out.splitlines() if x.startswith("[asyncrl] actor-0 is gone for good")]
    assert len(said) == 1 and "KeyError" in said[0] and "actor-0.log" in said[0], out[-4000:]  # its error
    stop = [e for e in read_jsonl(tmp_path / "broken" / "events.jsonl") if e["kind"] == "learner_stop"][-1]
    assert stop["reason"].startswith("actor-0 is gone for good") and "KeyError" in stop["reason"], stop
    assert "stopped by a stop signal" not in out


def _fails_fast(args: list[str], env: dict, expect: str, within_s: float) -> None:
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "run", "-c", "configs/quickstart.yaml", "--scheduler", "ray", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=within_s + 60,
    )
    took = time.time() - t0
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if expect in x]
    assert proc.returncode != 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert took < within_s, f"took {took:.0f} s"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_an_unreachable_cluster_fails_in_seconds_with_one_line(ray_env, tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _fails_fast(
        [f"run_root={tmp_path}", "launch.ray.connect_timeout_s=2"],
        {**ray_env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
        "cannot reach the Ray cluster at 127.0.0.1",
        within_s=45,
    )


def test_without_ray_installed_the_run_says_so(ray_env, tmp_path):
    shim = tmp_path / "noray"
    (shim / "ray").mkdir(parents=True)
    (shim / "ray" / "__init__.py").write_text("raise ImportError('No module named ray (test shim)')\n")
    env = {**ray_env, "PYTHONPATH": f"{shim}{os.pathsep}{ray_env.get('PYTHONPATH', '')}"}
    _fails_fast([f"run_root={tmp_path}"], env, "needs Ray, which is not installed", within_s=45)


@pytest.mark.slow
def test_resources_no_node_has_fail_at_once_naming_them(ray_env, tmp_path):
    _fails_fast(
        [f"run_root={tmp_path}", "launch.actor.gpus=1"],
        ray_env,
        "no node of the Ray cluster can host an actor (launch.actor)",
        within_s=90,
    )


# --- across hosts made of network namespaces (asyncrl/testing/netns.py) ---------------------------------------


def _actor_pids(control: str) -> list[int]:
    """The ``asyncrl serve`` processes of the run whose learner is at ``control``."""
    return [
        int(d.name)
        for d in Path("/proc").iterdir()
        if d.name.isdigit() and " serve " in (c := _cmdline(int(d.name))) and control in c
    ]


@pytest.mark.slow
def test_preempted_actors_are_restarted_and_every_task_is_trained_once(ray_env, tmp_path, tiny_overrides):
    """Issue 66, spot preemption under Ray: actor processes killed with SIGKILL at random points are
    restarted by Ray and re-join; the run finishes, and every task of each closed epoch was trained
    exactly once (the ledger against the episode archive), nothing trained twice."""
    import json
    import random

    from tests.support.ledger_checks import check_exactly_once, task_files

    train, heldout = task_files(tmp_path)
    driver = Driver(
        [
            "-c",
            "configs/quickstart.yaml",
            *tiny_overrides,
            "--scheduler",
            "ray",
            "--actors",
            "2",
            f"run_root={tmp_path}",
            "name=preempt",
            "tasks.type=file",
            f"tasks.path={train}",
            f"tasks.eval_path={heldout}",
            "sampling.n=4",
            "actor.tasks_per_batch=4",
            "train.batch_tasks=4",
            "train.total_steps=300",
            "launch.ray.max_restarts=10",
            "wire.lease_s=3",
            "actor.heartbeat_s=0.5",
            "log.archive_episodes=true",
            "eval.every=0",
            "log.progress=false",
            "checkpoint.every=0",
        ],
        ray_env,
    )
    run_dir = tmp_path / "preempt"
    rng = random.Random(66)
    try:
        driver.wait_for(lambda: len(_metrics(run_dir)) >= 3, "3 steps")
        control = json.loads((run_dir / "addresses.json").read_text())["control"]
        for k in range(3):
            driver.wait_for(lambda: len(_actor_pids(control)) == 2, "two actors running")
            victim = rng.choice(_actor_pids(control))
            at = len(_metrics(run_dir))
            os.kill(victim, signal.SIGKILL)
            driver.wait_for(
                lambda v=victim: v not in _actor_pids(control) and len(_actor_pids(control)) == 2,
                f"the killed actor {k + 1} restarted by Ray",
            )
            driver.wait_for(lambda at=at: len(_metrics(run_dir)) >= at + 3, "training going on after the kill")
        driver.proc.wait(timeout=DEADLINE_S)
        assert driver.proc.returncode == 0, driver.text[-4000:]
    finally:
        kill_tree(driver.proc)
    check_exactly_once(run_dir)
