"""Resolving user components named by import path (``pkg.module:Name``) with clear errors."""

from __future__ import annotations

import importlib
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
        raise ConfigError(f"{what}: {spec!r} is neither a built-in name nor an import path "
                         f"of the form 'package.module:Name'")
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
