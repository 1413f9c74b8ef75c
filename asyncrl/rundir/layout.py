"""The run directory's layout, on the ground floor: every path a run writes, checkpoint listing and
selection, and the durable-write helpers. Everything that reads or writes a run directory (the
learner, the launcher, ``rundir``'s start-up rules, the analysis readers, the UI) takes its paths
from here, so a file is named in one place.

::

    runs/<name>/                                mode 0700: this user's alone
      config.yaml, config.resume-<step>.yaml   config snapshots (first start, each resume)
      metrics.jsonl, metrics.discarded.jsonl    one line per step (and steps a resume rolled back)
      events.jsonl                              every event (docs/design/events.md)
      addresses.json                            the learner's bound addresses (actors, UI)
      sock/                                     its ipc sockets (mode 0700; asyncrl.wire.sockets.socket_dir)
      learner.lock, learner.pid                 one learner per run directory
      stop_reason.txt                           why `asyncrl run` stopped the learner (a component failed)
      learner-rank<i>.log, actor-<i>.log        logs of `asyncrl run`'s children
      buffer/wal-<step>.bin                     the write-ahead log of acknowledged episodes
      buffer/quarantine/                        damaged WAL bytes and records that failed checks
      checkpoints/step_<n>/                     checkpoints (manifest.json lists sizes and CRC32Cs)
      weights/                                  sync.type=filesystem: published weights

Imports nothing of asyncrl: any layer may use it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import crc32c

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
METRICS_DISCARDED = "metrics.discarded.jsonl"
EVENTS = "events.jsonl"
ADDRESSES = "addresses.json"
LOCK_FILE = "learner.lock"
PID_FILE = "learner.pid"
STOP_REASON = "stop_reason.txt"  # why `asyncrl run` stops the learner when a component failed
STOPPING = "stopping.json"  # a learner asked to stop: until when it needs to give up its step and checkpoint
BUFFER = "buffer"
CHECKPOINTS = "checkpoints"
WEIGHTS = "weights"
QUARANTINE = "quarantine"
MANIFEST = "manifest.json"
LEDGER = "ledger.jsonl"  # the task ledger's record (asyncrl.learner.ledger)
CRITIC = "critic"  # a checkpoint's critic (train.advantage.estimator gae): model.safetensors, optimizer.pt
MANIFEST_FORMAT = 1

# What a run leaves in its directory (removed by --overwrite), and what marks a folder as a run.
RUN_FILES = (
    CHECKPOINTS,
    BUFFER,
    WEIGHTS,
    METRICS,
    METRICS_DISCARDED,
    EVENTS,
    CONFIG,
    "config.resume-*.yaml",
    ADDRESSES,
    "actor-*.log",
    PID_FILE,
    STOP_REASON,
    "provenance.json",
    "archive",
    LEDGER,
)
RUN_MARKERS = (METRICS, EVENTS, CONFIG, ADDRESSES, PID_FILE)

_CHUNK = 1 << 22


def config_snapshot(run_dir: Path, step: int | None = None) -> Path:
    """The config snapshot of the first start (``step`` None) or of the resume at ``step``."""
    return Path(run_dir) / (f"config.resume-{step}.yaml" if step is not None else CONFIG)


def addresses(run_dir: Path) -> Path:
    return Path(run_dir) / ADDRESSES


def read_addresses(run_dir: Path) -> dict | None:
    """The learner's addresses, or None when the file is missing or half-written."""
    try:
        return json.loads(addresses(run_dir).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def buffer_dir(run_dir: Path) -> Path:
    return Path(run_dir) / BUFFER


def wal_segment(buffer: Path, segment: int) -> Path:
    return Path(buffer) / f"wal-{segment:08d}.bin"


def wal_segments(buffer: Path) -> list[Path]:
    """The WAL segments of a buffer directory, oldest first."""
    return sorted(Path(buffer).glob("wal-*.bin"), key=lambda p: int(p.stem.split("-")[1]))


def actor_log(run_dir: Path, index: int) -> Path:
    return Path(run_dir) / f"actor-{index}.log"


def learner_rank_log(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"learner-rank{rank}.log"


# -- checkpoints ------------------------------------------------------------------------------------
class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the checkpoint and the file at fault."""


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{step:08d}"


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name.split("_")[1])


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories (``step_<n>``), oldest first; temp and quarantined ones are not listed."""
    root = checkpoint_root(run_dir)
    if not root.exists():
        return []
    cands = [p for p in root.glob("step_*") if p.is_dir() and p.name.split("_")[1].isdigit()]
    return sorted(cands, key=checkpoint_step)


def file_crc32c(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = crc32c.crc32c(chunk, value)
    return value


_verified: dict[tuple, str | None] = {}  # a start checks twice (before and after taking the lock)


def verify_checkpoint(path: Path) -> str | None:
    """None when every file listed in the manifest has its recorded size and CRC32C; otherwise one
    line naming the file at fault and what is wrong with it. Results are remembered for this
    process while no file of the checkpoint changes size or modification time."""
    path = Path(path)
    key = (str(path),) + tuple(
        sorted((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in path.rglob("*") if f.is_file())
    )
    if key not in _verified:
        _verified[key] = _verify(path)
    return _verified[key]


def _verify(path: Path) -> str | None:
    man_path = path / MANIFEST
    if not man_path.exists():
        return f"{man_path}: missing (an interrupted write, or a checkpoint from before manifests)"
    try:
        manifest = json.loads(man_path.read_text())
        files = manifest["files"]
        assert manifest.get("format") == MANIFEST_FORMAT and isinstance(files, dict) and files
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"{man_path}: not a manifest of format {MANIFEST_FORMAT}"
    for rel, want in files.items():
        f = path / rel
        if not f.is_file():
            return f"{f}: missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f}: {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if f"{file_crc32c(f):08x}" != want["crc32c"]:
            return f"{f}: checksum does not match the manifest (damaged bytes)"
    return None


def select_checkpoint(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest intact checkpoint (None if there is none) and the damaged newer ones skipped on
    the way, each with the problem found."""
    damaged = []
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            return ckpt, damaged
        damaged.append((ckpt, problem))
    return None, damaged


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest intact checkpoint, or None."""
    return select_checkpoint(run_dir)[0]


def quarantine_checkpoint(path: Path) -> Path:
    """Move a damaged checkpoint aside (``damaged-step_<n>[.k]``, kept for inspection) so that it is
    neither resumed from, counted among the kept ones, nor overwritten."""
    target = path.with_name(f"damaged-{path.name}")
    k = 1
    while target.exists():
        target = path.with_name(f"damaged-{path.name}.{k}")
        k += 1
    path.rename(target)
    return target


def clean_partial(run_dir: Path) -> list[Path]:
    """Remove what an interrupted checkpoint save left (``.tmp_step_*``, ``.old_step_*``)."""
    root = checkpoint_root(run_dir)
    left = sorted(root.glob(".tmp_step_*")) + sorted(root.glob(".old_step_*")) if root.exists() else []
    for p in left:
        shutil.rmtree(p, ignore_errors=True)
    return left


# -- durable writes -----------------------------------------------------------------------------------
def fsync_path(path: Path) -> None:
    """``fsync`` a file or a directory (a directory: its entries survive a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(tmp: Path, final: Path) -> None:
    """Make the complete directory ``tmp`` be ``final``, atomically as far as a reader can tell: an
    existing ``final`` is moved aside first and removed after, so a crash in between leaves one of
    the two whole (``.old_<name>`` is cleaned up by the next call)."""
    old = final.with_name(f".old_{final.name}")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def cut_file(path: Path, size: int) -> None:
    """Truncate ``path`` to ``size`` bytes, durably."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
