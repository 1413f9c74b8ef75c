"""The key/value cache's name across transformers versions.

transformers 5.2x renamed the forward argument and output field ``past_key_values`` to ``cache``;
the old name still works there but warns on every run (a ``FutureWarning`` and a log line), and the
versions before it know only the old one (vLLM's CPU build pins one of those). :func:`cache_arg`
and :func:`cache_of` use whichever name the model's own forward takes, found once per model class
(through DDP/FSDP and peft wrappers to the model underneath).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


def _inner(model):
    """The model whose ``forward`` names its arguments (DDP's ``module``, peft's base model)."""
    for _ in range(8):
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif hasattr(model, "module") and not hasattr(model, "config"):
            model = model.module
        else:
            break
    return model


@functools.cache
def _name(cls: type) -> str:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_arg(model, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model(...)``: its forward's name of the key/value cache."""
    return {_name(type(_inner(model))): cache}


def cache_of(out) -> Any:
    """The key/value cache of a forward's output (a ``ModelOutput``, under either name), or None."""
    for key in ("cache", "past_key_values"):
        if key in out:
            return out[key]
    return None
