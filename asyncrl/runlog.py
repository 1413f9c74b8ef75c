"""The run directory: config snapshot, metrics and events as JSON lines (schema in docs/events.md).

Every line is one JSON object with ``schema`` (EVENTS_SCHEMA), ``kind``, ``t`` (unix seconds) and
``step`` (learner policy version when written). Lines are flushed as written so that readers (the
UI, notebooks) can follow a live run; a reader must tolerate a truncated last line.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

EVENTS_SCHEMA = 1


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _clean(value.item())
    return value


class JsonlWriter:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> str:
        line = json.dumps(_clean(record), separators=(",", ":"))
        self._f.write(line + "\n")
        self._f.flush()
        return line

    def close(self) -> None:
        self._f.close()


class RunLog:
    """Writes ``metrics.jsonl`` and ``events.jsonl``; ``on_event`` hooks stream events live."""

    def __init__(self, run_dir: Path, on_event: Callable[[dict[str, Any]], None] | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics = JsonlWriter(self.dir / "metrics.jsonl")
        self.events = JsonlWriter(self.dir / "events.jsonl")
        self.on_event = on_event

    def metric(self, step: int, values: dict[str, Any]) -> None:
        self.metrics.write({"step": step, "t": time.time(), **values})

    def event(self, kind: str, step: int, **fields: Any) -> None:
        record = {"schema": EVENTS_SCHEMA, "kind": kind, "t": time.time(), "step": step, **fields}
        self.events.write(record)
        if self.on_event is not None:
            self.on_event(_clean(record))

    def close(self) -> None:
        self.metrics.close()
        self.events.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; a truncated or corrupt line is skipped (a live writer's tail)."""
    out = []
    if not Path(path).exists():
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
