"""Resolving user components named by import path (``pkg.module:Name``) with clear errors."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from .config import ConfigError


def resolve_import(spec: str, what: str) -> Any:
    """Import ``pkg.module:Name`` (or ``pkg.module.Name``); ``what`` names the config field for errors
    (a one-line ConfigError). A module that is not found is usually not on the Python path: run from
    the directory that holds it, put it on ``PYTHONPATH``, or install it as a package."""
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
    elif "." in spec:
        mod_name, _, attr = spec.rpartition(".")
    else:
        raise ConfigError(
            f"{what}: {spec!r} is neither a built-in name nor an import path of the form 'package.module:Name'"
        )
    _cwd_on_path()
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        hint = " (is its directory on PYTHONPATH?)" if isinstance(e, ModuleNotFoundError) else ""
        raise ConfigError(f"{what}: cannot import module {mod_name!r} from {spec!r}: {e}{hint}") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while being imported
        raise ConfigError(f"{what}: importing {mod_name!r} raised {type(e).__name__}: {e}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{what}: module {mod_name!r} has no attribute {attr!r}") from None


def _cwd_on_path() -> None:
    """User modules resolve from the working directory, as under ``python -m`` (which the launcher
    uses for the learner and actors), also when ``asyncrl`` runs as a console script."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def local_hub_snapshot(repo_id: str, repo_type: str = "model") -> tuple[str | None, str]:
    """``(snapshot directory or None, the cache looked in)``: ``repo_id`` in the local Hugging Face cache
    (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub, read when called), found
    offline with huggingface_hub's own lookup: asyncrl downloads nothing at run time."""
    from huggingface_hub import constants, snapshot_download

    cache = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else constants.HF_HUB_CACHE
    )
    try:
        return snapshot_download(repo_id, repo_type=repo_type, cache_dir=cache, local_files_only=True), cache
    except Exception:  # noqa: BLE001 - not cached (huggingface_hub's LocalEntryNotFoundError and kin)
        return None, cache
