"""Shared-memory weight sync for actors on the learner's host (``sync.type: ipc``).

The learner writes each version's tensors into a shared-memory segment (a file in ``/dev/shm``,
or ``sync.dir``) and sends actors only the segment's name and the tensors' layout (name, dtype,
shape, byte offset) in the ``weights`` message: no tensor bytes cross the socket and nothing is
pickled. An actor maps the segment and copies it out with one memory copy.

Two segments per layout, used in turn (version v in slot v mod 2), so the version an actor was
sent stays intact while the learner writes the next one. Each segment starts with a header of
two int64 words, ``[begin, end]``: the writer sets ``begin = v, end = -1``, writes the tensors,
then sets ``end = v``; a reader checks ``begin == end == v`` before its copy and ``begin == v``
after it (a seqlock), so a version overwritten while being read (an actor two versions behind)
is refused with :class:`WeightsError`, never loaded torn; the actor asks again and gets the newest.

Segments are named ``asyncrl-w-<learner pid>-<token>-<generation>-<slot>``. The learner removes
its own on exit (``close``, also at interpreter exit); one killed before it could is swept by the
next publisher on the host (segments whose learner pid is no longer alive).

On CUDA the same protocol would carry CUDA IPC handles instead of a host segment; that path is
not written yet (no GPU to test it on): GPU tensors are copied to the host segment.
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
import stat
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..lifecycle import pid_alive
from ..wire.codec import Message, encode
from ..wire.messages import TensorSpec, Weights
from ..wire.tensors import check_layout, pack, plan_layout, unpack
from .base import Publisher, Receiver, WeightsError

PREFIX = "asyncrl-w-"
HEADER_BYTES = 64  # [begin version, end version] as int64, padded so tensors start 64-byte aligned
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-\d+-[01]$")

def default_dir() -> Path:
    """``/dev/shm`` (memory-backed) where it exists, else the temp directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def sweep_stale(directory: Path) -> list[str]:
    """Remove the segments in ``directory`` whose learner process is gone; returns their names."""
    removed = []
    for path in Path(directory).glob(f"{PREFIX}*"):
        m = _NAME.match(path.name)
        if m and not pid_alive(int(m.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def check_owner(fd: int, path) -> None:
    """WeightsError unless the open file ``fd`` is a regular file owned by this user and closed to
    everyone else (mode 0600 or less, as the learner makes it): a segment or file another local
    user made, or could write, under the expected name is never loaded."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise WeightsError(f"{path} is not this user's private weights file (owner uid {st.st_uid}, mode "
                           f"{stat.S_IMODE(st.st_mode):o}; expected uid {os.geteuid()}, mode 600): another local user "
                           f"may have made it; refused")


class _Segment:
    """One mapped segment: ``header`` (int64 [begin, end]) and ``data`` (uint8), as views."""

    def __init__(self, path: Path, data_bytes: int | None = None):
        self.path, self.name = path, path.name
        if data_bytes is not None:  # create (the learner)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, HEADER_BYTES + max(data_bytes, 1))
                self.mm = mmap.mmap(fd, 0, access=mmap.ACCESS_WRITE)
            finally:
                os.close(fd)
        else:  # attach read-only (an actor): only a segment of this user's that no one else can write
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                check_owner(fd, path)
                self.mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
        self.header = np.frombuffer(self.mm, dtype=np.int64, count=2)
        self.data = np.frombuffer(self.mm, dtype=np.uint8, offset=HEADER_BYTES)

    def close(self, unlink: bool = False) -> None:
        del self.header, self.data  # the views must go before the map can close
        self.mm.close()
        if unlink:
            self.path.unlink(missing_ok=True)


class IpcPublisher(Publisher):
    """The learner's side: ``frames`` writes ``state`` into the next slot and returns the message."""

    needs_snapshot = False  # the tensors are copied into the segment before frames() returns

    def __init__(self, sync_cfg=None, run_dir=None, wire_cfg=None):
        self.dir = Path(sync_cfg.dir) if sync_cfg is not None and sync_cfg.dir else default_dir()
        self.dir.mkdir(parents=True, exist_ok=True)
        sweep_stale(self.dir)
        self._prefix = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._key: tuple | None = None
        self._slots: list[_Segment] = []
        self._generation = 0
        atexit.register(self.close)

    def frames(self, state: dict[str, torch.Tensor], version: int) -> list:
        layout, size = plan_layout(state)
        key = tuple((t.name, t.dtype, tuple(t.shape)) for t in layout)
        if key != self._key:  # a new layout (the first version, or another model): new segments
            self.close()
            self._generation += 1
            self._slots = [_Segment(self.dir / f"{self._prefix}-{self._generation}-{i}", size) for i in (0, 1)]
            self._key = key
        seg = self._slots[version % 2]
        seg.header[0], seg.header[1] = version, -1
        pack(torch.from_numpy(seg.data), layout, state)
        seg.header[1] = version
        return encode("weights", Weights(version=int(version), segment=seg.name, layout=layout))

    @property
    def segment_paths(self) -> list[Path]:
        return [s.path for s in self._slots]

    def close(self) -> None:
        """Unmap and remove this publisher's segments (idempotent)."""
        for seg in self._slots:
            seg.close(unlink=True)
        self._slots = []
        self._key = None


class IpcReceiver(Receiver):
    """The actor's side: maps the named segment (kept open while the learner uses it), copies the
    version out with one memory copy into a buffer of its own, and checks it was not overwritten."""

    def __init__(self, sync_cfg=None, wire_cfg=None, actor_id=None):
        self.dir = Path(sync_cfg.dir) if sync_cfg is not None and sync_cfg.dir else default_dir()
        self._open: dict[str, _Segment] = {}
        self._buf: torch.Tensor | None = None

    def tensors(self, msg: Message) -> tuple[int, dict[str, torch.Tensor]]:
        body, version = msg.body, msg.body.version
        if not body.segment or body.layout is None:
            raise WeightsError("the learner sent no shared-memory segment but this actor expects sync.type=ipc; "
                               "use the same sync.type on both sides")
        seg = self._segment(body.segment)
        size = max((t.offset + t.nbytes for t in body.layout), default=0)
        _check_layout(body.layout, seg.data.size)
        if not seg.header[0] == seg.header[1] == version:
            raise WeightsError(f"shared-memory segment {body.segment} holds version {int(seg.header[1])}, not "
                               f"{version} (overwritten by a newer one before this actor read it); the next follows")
        if self._buf is None or self._buf.numel() < size:
            self._buf = torch.empty(size, dtype=torch.uint8)
        buf = self._buf[:size]
        np.copyto(buf.numpy(), seg.data[:size])
        if seg.header[0] != version:
            raise WeightsError(f"version {version} in {body.segment} was overwritten while this actor copied it; "
                               f"the next follows")
        return version, unpack(buf, body.layout)

    def _segment(self, name: str) -> _Segment:
        if not _NAME.match(name):
            raise WeightsError(f"'{name}' is not an asyncrl shared-memory segment name ({PREFIX}<pid>-...)")
        seg = self._open.get(name)
        if seg is None:
            try:
                seg = _Segment(self.dir / name)
            except FileNotFoundError:
                raise WeightsError(f"shared-memory segment {self.dir / name} does not exist: ipc sync needs the "
                                   f"learner on this host (and the same sync.dir)") from None
            except OSError as e:  # e.g. ELOOP: a link under the segment's name
                raise WeightsError(f"shared-memory segment {self.dir / name} cannot be opened: {e.strerror}") from None
            for old in [n for n in self._open if n.rsplit("-", 1)[0] != name.rsplit("-", 1)[0]]:
                self._open.pop(old).close()  # another learner session or layout: its segments are done
            self._open[name] = seg
        return seg

    def close(self) -> None:
        for seg in self._open.values():
            seg.close()
        self._open.clear()


def _check_layout(layout: list[TensorSpec], data_bytes: int) -> None:
    problem = check_layout(layout, data_bytes)
    if problem:
        raise WeightsError(problem.replace("a buffer of", "a segment of"))
