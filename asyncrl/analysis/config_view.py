"""``asyncrl config``: the resolved config (a file, overrides, the defaults) as YAML with each key's
description; ``--diff`` keeps only the keys that differ from the defaults, with the default beside
them. The algorithm's own ``algo:`` section is shown through its workflow's ``algo_config`` class."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from ..config import Config, validate_section


def _scalar(value: Any) -> str:
    # (models inside a dict or list, e.g. Absolute Zero's learnability dimensions, as plain data)
    text = yaml.safe_dump(to_jsonable_python(value), default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _leaves(model: BaseModel, defaults: BaseModel | None, prefix: str = "") -> list[tuple]:
    """``(path, depth, name, value, default, description, is_section)`` for every field, depth first."""
    out = []
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        default = getattr(defaults, name) if defaults is not None else None
        path = f"{prefix}{name}"
        desc = (field.description or "").replace("\n", " ")
        if isinstance(value, BaseModel):
            out.append((path, prefix.count("."), name, None, None, desc, True))
            out += _leaves(value, default if isinstance(default, BaseModel) else None, path + ".")
        else:
            out.append((path, prefix.count("."), name, value, default, desc, False))
    return out


def _algo_section(cfg: Config) -> tuple[BaseModel | None, BaseModel | None]:
    from ..rollout.workflow import workflow_class

    cls = getattr(workflow_class(cfg.algorithm), "algo_config", None)
    if cls is None:
        return None, None
    return validate_section(cls, cfg.algo, "algo"), cls()


def show_config(cfg: Config, diff: bool = False) -> str:
    """YAML of ``cfg`` with ``# description`` comments; ``diff``: only what differs from the defaults."""
    rows = _leaves(cfg, Config())
    algo, algo_defaults = _algo_section(cfg)
    if algo is not None:
        rows = [r for r in rows if r[0] != "algo"]
        rows.append(("algo", 0, "algo", None, None, f"{cfg.algorithm}'s own settings ({type(algo).__name__})", True))
        rows += _leaves(algo, algo_defaults, "algo.")
    lines = []
    if diff:
        changed = [r for r in rows if not r[6] and r[3] != r[4]]
        for path, _, _, value, default, desc, _ in changed:
            lines.append(f"{path}: {_scalar(value)}  # default {_scalar(default)}. {desc}".rstrip())
        return "\n".join(lines) if lines else "# every key has its default value"
    for _path, depth, name, value, _, desc, section in rows:
        pad = "  " * depth
        if section:
            lines.append(f"{pad}{name}:" + (f"  # {desc}" if desc else ""))
        else:
            lines.append(f"{pad}{name}: {_scalar(value)}" + (f"  # {desc}" if desc else ""))
    return "\n".join(lines)
