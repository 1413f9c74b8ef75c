"""Resolving user components named by import path (``pkg.module:Name``) with clear errors."""

from __future__ import annotations

import importlib
from typing import Any


def resolve_import(spec: str, what: str) -> Any:
    """Import ``pkg.module:Name`` (or ``pkg.module.Name``); ``what`` names the config field for errors."""
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
    elif "." in spec:
        mod_name, _, attr = spec.rpartition(".")
    else:
        raise ValueError(f"{what}: {spec!r} is neither a built-in name nor an import path "
                         f"of the form 'package.module:Name'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"{what}: cannot import module {mod_name!r} from {spec!r}: {e}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{what}: module {mod_name!r} has no attribute {attr!r}") from None
