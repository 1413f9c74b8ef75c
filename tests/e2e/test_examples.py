"""Issue 42.2 and 42.8: the environment examples under ``examples/`` run as examples/README.md says
(real ``asyncrl run`` processes, a real OpenEnv server process); preflight refuses a run whose
OpenEnv server is not there in one line; ``--dry-run`` checks a run and starts nothing."""

from __future__ import annotations

import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import ROOT, kill_tree, read_jsonl, run_cli, subprocess_env

pytest.importorskip("verifiers.v1", reason="the envs extra (pip install -e '.[envs]') is not installed")
pytest.importorskip("openenv.core", reason="the envs extra (pip install -e '.[envs]') is not installed")

SHORT = [
    "train.total_steps=3",
    "train.batch_tasks=2",
    "actor.tasks_per_batch=2",
    "sampling.n=2",
    "eval.size=8",
    "eval.every=3",
    "log.progress=false",
    "checkpoint.every=0",
]


def _example(name: str, tmp_path, tiny_overrides, *extra: str, env: dict | None = None, cwd=ROOT):
    return run_cli(
        "run",
        "-c",
        str(ROOT / "examples" / f"{name}.yaml"),
        *tiny_overrides,
        f"run_root={tmp_path}",
        *SHORT,
        *extra,
        timeout=600,
        env=env,
        cwd=cwd,
    )


def _evals(run_dir):
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("kind") == "eval"]


@pytest.mark.slow
def test_the_verifiers_example_trains_on_its_taskset_with_its_rubric(tmp_path, tiny_overrides):
    res = _example("verifiers", tmp_path, tiny_overrides)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    run = tmp_path / "vf-sum"
    metrics = read_jsonl(run / "metrics.jsonl")
    assert len(metrics) == 3 and all("score/vf/digits" in m for m in metrics)  # the rubric's metric, logged
    evals = _evals(run)
    assert evals and all(e["size"] == 8 and e["failures"] == 0 for e in evals)
    assert all(s["prompt"].endswith("=") for s in evals[-1]["samples"])  # its taskset's tasks, held out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except urllib.error.URLError:  # not listening (yet)
        return 0


@pytest.mark.slow
def test_the_openenv_example_needs_its_server_and_trains_against_it(tmp_path, tiny_overrides):
    work = tmp_path / "work"  # the server writes runs/openenv.url under its working directory
    work.mkdir()
    env = subprocess_env()
    env.pop("OPENENV_URL", None)
    res = _example("openenv", tmp_path, tiny_overrides, env=env, cwd=work)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "no OpenEnv server: runs/openenv.url does not exist" in res.stderr and "start it first" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "openenv-sum").exists()  # preflight: nothing made

    port = _free_port()
    log = open(tmp_path / "server.log", "w")  # (a pipe nobody reads would stall the server once full)
    server = subprocess.Popen(
        [sys.executable, "-m", "examples.openenv_add", str(port)],
        cwd=work,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        url_file = work / "runs" / "openenv.url"
        deadline = time.monotonic() + 120
        while not (url_file.exists() and url_file.read_text().endswith("\n")):
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "the OpenEnv server did not write its URL"
            time.sleep(0.2)
        url = url_file.read_text().strip()
        assert stat.S_IMODE(url_file.stat().st_mode) == 0o600
        while _status(f"{url}/health") != 200:  # (it wrote the file just before it listens)
            assert time.monotonic() < deadline, "the OpenEnv server does not answer"
            time.sleep(0.2)
        assert _status(f"http://127.0.0.1:{port}/health") == 404  # without its secret path: nothing
        assert _status(f"http://127.0.0.1:{port}/x{url.rsplit('/', 1)[1]}/health") == 404

        res = _example("openenv", tmp_path, tiny_overrides, "eval.size=40", env=env, cwd=work)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        run = tmp_path / "openenv-sum"
        metrics = read_jsonl(run / "metrics.jsonl")
        assert len(metrics) == 3 and all(m.get("env/failures", 0) == 0 for m in metrics)
        assert all("score/openenv/right" in m for m in metrics)  # the agent's own score
        # 40 held-out agents at once, each a session: none refused by the server (it holds 128; the
        # agent opens at most 16 at a time per process)
        assert [e["failures"] for e in _evals(run)] == [0, 0]
        server.terminate()  # an orderly stop takes its URL away
        server.wait(60)
        assert not url_file.exists()
        assert "Traceback" not in (tmp_path / "server.log").read_text()  # (one per closed session, before)
    finally:
        kill_tree(server)
        log.close()


@pytest.mark.slow
def test_dry_run_checks_and_starts_nothing(tmp_path, tiny_overrides):
    res = run_cli(
        "run", "-c", str(ROOT / "examples" / "reasoning_gym.yaml"), f"run_root={tmp_path}", "--dry-run", timeout=300
    )
    assert res.returncode == 0, res.stderr
    assert "dry run: the config and its set-up passed the checks; nothing was started or written" in res.stdout
    assert f"in {tmp_path / 'rg-mix'}" in res.stdout
    assert res.stdout.rstrip().endswith(
        f"asyncrl run -c {ROOT / 'examples' / 'reasoning_gym.yaml'} run_root={tmp_path}"
    )
    assert not any(tmp_path.iterdir())  # nothing written

    made = run_cli(
        "run",
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=q",
        *SHORT,
        timeout=600,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    before = sorted(p.name for p in (tmp_path / "q").iterdir())
    res = run_cli(
        "run",
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=q",
        *SHORT,
        "--dry-run",
        timeout=300,
    )
    assert res.returncode == 2 and "the start would be refused" in res.stdout and "--resume" in res.stdout
    res = run_cli(
        "run",
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=q",
        *SHORT,
        "train.total_steps=5",
        "--dry-run",
        "--resume",
        timeout=300,
    )
    assert res.returncode == 0 and "it would resume from step 3" in res.stdout, res.stdout + res.stderr
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == before  # the run left as it was


def test_preflight_runs_an_agent_functions_own_check(monkeypatch, tmp_path):
    """``fn.preflight()`` of an agent function: what it raises refuses the run in one line."""
    from asyncrl.commands.preflight import preflight
    from asyncrl.config import ConfigError, load_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENENV_URL", f"http://127.0.0.1:{_free_port()}/nothing-here")
    cfg = load_config(ROOT / "examples" / "openenv.yaml", [f"run_root={tmp_path}"])
    with pytest.raises(
        ConfigError,
        match=r"env.agent 'examples.openenv_add:play': no OpenEnv server answers at "
        r"127.0.0.1:\d+ .*start it first",
    ):
        preflight(cfg)


def test_examples_readme_names_every_example_config_with_its_figures():
    text = (ROOT / "examples" / "README.md").read_text()
    for cfg in sorted((ROOT / "examples").glob("*.yaml")):
        assert f"examples/{cfg.name}" in text, cfg.name
    for name in ("verifiers", "openenv", "reasoning_gym"):
        assert f"-c examples/{name}.yaml" in text and "held-out" in text
    assert "python -m examples.openenv_add 8011" in text  # the server is started first
