"""Policy-version-tagged replay buffer with a write-ahead log.

Promises:
- ``add`` appends the episode's wire frames to the WAL; after ``sync()`` returns, every episode added
  before it is on disk, and only then does the learner acknowledge it to the actor.
- Episode ids are de-duplicated across restarts (``seen`` is part of the checkpoint), so an actor
  resending an unacknowledged episode never gets it trained twice.
- ``take`` returns the oldest usable episodes first and drops those staler than ``max_staleness``.
- A checkpoint stores the unconsumed episodes and ``seen``; WAL segments older than the checkpoint are
  then deleted. Resuming reads the checkpoint, then any WAL entries it has not seen.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

from ..types import Episode
from ..wire.codec import WireError, decode, decode_episode

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def write_frames(f, frames: list) -> None:
    f.write(_U32.pack(len(frames)))
    for fr in frames:
        buf = memoryview(fr.buffer if hasattr(fr, "buffer") else fr).cast("B")
        f.write(_U64.pack(buf.nbytes))
        f.write(buf)


def read_frame_records(path: Path) -> Iterator[list[bytes]]:
    """Frame lists from a WAL/buffer file; stops quietly at a torn final record."""
    with open(path, "rb") as f:
        while True:
            head = f.read(4)
            if len(head) < 4:
                return
            (n,) = _U32.unpack(head)
            frames = []
            for _ in range(n):
                lh = f.read(8)
                if len(lh) < 8:
                    return
                (ln,) = _U64.unpack(lh)
                data = f.read(ln)
                if len(data) < ln:
                    return
                frames.append(data)
            yield frames


class ReplayBuffer:
    def __init__(self, directory: Path, capacity: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.episodes: OrderedDict[str, tuple[Episode, list]] = OrderedDict()
        self.seen: set[str] = set()
        self.dropped_stale = 0
        self._wal = None
        self._wal_path: Path | None = None
        self._dirty = False

    def __len__(self) -> int:
        return len(self.episodes)

    # -- writing --------------------------------------------------------------------------------
    def open_wal(self, segment: int) -> None:
        if self._wal is not None:
            self._wal.close()
        self._wal_path = self.dir / f"wal-{segment:08d}.bin"
        self._wal = open(self._wal_path, "ab")

    def add(self, episode: Episode, frames: list) -> bool:
        """Append to the WAL and the buffer. False (and nothing written) for a duplicate id."""
        if episode.id in self.seen:
            return False
        write_frames(self._wal, frames)
        self._dirty = True
        self.seen.add(episode.id)
        self.episodes[episode.id] = (episode, frames)
        return True

    def sync(self) -> None:
        if self._dirty and self._wal is not None:
            self._wal.flush()
            os.fsync(self._wal.fileno())
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

    def versions(self) -> list[int]:
        return [ep.policy_version for ep, _ in self.episodes.values()]

    # -- checkpoint / resume --------------------------------------------------------------------
    def save(self, path: Path) -> None:
        with open(path, "wb") as f:
            for _, frames in self.episodes.values():
                write_frames(f, frames)
            f.flush()
            os.fsync(f.fileno())

    def drop_wal_before(self, segment: int) -> None:
        for p in self.dir.glob("wal-*.bin"):
            if int(p.stem.split("-")[1]) < segment:
                p.unlink()

    def restore(self, buffer_file: Path | None, seen: set[str]) -> int:
        """Rebuild from a checkpoint's buffer file plus WAL entries it has not seen. Returns how
        many episodes came from the WAL."""
        self.seen = set(seen)
        if buffer_file is not None and buffer_file.exists():
            for frames in read_frame_records(buffer_file):
                ep = decode_episode(decode(frames))
                self.episodes[ep.id] = (ep, frames)
                self.seen.add(ep.id)
        recovered = 0
        for wal in sorted(self.dir.glob("wal-*.bin")):
            for frames in read_frame_records(wal):
                try:
                    ep = decode_episode(decode(frames))
                except WireError:
                    continue
                if ep.id not in self.seen:
                    self.seen.add(ep.id)
                    self.episodes[ep.id] = (ep, frames)
                    recovered += 1
        return recovered
