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

With the learner on a GPU (``sync.cuda_ipc``, on by default) the tensors never leave it: each slot
is a GPU buffer that the learner shares once as a CUDA IPC handle (:class:`CudaHandle`, plain bytes
and integers, no pickle), the host segment keeps only the header, and an actor maps the buffer
once and copies each version out on the GPU, under the same seqlock (the learner waits for its
copy kernels before it sets ``end``; an actor waits for its own before it checks ``begin``).
torch's CUDA IPC reference counter keeps a buffer alive while an actor has it mapped.
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
from ..wire.messages import CudaHandle, TensorSpec, Weights
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
        raise WeightsError(
            f"{path} is not this user's private weights file (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}; expected uid {os.geteuid()}, mode 600): another local user "
            f"may have made it; refused"
        )


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
        self._gpu: list[tuple[torch.Tensor, CudaHandle]] = []  # per slot, when the weights are on a GPU
        self._generation = 0
        self.cuda_ipc = True if sync_cfg is None else bool(getattr(sync_cfg, "cuda_ipc", True))
        atexit.register(self.close)

    def frames(self, state: dict[str, torch.Tensor], version: int, digest: str | None = None) -> list:
        layout, size = plan_layout(state)
        device = _cuda_device(state) if self.cuda_ipc else None
        key = (device, tuple((t.name, t.dtype, tuple(t.shape)) for t in layout))
        if key != self._key:  # a new layout (the first version, another model or device): new segments
            self.close()
            self._generation += 1
            host_bytes = 0 if device is not None else size
            self._slots = [_Segment(self.dir / f"{self._prefix}-{self._generation}-{i}", host_bytes) for i in (0, 1)]
            if device is not None:
                self._gpu = [_share(torch.empty(max(size, 1), dtype=torch.uint8, device=device)) for _ in (0, 1)]
            self._key = key
        seg = self._slots[version % 2]
        seg.header[0], seg.header[1] = version, -1
        if device is None:
            pack(torch.from_numpy(seg.data), layout, state)
            cuda = None
        else:
            buf, cuda = self._gpu[version % 2]
            with torch.cuda.device(device):
                pack(buf, layout, state)
                torch.cuda.current_stream().synchronize()  # the copies are done before `end` says so
        seg.header[1] = version
        return encode(
            "weights", Weights(version=int(version), segment=seg.name, layout=layout, cuda=cuda, digest=digest)
        )

    @property
    def segment_paths(self) -> list[Path]:
        return [s.path for s in self._slots]

    def close(self) -> None:
        """Unmap and remove this publisher's segments (idempotent)."""
        for seg in self._slots:
            seg.close(unlink=True)
        self._slots, self._gpu = [], []  # (torch frees a shared buffer once no actor has it mapped)
        self._key = None


def _cuda_device(state: dict[str, torch.Tensor]) -> torch.device | None:
    """The one CUDA device all of ``state`` lies on, or None (CPU tensors, or several devices)."""
    devices = {t.device for t in state.values()}
    if len(devices) == 1:
        (device,) = devices
        if device.type == "cuda":
            return device
    return None


def _share(buf: torch.Tensor) -> tuple[torch.Tensor, CudaHandle]:
    """``buf`` and the CUDA IPC handle that lets another process on this host map it."""
    (device, handle, size, offset, ref_counter, ref_offset, event, event_sync) = buf.untyped_storage()._share_cuda_()
    return buf, CudaHandle(
        device=int(device),
        handle=bytes(handle),
        size=int(size),
        offset=int(offset),
        ref_counter=bytes(ref_counter),
        ref_counter_offset=int(ref_offset),
        event=bytes(event or b""),
        event_sync=bool(event_sync),
    )


class IpcReceiver(Receiver):
    """The actor's side: maps the named segment (kept open while the learner uses it), copies the
    version out with one memory copy into a buffer of its own, and checks it was not overwritten."""

    def __init__(self, sync_cfg=None, wire_cfg=None, actor_id=None):
        self.dir = Path(sync_cfg.dir) if sync_cfg is not None and sync_cfg.dir else default_dir()
        self._open: dict[str, _Segment] = {}
        self._buf: torch.Tensor | None = None
        self._mapped: dict[str, torch.Tensor] = {}  # segment name -> the learner's GPU buffer, mapped

    def tensors(self, msg: Message) -> tuple[int, dict[str, torch.Tensor]]:
        body, version = msg.body, msg.body.version
        if not body.segment or body.layout is None:
            raise WeightsError(
                "the learner sent no shared-memory segment but this actor expects sync.type=ipc; "
                "use the same sync.type on both sides"
            )
        seg = self._segment(body.segment)
        size = max((t.offset + t.nbytes for t in body.layout), default=0)
        src = None if body.cuda is None else self._map(body.segment, body.cuda)
        _check_layout(body.layout, seg.data.size if src is None else src.numel())
        if not seg.header[0] == seg.header[1] == version:
            raise WeightsError(
                f"shared-memory segment {body.segment} holds version {int(seg.header[1])}, not "
                f"{version} (overwritten by a newer one before this actor read it); the next follows"
            )
        device = torch.device("cpu") if src is None else src.device
        if self._buf is None or self._buf.numel() < size or self._buf.device != device:
            self._buf = torch.empty(size, dtype=torch.uint8, device=device)
        buf = self._buf[:size]
        if src is None:
            np.copyto(buf.numpy(), seg.data[:size])
        else:
            with torch.cuda.device(device):
                buf.copy_(src[:size])
                torch.cuda.current_stream().synchronize()  # copied before the header is checked again
        if seg.header[0] != version:
            raise WeightsError(
                f"version {version} in {body.segment} was overwritten while this actor copied it; the next follows"
            )
        return version, unpack(buf, body.layout)

    def _map(self, name: str, cuda: CudaHandle) -> torch.Tensor:
        """The learner's GPU buffer behind segment ``name``, mapped once (uint8, on its device)."""
        buf = self._mapped.get(name)
        if buf is None:
            if not torch.cuda.is_available() or cuda.device >= torch.cuda.device_count():
                raise WeightsError(
                    f"the learner shares its weights in the memory of CUDA device {cuda.device}, which "
                    f"this actor cannot see; set sync.cuda_ipc=false (host copies) or give the actor "
                    f"that GPU"
                )
            try:
                torch.cuda.init()  # the caching allocator that maps IPC handles must exist first (else a crash)
                storage = torch.UntypedStorage._new_shared_cuda(
                    cuda.device,
                    cuda.handle,
                    cuda.size,
                    cuda.offset,
                    cuda.ref_counter,
                    cuda.ref_counter_offset,
                    cuda.event,
                    cuda.event_sync,
                )
            except (RuntimeError, TypeError, ValueError) as e:
                raise WeightsError(
                    f"the CUDA IPC handle of {name} cannot be opened ({e}); ipc sync needs the learner on this host"
                ) from None
            buf = torch.empty(0, dtype=torch.uint8, device=f"cuda:{cuda.device}").set_(
                storage, 0, (storage.nbytes(),), (1,)
            )
            self._mapped[name] = buf  # (unmapped with its segment, in _segment)
        return buf

    def _segment(self, name: str) -> _Segment:
        if not _NAME.match(name):
            raise WeightsError(f"'{name}' is not an asyncrl shared-memory segment name ({PREFIX}<pid>-...)")
        seg = self._open.get(name)
        if seg is None:
            try:
                seg = _Segment(self.dir / name)
            except FileNotFoundError:
                raise WeightsError(
                    f"shared-memory segment {self.dir / name} does not exist: ipc sync needs the "
                    f"learner on this host (and the same sync.dir)"
                ) from None
            except OSError as e:  # e.g. ELOOP: a link under the segment's name
                raise WeightsError(f"shared-memory segment {self.dir / name} cannot be opened: {e.strerror}") from None
            for old in [n for n in self._open if n.rsplit("-", 1)[0] != name.rsplit("-", 1)[0]]:
                self._open.pop(old).close()  # another learner session or layout: its segments are done
                self._mapped.pop(old, None)  # (and its GPU buffer unmapped: torch's counter drops)
            self._open[name] = seg
        return seg

    def close(self) -> None:
        for seg in self._open.values():
            seg.close()
        self._open.clear()
        self._mapped.clear()
        self._buf = None


def _check_layout(layout: list[TensorSpec], data_bytes: int) -> None:
    problem = check_layout(layout, data_bytes)
    if problem:
        raise WeightsError(problem.replace("a buffer of", "a segment of"))
