"""The episode archive (``log.archive_episodes``): every trained step's episodes, in the batch and
order they were trained in, so that ``asyncrl replay`` can train them again with no actors.

``<run>/archive/step_<version>.arc``: one checksummed record (:mod:`asyncrl.rundir.record_file`) per
learner step, holding a JSON head (``step``, ``keep_rows``, each episode's frame count) and the
episodes' wire frames (:func:`asyncrl.wire.codec.encode_episode`), each zlib-compressed. The episodes
are the ones the trainer collated, after the learner hooks (experience replay's stored
trajectories included), so a replay needs neither the hooks nor the buffer. ``archive/meta.json``
holds what a bit-exact replay must match: the learner's torch threads and the run's seed.

Bounded by ``log.archive_max_gb``: past it the archive stops (one warning event) and a replay can
go up to the last archived step. A resumed run deletes the steps at and after the checkpoint it
resumes from (it trains them again). Reading is strict: a damaged record or a missing step is an
:class:`ArchiveError` naming the file, never skipped; so is anything that is not a regular file (a
FIFO would block), a frame that inflates past the size its head declares (an archive bomb: never
allocated), and a malformed head or meta.json (one line, no traceback).
"""

from __future__ import annotations

import json
import os
import re
import stat
import zlib
from pathlib import Path

import msgspec

from ..config import ConfigError
from ..rundir.record_file import RecordError, read_frame_records, write_frames
from ..types import Episode
from ..wire.codec import WireError, decode, decode_episode, encode_episode

ARCHIVE = "archive"
META = "meta.json"
_STEP = re.compile(r"^step_(\d+)\.arc$")
MAX_FRAME_BYTES = 256 << 20  # one episode frame, uncompressed (64 rows of 32k tokens take about 32 MiB)
MAX_STEP_BYTES = 1 << 30  # a step's frames together, uncompressed
MAX_HEAD_BYTES = 1 << 20  # a step's JSON head, and meta.json


class ArchiveError(ConfigError):
    """An archive that cannot be replayed: missing, damaged or incomplete (the message says where)."""


def archive_dir(run_dir: Path) -> Path:
    return Path(run_dir) / ARCHIVE


def step_file(run_dir: Path, step: int) -> Path:
    return archive_dir(run_dir) / f"step_{step:08d}.arc"


def archived_steps(run_dir: Path) -> list[int]:
    d = archive_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _STEP.match(p.name)))


class EpisodeArchive:
    """The writer: :meth:`write` once per learner step."""

    def __init__(self, run_dir: Path, max_gb: float, from_step: int, meta: dict, warn) -> None:
        self.run_dir, self.max_bytes, self.warn = Path(run_dir), int(max_gb * (1 << 30)), warn
        d = archive_dir(run_dir)
        d.mkdir(parents=True, exist_ok=True)
        for step in archived_steps(run_dir):  # a resume trains these steps again
            if step >= from_step:
                step_file(run_dir, step).unlink()
        self.bytes = sum(p.stat().st_size for p in d.glob("step_*.arc"))
        self.stopped = False
        if (d / META).exists():  # a resumed run: the first start's meta, and where it resumed
            old = json.loads((d / META).read_text())
            meta = {**old, "resumed_at": [*old.get("resumed_at", []), from_step]}
        (d / META).write_text(json.dumps(meta, indent=1))

    def write(self, step: int, episodes: list[Episode], keep_rows: bool) -> None:
        if self.stopped:
            return
        frames = [encode_episode(ep) for ep in episodes]
        head = {
            "step": step,
            "keep_rows": keep_rows,
            "frames": [len(f) for f in frames],
            "sizes": [memoryview(f).nbytes for ep in frames for f in ep],
        }  # (each frame's size, uncompressed)
        body = [json.dumps(head).encode()] + [zlib.compress(memoryview(f).cast("B"), 1) for ep in frames for f in ep]
        size = sum(len(b) for b in body)
        if self.bytes + size > self.max_bytes:
            self.stopped = True
            self.warn(
                f"log.archive_episodes: the archive reached log.archive_max_gb "
                f"({self.max_bytes / (1 << 30):g} GiB) at step {step}; steps from {step} on are not archived "
                f"(asyncrl replay goes up to step {step})"
            )
            return
        path = step_file(self.run_dir, step)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            write_frames(f, body)
        tmp.replace(path)
        self.bytes += size

    def discard(self, step: int) -> None:
        """Remove step ``step``'s record: that step was given up (a stop in its middle) and is trained
        again, with whatever it then takes, after a resume."""
        path = step_file(self.run_dir, step)
        try:
            self.bytes -= path.stat().st_size
            path.unlink()
        except OSError:
            pass


def _regular(path: Path, what: str) -> None:
    """ArchiveError unless ``path`` is a regular file (a directory, a FIFO or a device is never read: a
    FIFO would block a replay for ever)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as e:
        raise ArchiveError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(mode)
            else "a symbolic link"
            if stat.S_ISLNK(mode)
            else "a FIFO"
            if stat.S_ISFIFO(mode)
            else "not a regular file"
        )
        raise ArchiveError(f"{path}: the {what} is {kind}, expected a regular file written by the learner")


def _inflate(frame: bytes, declared: int | None, budget: int) -> bytes:
    """One frame decompressed, never past its declared size, MAX_FRAME_BYTES or what is left of the
    step's ``budget``: an archive bomb, a small record that inflates to gigabytes, is refused before
    it is allocated."""
    limit = min(MAX_FRAME_BYTES, budget, MAX_FRAME_BYTES if declared is None else int(declared))
    if limit <= 0:
        raise ValueError(f"the step's frames inflate past {MAX_STEP_BYTES} bytes")
    inflater = zlib.decompressobj()
    out = inflater.decompress(frame, limit)
    if inflater.unconsumed_tail or not inflater.eof:
        raise ValueError(
            f"a frame inflates past {limit} bytes ({'its declared size, ' if declared is not None else ''}"
            f"at most {MAX_FRAME_BYTES} a frame and {MAX_STEP_BYTES} a step)"
        )
    if declared is not None and len(out) != declared:
        raise ValueError(f"a frame inflates to {len(out)} bytes, its head says {declared}")
    return out


def _record(run_dir: Path, step: int) -> tuple[Path, list[bytes]]:
    """Step ``step``'s one record (its checksum checked): ArchiveError if missing or damaged."""
    path = step_file(run_dir, step)
    if not os.path.lexists(path):
        raise ArchiveError(
            f"{path}: missing; the archive has no record of step {step} (archived: "
            f"{_ranges(archived_steps(run_dir)) or 'none'})"
        )
    _regular(path, "step file")
    try:
        records = list(read_frame_records(path, strict=True))
    except RecordError as e:
        raise ArchiveError(f"damaged archive record: {e}") from None
    if len(records) != 1:
        raise ArchiveError(f"{path}: {len(records)} records, expected 1")
    return path, records[0]


def verify_steps(run_dir: Path, steps) -> None:
    """Check every record of ``steps`` (checksums only) before a replay starts: ArchiveError at the first
    damaged or missing one."""
    for step in steps:
        _record(run_dir, step)


def read_step(run_dir: Path, step: int) -> tuple[list[Episode], bool]:
    """The episodes trained at ``step`` (in order) and whether that step kept per-row outputs."""
    path, body = _record(run_dir, step)
    try:
        if len(body[0]) > MAX_HEAD_BYTES:
            raise ValueError(f"a head of {len(body[0])} bytes (at most {MAX_HEAD_BYTES})")
        head = json.loads(body[0])
        counts, out, i = head["frames"], [], 1
        sizes = head.get("sizes")  # (absent in archives written before it was recorded: the cap alone)
        if (
            int(head["step"]) != step
            or sum(counts) != len(body) - 1
            or (sizes is not None and len(sizes) != len(body) - 1)
        ):
            raise ValueError(f"head {str(head)[:200]} does not match the file (step {step}, {len(body) - 1} frames)")
        if sizes is not None and (max(sizes, default=0) > MAX_FRAME_BYTES or sum(sizes) > MAX_STEP_BYTES):
            raise ValueError(
                f"the head declares frames of {max(sizes)} bytes, {sum(sizes)} in all (at most "
                f"{MAX_FRAME_BYTES} a frame and {MAX_STEP_BYTES} a step)"
            )
        budget = MAX_STEP_BYTES
        for n in counts:
            frames = []
            for j, f in enumerate(body[i : i + n], i):
                frames.append(_inflate(f, sizes[j - 1] if sizes is not None else None, budget))
                budget -= len(frames[-1])
            out.append(decode_episode(decode(frames, kinds=("episode",)), copy=True))
            i += n
    except (
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        RecursionError,
        zlib.error,
        WireError,
        msgspec.DecodeError,
    ) as e:
        raise ArchiveError(f"{path}: damaged archive record ({type(e).__name__}: {str(e)[:300]})") from None
    return out, bool(head.get("keep_rows", False))


def read_meta(run_dir: Path) -> dict:
    path = archive_dir(run_dir) / META
    if not os.path.lexists(path):
        raise ArchiveError(
            f"{run_dir} has no episode archive ({path} is missing): the run was made without "
            f"log.archive_episodes=true, so there is nothing to replay"
        )
    _regular(path, "archive's meta.json")
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_HEAD_BYTES + 1)
        if len(text) > MAX_HEAD_BYTES:
            raise ValueError(f"more than {MAX_HEAD_BYTES} bytes")
        meta = json.loads(text)
    except (OSError, ValueError, RecursionError) as e:
        raise ArchiveError(
            f"{path}: not the archive's meta.json ({type(e).__name__}: {str(e)[:200]}); expected "
            f"the JSON object the learner writes"
        ) from None
    if not isinstance(meta, dict):
        raise ArchiveError(f"{path}: not the archive's meta.json (a JSON {type(meta).__name__}, expected an object)")
    return meta


def _ranges(steps: list[int]) -> str:
    if not steps:
        return ""
    out, start, prev = [], steps[0], steps[0]
    for s in steps[1:] + [None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        if s is not None:
            start = prev = s
    return ", ".join(out)
