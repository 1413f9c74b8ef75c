"""Reading JSON-lines files that may still be written: complete lines only, problems reported as
:class:`TruncatedRecordWarning`, never raised."""

from __future__ import annotations

import json
import warnings
from pathlib import Path


class TruncatedRecordWarning(UserWarning):
    """A line of a run file was skipped: unfinished (live tail) or not a JSON object (cut short)."""


# ------------------------------------------------------------------------------------- reading
def _parse_lines(data: bytes, path: Path, first_line: int) -> tuple[list[dict], list[str]]:
    """Records of complete lines in ``data``; problems as messages (not raised)."""
    records, problems = [], []
    for i, raw in enumerate(data.split(b"\n")[:-1]):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            problems.append(
                f"{path}: line {first_line + i} is not valid JSON ({e.msg if hasattr(e, 'msg') else e}); "
                f"skipped (a record cut short?)"
            )
            continue
        if not isinstance(rec, dict):
            problems.append(f"{path}: line {first_line + i} is a JSON {type(rec).__name__}, not an object; skipped")
            continue
        records.append(rec)
    return records, problems


class _Tail:
    """Incremental reader of one JSON-lines file: complete lines only, from a byte offset."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0
        self.line = 1
        self.partial = 0  # bytes of an unfinished last line seen at the last read

    def read(self) -> tuple[list[dict], list[str]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return [], []
        if size < self.offset:  # the file was replaced (a new run under the same name)
            self.offset, self.line = 0, 1
        if size == self.offset:
            self.partial = 0
            return [], []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n") + 1  # complete lines only
        self.partial = len(data) - end
        records, problems = _parse_lines(data[:end], self.path, self.line)
        self.offset += end
        self.line += data[:end].count(b"\n")
        return records, problems


def read_records(path: str | Path) -> list[dict]:
    """All complete JSON-object lines of ``path`` ([] if it does not exist). Warns
    (:class:`TruncatedRecordWarning`) for a corrupt line and for an unfinished last line."""
    tail = _Tail(Path(path))
    records, problems = tail.read()
    for p in problems:
        warnings.warn(p, TruncatedRecordWarning, stacklevel=2)
    if tail.partial:
        warnings.warn(
            f"{path}: skipped an unfinished last line ({tail.partial} bytes; the run is "
            f"still writing it, or it was cut short)",
            TruncatedRecordWarning,
            stacklevel=2,
        )
    return records


def quiet_records(path: Path) -> list[dict]:
    """``read_records`` without its warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return read_records(path)
