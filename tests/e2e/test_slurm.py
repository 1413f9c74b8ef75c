"""``asyncrl run --scheduler slurm`` against a real SLURM (Debian's slurm-wlm and munge, a one-node
cluster started by the fixture, tests/support/slurm_cluster.py): the sbatch script it writes from the
config, a short job submitted with ``sbatch`` that trains to completion, and ``scancel`` mid-run,
which stops every process cleanly (the learner checkpoints) and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, subprocess_env
from tests.support.slurm_cluster import SlurmCluster, missing, stepds


def _run(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl", "run", "-c", "configs/quickstart.yaml", "--scheduler", "slurm", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_sbatch_script_carries_the_config_and_the_job_settings(tmp_path):
    proc = _run(
        [
            "--dry-run",
            "--overwrite",
            "--learner-procs",
            "2",
            f"run_root={tmp_path}",
            "name=job",
            "actor.num=3",
            "launch.slurm.nodes=3",
            "launch.slurm.partition=gpu",
            "launch.slurm.time=00:20:00",
            "launch.slurm.sbatch_args=[--qos=high]",
            "train.lr=3e-5",
        ],
        subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert f"Submit it on a login node with:\n  sbatch {tmp_path}/job.sbatch\n" in proc.stdout  # (issue 42.8)
    assert "asks for 3 node(s) for 00:20:00 on partition gpu" in proc.stdout
    script = (tmp_path / "job.sbatch").read_text()
    for line in (
        "#SBATCH --nodes=3",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=00:20:00",
        "#SBATCH --qos=high",
        f"#SBATCH --output={tmp_path}/job.slurm-%j.out",
    ):
        assert line in script, line
    assert "--overwrite" in script and "--learner-procs 2" in script and "--scheduler slurm" in script
    inline = script.split("<<'ASYNCRL_CONFIG_END'\n", 1)[1].split("\nASYNCRL_CONFIG_END", 1)[0]
    cfg = yaml.safe_load(inline)  # the resolved config travels inside the script (no shared filesystem)
    assert cfg["train"]["lr"] == 3e-5 and cfg["actor"]["num"] == 3 and cfg["run_root"] == str(tmp_path)
    assert not (tmp_path / "job").exists()  # the run directory is the job's to make, on its node
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0  # valid bash


def test_outside_slurm_without_sbatch_it_says_so(tmp_path):
    env = {**subprocess_env(), "PATH": "/nonexistent"}
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl",
            "run",
            "-c",
            "configs/quickstart.yaml",
            "--scheduler",
            "slurm",
            f"run_root={tmp_path}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "sbatch is not on PATH" in proc.stderr, proc.stderr
    assert (tmp_path / "quickstart.sbatch").exists()  # (written: submit it by hand)


@pytest.fixture
def slurm(tmp_path_factory):
    why = missing()
    if why:
        pytest.fail(f"a real SLURM is needed here ({why}); make test installs it")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _asyncrl_left(run_dir: Path, slurm_conf: str) -> list[str]:
    """asyncrl processes of this test: naming its run directory, or started by this cluster's jobs (their
    environment names its SLURM_CONF). Another test's processes (a Ray run beside this one) are not."""
    out = []
    conf = f"SLURM_CONF={slurm_conf}".encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                ours = str(run_dir) in cmd or conf in (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if "-m asyncrl " in cmd and ours:
                out.append(f"{d.name}: {cmd[:200]}")
    return out


def _scancel_checkpoints(slurm, tmp_path: Path, job: str, name: str) -> None:
    """Once run ``name`` (job ``job``) has trained 3 steps, ``scancel``: SIGTERM is the run's Ctrl-C, the
    learner checkpoints where it stopped, and every process of the job ends (step daemons too)."""
    metrics = tmp_path / name / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), slurm.logs()
        time.sleep(1)
    assert slurm.run("scancel", job).returncode == 0
    slurm.wait_gone(job, 120)
    out = (tmp_path / f"{name}.slurm-{job}.out").read_text()
    summary = json.loads(out.strip().splitlines()[-1])["summary"]
    assert "stop signal" in summary["stopped"], out[-2000:]
    assert (tmp_path / name / "checkpoints" / f"step_{summary['steps']:08d}").is_dir(), out[-2000:]
    deadline = time.time() + 60
    while time.time() < deadline and (_asyncrl_left(tmp_path, slurm.env["SLURM_CONF"]) or stepds(slurm.root)):
        time.sleep(0.5)
    assert not _asyncrl_left(tmp_path, slurm.env["SLURM_CONF"]) and not stepds(slurm.root)


@pytest.mark.slow
def test_a_job_trains_to_completion_and_scancel_stops_one_cleanly(slurm, tmp_path):
    env = {**subprocess_env(), **{k: v for k, v in slurm.env.items() if k == "SLURM_CONF"}}
    env.pop("SLURM_JOB_ID", None)
    # 1. submitted with sbatch: it trains to the end, the job completes
    proc = _run([f"run_root={tmp_path}", "name=short", "actor.num=2", "train.total_steps=8", "eval.size=20"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.split("submitted job ", 1)[1].split(":", 1)[0]
    assert slurm.wait_gone(job, 300) == "COMPLETED", slurm.logs()
    out = (tmp_path / f"short.slurm-{job}.out").read_text()
    summary = json.loads(out.strip().splitlines()[-1])["summary"]
    assert summary["steps_trained"] == 8, out[-2000:]
    assert "learner and 2 actor(s) on" in out
    assert (tmp_path / "short" / "actor-1.log").exists()  # (actors ran as srun steps of the job)

    # 2. scancel mid-run: SIGTERM is the run's Ctrl-C: the learner checkpoints where it stopped, all end
    proc = _run(
        [
            f"run_root={tmp_path}",
            "name=long",
            "actor.num=2",
            "train.total_steps=100000",
            "eval.size=20",
            "checkpoint.every=100000",
        ],
        env,
    )
    job = proc.stdout.split("submitted job ", 1)[1].split(":", 1)[0]
    _scancel_checkpoints(slurm, tmp_path, job, "long")


@pytest.fixture
def slurm_hosts(tmp_path_factory):
    """slurmctld on namespace host 0 and a slurmd on each of hosts 1 and 2 (nodes n1, n2)."""
    from asyncrl.testing import netns

    why = missing() or netns.available()
    if why:
        pytest.fail(f"a real SLURM across namespace hosts is needed here ({why}); make test installs it")
    with netns.Hosts(3) as hosts:
        cluster = SlurmCluster(tmp_path_factory.mktemp("slurm-hosts"), cpus=os.cpu_count() or 1, hosts=hosts)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()


@pytest.mark.slow
def test_across_hosts_the_actors_run_on_another_node_and_scancel_still_checkpoints(slurm_hosts, tmp_path):
    slurm, hosts = slurm_hosts, slurm_hosts.hosts
    env = {**subprocess_env(), "SLURM_CONF": slurm.env["SLURM_CONF"]}
    env.pop("SLURM_JOB_ID", None)

    def submit(*args: str) -> str:  # from the controller's host (the only way to reach slurmctld's address)
        proc = subprocess.run(
            hosts.enter(
                0,
                [
                    sys.executable,
                    "-m",
                    "asyncrl",
                    "run",
                    "-c",
                    "configs/quickstart.yaml",
                    "--scheduler",
                    "slurm",
                    "launch.slurm.nodes=2",
                    "launch.slurm.bind=iface:eth0",
                    "actor.num=2",
                    "eval.size=20",
                    f"run_root={tmp_path}",
                    *args,
                ],
            ),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout.split("submitted job ", 1)[1].split(":", 1)[0]

    # 1. a job over two nodes trains to the end: the learner on n1 (its own address, CURVE), the actors on n2
    # (both actors take part; every episode is logged, so that the check below does not hang on which
    # episodes log.episode_events=sampled happens to keep)
    job = submit("name=multi", "train.total_steps=8", "train.min_actors=2", "log.episode_events=all")
    assert slurm.wait_gone(job, 300) == "COMPLETED", slurm.logs()
    out = (tmp_path / f"multi.slurm-{job}.out").read_text()
    assert f"learner on n1 ({hosts.ips[1]}, CURVE keys), 2 actor(s) on n2" in out, out[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])["summary"]
    assert summary["steps_trained"] == 8, out[-2000:]
    events = [json.loads(line) for line in (tmp_path / "multi" / "events.jsonl").read_text().splitlines()]
    assert {e["actor_id"] for e in events if e.get("kind") == "episode"} == {"actor-0", "actor-1"}
    # n2's slurmd launched the actors' steps of this job (and n1's the batch script with the learner)
    n2 = (slurm.root / "slurmd-n2.log").read_text()
    assert f"StepId={job}.0" in n2 and f"StepId={job}.1" in n2, n2[-2000:]
    assert f"Launching batch job {job} " in (slurm.root / "slurmd-n1.log").read_text()

    # 2. scancel mid-run: the learner on n1 checkpoints where it stopped, every process on both nodes ends
    job = submit("name=long", "train.total_steps=100000", "checkpoint.every=100000")
    _scancel_checkpoints(slurm, tmp_path, job, "long")
