"""The checksummed record format of every durable record file: the learner's write-ahead log, a
checkpoint's ``buffer.bin`` and the experience-replay pool. Ground floor: imports nothing of asyncrl.

Record format (the WAL, a checkpoint's ``buffer.bin`` and the replay pool), little-endian::

    magic  4 bytes  b"ARW1"
    length u32      payload bytes (at most MAX_RECORD_BYTES)
    crc    u32      CRC32C (Castagnoli) of the length field's 4 bytes followed by the payload
    payload         u32 frame count, then per frame: u64 byte length, the bytes

CRC32C is the checksum of iSCSI (RFC 3720) and of the LevelDB/RocksDB log format; it covers the length
so that a damaged length is caught before it is trusted, and a zero-filled region never passes
(its magic is wrong). A length larger than the cap or than the rest of the file stops reading before
anything is allocated.

Reading: :func:`scan_records` stops at the first bad record (a checkpoint file, read strictly by
:func:`read_frame_records`); :func:`scan_records_resync` skips a damaged record in the middle by
finding the next valid one (the WAL), leaving only a bad tail to cut.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import crc32c

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
        frames.append(payload[pos : pos + ln])
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
        return None, (f"a torn record ({size - offset - _HEAD.size} of its {length} payload bytes are in the file)")
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
    payload = mm[offset + _HEAD.size : offset + _HEAD.size + length]
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
        raise RecordError(
            f"{path}: written by an older asyncrl (records without checksums, format 0); "
            f"this version reads format {RECORD_MAGIC.decode()} only: resume that run with "
            f"the asyncrl that wrote it, or start over (--overwrite)"
        )


def read_frame_records(path: Path, strict: bool = True) -> Iterator[list[bytes]]:
    """Frame lists from a record file. ``strict`` (checkpoint files, written whole): a bad record
    raises :class:`RecordError` naming the file and offset. Otherwise (a WAL that may end in a torn
    write) reading stops quietly at the first bad record."""
    scan = RecordScan(Path(path))
    yield from scan_records(path, scan)
    if strict and scan.problem is not None:
        raise RecordError(
            f"{path}: {scan.problem} at byte {scan.good_bytes} of {scan.size} (after {scan.records} good records)"
        )
