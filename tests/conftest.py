"""Shared fixtures: a tiny embedded model built once per session, free ports, CLI subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_overrides(model_cache) -> list[str]:
    """Overrides that select a very small embedded model (built once, cached for the session)."""
    overrides = [f"model.embedded.cache_dir={model_cache}", "model.embedded.hidden_size=32",
                 "model.embedded.num_layers=1", "model.embedded.num_heads=2",
                 "model.embedded.intermediate_size=64", "model.embedded.warmup_steps=20",
                 "model.embedded.warmup_batch_size=16", "model.embedded.warmup_lr=3e-3"]
    from asyncrl.config import load_config
    from asyncrl.models.tiny import build_embedded_model

    cfg = load_config(None, overrides)
    build_embedded_model(cfg.model.embedded, seed=cfg.seed, progress=False)
    return overrides


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", *args]


def subprocess_env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 120) -> dict:
    from asyncrl.launcher import wait_for_addresses

    return wait_for_addresses(path, proc, timeout)


def read_jsonl(path: Path) -> list[dict]:
    from asyncrl.runlog import read_jsonl as _read

    return _read(path)


# ---- process trees: every test that starts processes stops all of them, even when it fails ----

def _parent_map() -> dict[int, int]:
    """pid -> parent pid for every process (Linux /proc)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            out[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after "(comm)"
    return out


def descendants(pid: int) -> set[int]:
    """Live descendants of ``pid`` (children, grandchildren, ...)."""
    parents = _parent_map()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pids) -> set[int]:
    """The pids in ``pids`` that still exist and are not zombies."""
    out = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(p)
    return out


def kill_tree(proc: subprocess.Popen, known: set[int] | None = None) -> None:
    """SIGKILL ``proc``, its process group and every descendant (plus ``known`` pids); reap it."""
    import signal

    pids = {proc.pid} | descendants(proc.pid) | set(known or ())
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # started with start_new_session=True
    except (ProcessLookupError, PermissionError):
        pass
    for p in alive(pids):
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def start_cli(*args: str, log: Path | None = None, **kw) -> subprocess.Popen:
    """``asyncrl ARGS`` in its own session (so :func:`kill_tree` reaches all of it); output to
    ``log`` or a pipe (text)."""
    if log is not None:
        with open(log, "w") as fh:
            return subprocess.Popen(cli(*args), env=subprocess_env(), stdout=fh, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True, **kw)
    return subprocess.Popen(cli(*args), env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, **kw)


def run_cli(*args: str, timeout: float, **kw) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(cli(*args), capture_output=True, text=True, timeout=...)``, but in its
    own session, and the whole process tree is killed when it times out or the test fails."""
    proc = subprocess.Popen(cli(*args), env=kw.pop("env", None) or subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        kill_tree(proc)
