"""The learner's queue of acknowledged episodes (:class:`EpisodeQueue`): policy-version tagged,
behind a write-ahead log. (Experience replay, which trains on past successes again, is
``asyncrl.learner.experience``; this queue only holds what actors delivered until a step takes it.)

Promises:
- ``add`` appends the episode's wire frames to the WAL as one checksummed record; after ``sync()``
  returns, every episode added before it is on disk, and only then does the learner acknowledge it.
  A write that fails part-way is cut back, so the file always ends on a whole record.
- Episode ids are de-duplicated across restarts (``seen`` is part of the checkpoint), so an actor
  resending an unacknowledged episode never gets it trained twice.
- ``take`` returns the oldest usable episodes first and drops those the staleness policy finds too old.
- A checkpoint stores the unconsumed episodes and ``seen``; the learner deletes WAL segments older
  than the oldest checkpoint it keeps (so a damaged newest checkpoint can fall back to an older one
  without losing what was acknowledged since). Resuming reads the checkpoint, then every WAL record
  it has not seen, each checked again as on receipt (a record that fails is quarantined, never
  trained). Damage in the middle of a segment costs only the damaged bytes: reading resynchronises
  on the next record whose header and checksum are valid, the damaged bytes are kept in
  ``buffer/quarantine/`` and the segment is rewritten without them; only a bad tail (torn write,
  garbage, zero fill, with no valid record after it) is cut off. Everything is reported: the byte
  ranges, how many records they held at least, and the episode ids quarantined.

Records are the checksummed format of ``asyncrl.rundir.record_file`` (shared with checkpoint buffer files and
the replay pool).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ...rundir.layout import cut_file, fsync_path, wal_segment, wal_segments
from ...rundir.record_file import (
    Damage,
    RecordScan,
    encode_record,
    read_frame_records,
    scan_records_resync,
    write_frames,
)
from ...types import Episode
from ...wire.codec import WireError, decode, decode_episode
from .staleness import StalenessPolicy


@dataclass
class RestoreReport:
    """What ``restore`` rebuilt: episodes from the checkpoint's buffer file, episodes recovered from
    the WAL, WAL records that would not decode, the bad tails cut off (``RecordScan`` each), the
    segments with damage in the middle (``RecordScan`` with ``damaged``), and the records that
    failed the receipt checks (``(file, episode id, reason)``), all kept in ``quarantine``."""

    from_checkpoint: int = 0
    recovered: int = 0
    undecodable: int = 0
    truncated: list[RecordScan] = field(default_factory=list)
    damaged: list[RecordScan] = field(default_factory=list)
    invalid: list[tuple[str, str, str]] = field(default_factory=list)
    quarantine: Path | None = None


class EpisodeQueue:
    """Acknowledged episodes waiting for a training step, with their WAL (module docstring)."""

    def __init__(self, directory: Path, capacity: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.episodes: OrderedDict[str, tuple[Episode, list]] = OrderedDict()
        self.seen: set[str] = set()
        self.dropped_stale = 0
        self.filtered: list[str] = []  # ids of episodes the keep rule dropped since the learner last took them
        self.filtered_total = 0
        self._kept: set[str] = set()  # ids the keep rule has passed
        self._taken: list[tuple[str, tuple[Episode, list]]] = []  # what the last ``take`` returned (``untake``)
        self._fd: int | None = None
        self._wal_size = 0
        self._wal_path: Path | None = None
        self._dirty = False
        self.on_drop: Callable[[Episode, str, int], None] | None = None  # (episode, "stale"/"filtered", version)

    def __len__(self) -> int:
        return len(self.episodes)

    # -- writing --------------------------------------------------------------------------------
    def open_wal(self, segment: int) -> None:
        """Append from now on to ``wal-<segment>.bin`` (created if new). Call ``restore`` first when
        the segment may exist: it cuts a bad tail, after which appending is safe."""
        self.close()
        self._wal_path = wal_segment(self.dir, segment)
        new = not self._wal_path.exists()
        self._fd = os.open(self._wal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._wal_size = os.fstat(self._fd).st_size
        if new:
            fsync_path(self.dir)  # the segment's directory entry survives a power cut too

    def close(self) -> None:
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None

    def add(self, episode: Episode, frames: list) -> bool:
        """Append to the WAL and the buffer. False (and nothing written) for a duplicate id. If the
        write fails (disk full, ...) the WAL is cut back to its last whole record and the error is
        raised, with the episode neither buffered nor marked seen (its actor will resend it)."""
        if episode.id in self.seen:
            return False
        record = encode_record(frames)
        try:
            written = 0
            while written < len(record):  # os.write may write part of it (e.g. at a size limit)
                written += os.write(self._fd, memoryview(record)[written:])
        except BaseException:
            os.ftruncate(self._fd, self._wal_size)
            raise
        self._wal_size += len(record)
        self._dirty = True
        self.seen.add(episode.id)
        self.episodes[episode.id] = (episode, frames)
        return True

    def sync(self) -> None:
        if self._dirty and self._fd is not None:
            os.fsync(self._fd)
            self._dirty = False

    # -- reading --------------------------------------------------------------------------------
    def take(
        self, count: int, version: int, staleness: StalenessPolicy, keep: Callable[[Episode], bool] | None = None
    ) -> list[Episode] | None:
        """``count`` episodes within the staleness bound, oldest first, or None if fewer are available.
        Episodes that ``staleness`` finds too old are dropped (counted in ``dropped_stale``), and so are
        those ``keep`` rejects (dynamic sampling; each judged once, their ids in ``filtered``)."""
        for eid in [k for k, (ep, _) in self.episodes.items() if staleness.too_old(ep, version)]:
            ep, _ = self.episodes.pop(eid)
            self._kept.discard(eid)
            self.dropped_stale += 1
            if self.on_drop is not None:
                self.on_drop(ep, "stale", version)
        if keep is not None:
            for eid, (ep, _) in list(self.episodes.items()):
                if eid in self._kept:
                    continue
                if keep(ep):
                    self._kept.add(eid)
                else:
                    del self.episodes[eid]
                    self.filtered.append(eid)
                    self.filtered_total += 1
                    if self.on_drop is not None:
                        self.on_drop(ep, "filtered", version)
        if len(self.episodes) < count:
            return None
        ordered = sorted(self.episodes.items(), key=lambda kv: kv[1][0].policy_version)[:count]
        for eid, _ in ordered:
            del self.episodes[eid]
            self._kept.discard(eid)
        self._taken = ordered
        return [ep for _, (ep, _) in ordered]

    def discard(self, eid: str) -> None:
        """Take an episode out without training it (it stays seen: a resend is a duplicate too)."""
        self.episodes.pop(eid, None)
        self._kept.discard(eid)

    def untake(self) -> int:
        """Put what the last :meth:`take` returned back, as it arrived (its wire frames: what a checkpoint
        saves), for a step that was given up. Returns how many episodes came back."""
        for eid, item in self._taken:
            self.episodes[eid] = item
        n, self._taken = len(self._taken), []
        return n

    def take_filtered(self) -> list[str]:
        """The ids of the episodes dropped by ``take``'s keep rule since the last call."""
        out, self.filtered = self.filtered, []
        return out

    def save(self, path: Path) -> None:
        """Write the unconsumed episodes to ``path`` (same record format as the WAL) and fsync it."""
        with open(path, "wb") as f:
            for _, frames in self.episodes.values():
                write_frames(f, frames)
            f.flush()
            os.fsync(f.fileno())

    def wal_segments(self) -> list[Path]:
        return wal_segments(self.dir)

    def drop_wal_before(self, segment: int) -> None:
        """Delete WAL segments numbered below ``segment`` (the step of the oldest kept checkpoint)."""
        for p in self.wal_segments():
            if int(p.stem.split("-")[1]) < segment:
                p.unlink()

    def restore(self, buffer_file: Path | None, seen: set[str], validate=None) -> RestoreReport:
        """Rebuild from a checkpoint's buffer file (read strictly: it was verified against the
        checkpoint's manifest) plus every WAL record it has not seen.

        ``validate(episode, message) -> (reason, text) | None`` is the learner's receipt check; a
        record that fails it is quarantined and not buffered. Each WAL segment is read past damage
        in its middle (see the module docstring); a bad tail is cut off (``report.truncated``), a
        segment with damaged or invalid records is rewritten without them, so appending after a
        crash never leaves good records behind garbage."""
        report = RestoreReport(quarantine=self.dir / "quarantine")
        self.seen = set(seen)
        if buffer_file is not None and buffer_file.exists():
            for frames in read_frame_records(buffer_file, strict=True):
                msg = decode(frames)
                ep = decode_episode(msg)
                if self._failed(validate, ep, msg, frames, buffer_file, report):
                    continue
                self.episodes[ep.id] = (ep, frames)
                self.seen.add(ep.id)
                report.from_checkpoint += 1
        for wal in self.wal_segments():
            scan = RecordScan(wal)
            keep: list[list[bytes]] = []
            dropped = 0
            for frames in scan_records_resync(wal, scan):
                try:
                    msg = decode(frames)
                    ep = decode_episode(msg)
                except WireError:
                    report.undecodable += 1
                    keep.append(frames)
                    continue
                if ep.id not in self.seen and self._failed(validate, ep, msg, frames, wal, report):
                    dropped += 1
                    self.seen.add(ep.id)  # (acknowledged: its actor will not send it again)
                    continue
                keep.append(frames)
                if ep.id not in self.seen:
                    self.seen.add(ep.id)
                    self.episodes[ep.id] = (ep, frames)
                    report.recovered += 1
            for d in scan.damaged:
                d.quarantine = self._quarantine_bytes(wal, d.start, d.end)
            if scan.problem is not None:
                scan.damaged.append(
                    Damage(
                        scan.good_bytes,
                        scan.size,
                        scan.problem,
                        quarantine=self._quarantine_bytes(wal, scan.good_bytes, scan.size),
                    )
                )
            if scan.damaged[: -1 if scan.problem else None] or dropped:
                _rewrite(wal, keep)
                report.damaged.append(scan)
            elif scan.problem is not None:
                cut_file(wal, scan.good_bytes)
            if scan.problem is not None:
                report.truncated.append(scan)
        return report

    def _failed(self, validate, ep, msg, frames, source: Path, report: RestoreReport) -> bool:
        """Run the receipt check; a failing record goes to quarantine (True)."""
        if validate is None:
            return False
        try:
            problem = validate(ep, msg)
        except (ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
            problem = ("invalid", f"{type(e).__name__}: {e}")
        if problem is None:
            return False
        q = self.dir / "quarantine"
        q.mkdir(exist_ok=True)
        with open(q / "invalid-records.bin", "ab") as f:
            write_frames(f, frames)
            f.flush()
            os.fsync(f.fileno())
        report.invalid.append((str(source), ep.id, f"{problem[0]}: {problem[1]}"))
        return True

    def _quarantine_bytes(self, path: Path, start: int, end: int) -> Path | None:
        if end <= start:
            return None
        q = self.dir / "quarantine"
        q.mkdir(exist_ok=True)
        out = q / f"{path.name}.{start}-{end}.bad"
        with open(path, "rb") as src, open(out, "wb") as dst:
            src.seek(start)
            left = end - start
            while left > 0:  # in pieces: a damaged region may be most of a large segment
                chunk = src.read(min(left, 1 << 20))
                if not chunk:
                    break
                dst.write(chunk)
                left -= len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        fsync_path(q)
        return out


def _rewrite(path: Path, records: list[list[bytes]]) -> None:
    """Replace the record file ``path`` by one holding ``records``, atomically and durably."""
    tmp = path.with_name(path.name + ".rewrite")
    with open(tmp, "wb") as f:
        for frames in records:
            write_frames(f, frames)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
