"""Policy-version-tagged replay buffer with a write-ahead log.

Promises:
- ``add`` appends the episode's wire frames to the WAL as one checksummed record; after ``sync()``
  returns, every episode added before it is on disk, and only then does the learner acknowledge it.
  A write that fails part-way is cut back, so the file always ends on a whole record.
- Episode ids are de-duplicated across restarts (``seen`` is part of the checkpoint), so an actor
  resending an unacknowledged episode never gets it trained twice.
- ``take`` returns the oldest usable episodes first and drops those staler than ``max_staleness``.
- A checkpoint stores the unconsumed episodes and ``seen``; the learner deletes WAL segments older
  than the oldest checkpoint it keeps (so a damaged newest checkpoint can fall back to an older one
  without losing what was acknowledged since). Resuming reads the checkpoint, then every WAL record
  it has not seen, each checked again as on receipt (a record that fails is quarantined, never
  trained). Damage in the middle of a segment costs only the damaged bytes: reading resynchronises
  on the next record whose header and checksum are valid, the damaged bytes are kept in
  ``buffer/quarantine/`` and the segment is rewritten without them; only a bad tail (torn write,
  garbage, zero fill, with no valid record after it) is cut off. Everything is reported: the byte
  ranges, how many records they held at least, and the episode ids quarantined.

Record format (the WAL, a checkpoint's ``buffer.bin`` and the replay pool), little-endian::

    magic  4 bytes  b"ARW1"
    length u32      payload bytes (at most MAX_RECORD_BYTES)
    crc    u32      CRC32C (Castagnoli) of the length field's 4 bytes followed by the payload
    payload         u32 frame count, then per frame: u64 byte length, the bytes

CRC32C is the checksum of iSCSI (RFC 3720) and of the LevelDB/RocksDB log format; it covers the length
so that a damaged length is caught before it is trusted, and a zero-filled region never passes
(its magic is wrong). A length larger than the cap or than the rest of the file stops reading before
anything is allocated.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import crc32c

from ..types import Episode
from ..wire.codec import WireError, decode, decode_episode

RECORD_MAGIC = b"ARW1"
# A record is one episode (or one replay-pool task): token ids and log-probs of a few sequences. A
# gigabyte is far beyond any legal one and keeps a damaged length from ever allocating more.
MAX_RECORD_BYTES = 1 << 30
_HEAD = struct.Struct("<4sII")  # magic, payload length, crc
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class RecordError(ValueError):
    """A record file that cannot be read; the message names the file, the byte offset and why."""


def encode_record(frames: list) -> bytes:
    """One record (header + payload) holding ``frames`` (bytes, memoryview or zmq.Frame)."""
    views = [memoryview(fr.buffer if hasattr(fr, "buffer") else fr).cast("B") for fr in frames]
    parts = [_U32.pack(len(views))]
    for v in views:
        parts += [_U64.pack(v.nbytes), v]
    payload = b"".join(parts)
    if len(payload) > MAX_RECORD_BYTES:
        raise ValueError(f"a record of {len(payload)} bytes is over the limit of {MAX_RECORD_BYTES}")
    length = _U32.pack(len(payload))
    return _HEAD.pack(RECORD_MAGIC, len(payload), crc32c.crc32c(payload, crc32c.crc32c(length))) + payload


def write_frames(f, frames: list) -> None:
    """Append one record holding ``frames`` to the open binary file ``f``."""
    f.write(encode_record(frames))


def _split_frames(payload: bytes) -> list[bytes] | None:
    """The frames of a checksummed payload, or None if its frame table does not add up."""
    if len(payload) < 4:
        return None
    (n,) = _U32.unpack_from(payload, 0)
    pos, frames = 4, []
    for _ in range(n):
        if pos + 8 > len(payload):
            return None
        (ln,) = _U64.unpack_from(payload, pos)
        pos += 8
        if ln > len(payload) - pos:
            return None
        frames.append(payload[pos:pos + ln])
        pos += ln
    return frames if pos == len(payload) else None


@dataclass
class Damage:
    """Bytes ``[start, end)`` of a record file that hold no valid record, between good ones (or
    at its tail); ``records`` is how many record markers they hold (at least one record lost, or
    the tail of a torn one)."""

    start: int
    end: int
    problem: str
    records: int = 1
    quarantine: Path | None = None


@dataclass
class RecordScan:
    """What reading a record file found: ``good_bytes`` is the end of the last good record; when it
    is short of ``size``, ``problem`` says why reading stopped there. With resynchronisation,
    ``damaged`` lists the bad ranges skipped before it."""

    path: Path
    size: int = 0
    good_bytes: int = 0
    records: int = 0
    problem: str | None = None
    damaged: list[Damage] = field(default_factory=list)

    @property
    def bytes_cut(self) -> int:
        return self.size - self.good_bytes


def _next_record(f, offset: int, size: int) -> tuple[list[bytes] | None, str | None]:
    """The record at ``offset`` (file positioned there): (frames, None), or (None, why it is bad)."""
    head = f.read(_HEAD.size)
    if len(head) < _HEAD.size:
        return None, f"a torn record header ({len(head)} of {_HEAD.size} bytes)"
    magic, length, crc = _HEAD.unpack(head)
    if magic != RECORD_MAGIC:
        what = "zero bytes" if head == bytes(len(head)) else f"bytes {head[:4].hex()}"
        return None, f"no record marker ({what} instead of {RECORD_MAGIC!r})"
    if length > MAX_RECORD_BYTES:
        return None, f"a record length of {length} bytes, over the limit of {MAX_RECORD_BYTES}"
    if offset + _HEAD.size + length > size:
        return None, (f"a torn record ({size - offset - _HEAD.size} of its {length} payload bytes "
                      f"are in the file)")
    payload = f.read(length)
    if crc32c.crc32c(payload, crc32c.crc32c(_U32.pack(length))) != crc:
        return None, "a record whose checksum does not match (damaged bytes)"
    frames = _split_frames(payload)
    if frames is None:
        return None, "a record whose frame table does not match its length"
    return frames, None


def scan_records(path: Path, scan: RecordScan | None = None) -> Iterator[list[bytes]]:
    """Frame lists of a record file, in order, stopping at the first bad record. Pass a
    :class:`RecordScan` to learn where it stopped and why (filled in as reading goes)."""
    path = Path(path)
    scan = scan if scan is not None else RecordScan(path)
    with open(path, "rb") as f:
        scan.size = os.fstat(f.fileno()).st_size
        while scan.good_bytes < scan.size:
            frames, problem = _next_record(f, scan.good_bytes, scan.size)
            if frames is None:
                scan.problem = problem
                _refuse_old_format(path, scan)
                return
            scan.good_bytes = f.tell()
            scan.records += 1
            yield frames


def _valid_at(mm, offset: int, size: int) -> bool:
    """Whether a whole valid record (marker, length, checksum, frame table) starts at ``offset``."""
    if offset + _HEAD.size > size:
        return False
    magic, length, crc = _HEAD.unpack_from(mm, offset)
    if magic != RECORD_MAGIC or length > MAX_RECORD_BYTES or offset + _HEAD.size + length > size:
        return False
    payload = mm[offset + _HEAD.size: offset + _HEAD.size + length]
    return crc32c.crc32c(payload, crc32c.crc32c(_U32.pack(length))) == crc and _split_frames(payload) is not None


def _resync(path: Path, start: int, size: int) -> int | None:
    """The offset of the first valid record after the bad one at ``start`` (None: none follows)."""
    if size <= start + 1:
        return None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = mm.find(RECORD_MAGIC, start + 1)
        while pos != -1:
            if _valid_at(mm, pos, size):
                return pos
            pos = mm.find(RECORD_MAGIC, pos + 1)
    return None


def _markers(path: Path, start: int, end: int) -> int:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        n, pos = 0, mm.find(RECORD_MAGIC, start, end)
        while pos != -1:
            n, pos = n + 1, mm.find(RECORD_MAGIC, pos + 1, end)
        return max(1, n)


def scan_records_resync(path: Path, scan: RecordScan) -> Iterator[list[bytes]]:
    """Like :func:`scan_records`, but a bad record followed by a valid one is skipped (recorded in
    ``scan.damaged``) and reading goes on there; ``scan.problem`` is left only for a bad tail."""
    path = Path(path)
    with open(path, "rb") as f:
        scan.size = os.fstat(f.fileno()).st_size
        offset = 0
        while offset < scan.size:
            f.seek(offset)
            frames, problem = _next_record(f, offset, scan.size)
            if frames is None:
                if not scan.records and not scan.damaged:
                    scan.good_bytes = offset
                    _refuse_old_format(path, scan)
                nxt = _resync(path, offset, scan.size)
                if nxt is None:
                    scan.problem = problem
                    return
                scan.damaged.append(Damage(offset, nxt, problem, _markers(path, offset, nxt)))
                offset = nxt
                continue
            offset = scan.good_bytes = f.tell()
            scan.records += 1
            yield frames


def _refuse_old_format(path: Path, scan: RecordScan) -> None:
    """A file whose very first bytes are a frame count and a length (asyncrl's first WAL format,
    without checksums) is refused by name rather than cut to nothing."""
    if scan.good_bytes or scan.size < 12:
        return
    with open(path, "rb") as f:
        head = f.read(12)
    (n,) = _U32.unpack_from(head, 0)
    (ln,) = _U64.unpack_from(head, 4)
    if 1 <= n <= 64 and 0 < ln <= scan.size:
        raise RecordError(f"{path}: written by an older asyncrl (records without checksums, format 0); "
                          f"this version reads format {RECORD_MAGIC.decode()} only: resume that run with "
                          f"the asyncrl that wrote it, or start over (--overwrite)")


def read_frame_records(path: Path, strict: bool = True) -> Iterator[list[bytes]]:
    """Frame lists from a record file. ``strict`` (checkpoint files, written whole): a bad record
    raises :class:`RecordError` naming the file and offset. Otherwise (a WAL that may end in a torn
    write) reading stops quietly at the first bad record."""
    scan = RecordScan(Path(path))
    yield from scan_records(path, scan)
    if strict and scan.problem is not None:
        raise RecordError(f"{path}: {scan.problem} at byte {scan.good_bytes} of {scan.size} "
                          f"(after {scan.records} good records)")


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


def fsync_path(path: Path) -> None:
    """``fsync`` a file or a directory (a directory: its entries survive a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cut(path: Path, size: int) -> None:
    """Truncate ``path`` to ``size`` bytes, durably."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


class ReplayBuffer:
    def __init__(self, directory: Path, capacity: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.episodes: OrderedDict[str, tuple[Episode, list]] = OrderedDict()
        self.seen: set[str] = set()
        self.dropped_stale = 0
        self._fd: int | None = None
        self._wal_size = 0
        self._wal_path: Path | None = None
        self._dirty = False

    def __len__(self) -> int:
        return len(self.episodes)

    # -- writing --------------------------------------------------------------------------------
    def open_wal(self, segment: int) -> None:
        """Append from now on to ``wal-<segment>.bin`` (created if new). Call ``restore`` first when
        the segment may exist: it cuts a bad tail, after which appending is safe."""
        self.close()
        self._wal_path = self.dir / f"wal-{segment:08d}.bin"
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
    def take(self, count: int, version: int, max_staleness: int) -> list[Episode] | None:
        """``count`` episodes with ``version - policy_version <= max_staleness``, oldest first, or
        None if fewer are available. Too-stale episodes are dropped (counted in ``dropped_stale``)."""
        for eid in [k for k, (ep, _) in self.episodes.items() if version - ep.policy_version > max_staleness]:
            del self.episodes[eid]
            self.dropped_stale += 1
        if len(self.episodes) < count:
            return None
        ordered = sorted(self.episodes.items(), key=lambda kv: kv[1][0].policy_version)[:count]
        for eid, _ in ordered:
            del self.episodes[eid]
        return [ep for _, (ep, _) in ordered]

    def save(self, path: Path) -> None:
        """Write the unconsumed episodes to ``path`` (same record format as the WAL) and fsync it."""
        with open(path, "wb") as f:
            for _, frames in self.episodes.values():
                write_frames(f, frames)
            f.flush()
            os.fsync(f.fileno())

    def wal_segments(self) -> list[Path]:
        return sorted(self.dir.glob("wal-*.bin"), key=lambda p: int(p.stem.split("-")[1]))

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
                scan.damaged.append(Damage(scan.good_bytes, scan.size, scan.problem,
                                           quarantine=self._quarantine_bytes(wal, scan.good_bytes, scan.size)))
            if scan.damaged[:-1 if scan.problem else None] or dropped:
                _rewrite(wal, keep)
                report.damaged.append(scan)
            elif scan.problem is not None:
                _cut(wal, scan.good_bytes)
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
