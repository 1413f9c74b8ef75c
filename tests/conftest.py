"""Shared fixtures: a tiny embedded model built once per session, free ports, CLI subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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
