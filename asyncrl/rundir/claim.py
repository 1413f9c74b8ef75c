"""The run directory's start-up rules: one learner at a time, fresh means fresh, resuming is explicit.

Promises:
- ``plan_start`` only reads. It refuses (``RunDirError``, one line) a start that would mix runs: a
  run directory holding a run's state (checkpoints, WAL, metrics, events) without ``resume``; a
  resume whose model or algorithm differs from the run's; a resume with no intact checkpoint after
  steps were trained (their weights were never saved). Otherwise it says what the start will do.
- The run directory is private: the learner makes it mode 0700 (its checkpoints, weights,
  write-ahead log, logs and sockets are this user's alone; ``RunLock.acquire``), and the commands
  that write a run create files under umask 077. A run directory another user made, or one under a
  directory someone else owns or anyone may write in (not sticky), is refused (``check_private``).
- ``RunLock`` is an exclusive lock (the ``filelock`` package, an OS lock released when the process
  dies, even by SIGKILL) on ``<run>/learner.lock``, with the holder's pid in ``<run>/learner.pid``.
  A second holder is refused with a message naming the first one's pid.
- ``prepare`` is what ``asyncrl run`` and ``asyncrl learn`` call before starting anything: it checks
  the lock and the plan, and for ``overwrite`` removes the old run's files (only the files asyncrl
  writes; anything else in the directory is left alone).
- Config snapshots: ``config.yaml`` is the config of the run's first segment (a learner's life);
  each resume at step N writes ``config.resume-<N>.yaml``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from filelock import FileLock, Timeout

from ..config import Config, ConfigError, dump_config, flat_keys
from .layout import (
    EVENTS,
    LOCK_FILE,
    METRICS,
    METRICS_DISCARDED,
    PID_FILE,
    RUN_FILES,
    buffer_dir,
    checkpoint_step,
    config_snapshot,
    list_checkpoints,
    select_checkpoint,
    wal_segments,
)

# (asyncrl.rundir.layout.RUN_FILES: what asyncrl writes into a run directory; --overwrite removes exactly these)
# Keys a resume may not change: the checkpoint's weights belong to this model and this algorithm.
FROZEN_ON_RESUME = ("model", "algorithm")
# Keys never compared: where the run is, whether it resumes, and where the built model is cached.
IGNORED_ON_RESUME = ("name", "run_root", "checkpoint.resume", "model.embedded.cache_dir")
CHOICES = "--resume to continue it, a new name=..., or --overwrite to delete it and start again"


class RunDirError(Exception):
    """A start refused because of the run directory's state; the message is one line."""


@dataclass
class StartPlan:
    """What a learner start will do: ``mode`` is ``fresh`` or ``resume``; a resume continues at
    ``step`` from ``checkpoint`` (None: no checkpoint and no step trained yet, only the WAL) after
    quarantining ``damaged`` checkpoints; ``changes`` are config keys that differ from the
    previous segment's snapshot ``previous_config`` as (key, old, new)."""

    run_dir: Path
    mode: str
    step: int = 0
    checkpoint: Path | None = None
    damaged: list[tuple[Path, str]] = field(default_factory=list)
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    previous_config: Path | None = None
    state: list[str] = field(default_factory=list)


# -- what a run directory holds ------------------------------------------------------------------
def check_private(run_dir: Path) -> None:
    """ConfigError (one line) unless ``run_dir`` can be this user's alone: it is this user's if it exists
    (not a directory another user made, say under a shared ``run_root``), and every directory above it
    that exists belongs to this user or root and, if others may write in it, is sticky (as /tmp): else
    someone else could read the run, or rename it away and put a directory of their own in its place."""
    me = os.geteuid()
    run_dir = Path(os.path.abspath(run_dir))
    if os.path.lexists(run_dir):
        st = os.lstat(run_dir)
        if st.st_uid != me:
            raise ConfigError(
                f"the run directory {run_dir} belongs to uid {st.st_uid}, not to this user (uid {me}): "
                f"another user made it and could read or replace the run; pick another name= or "
                f"run_root="
            )
    for parent in run_dir.parents:
        if not parent.exists():
            continue
        st = os.stat(parent)
        if st.st_uid not in (me, 0):
            raise ConfigError(
                f"{parent}, above the run directory {run_dir}, belongs to uid {st.st_uid}: whoever owns "
                f"a directory can replace what is in it; pick a run_root= of your own"
            )
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise ConfigError(
                f"anyone may write in {parent} (mode {st.st_mode & 0o7777:o}, not sticky), above the run "
                f"directory {run_dir}: someone else could replace it; pick a run_root= of your own"
            )


def check_writable(run_dir: Path) -> None:
    """ConfigError (one line) unless ``run_dir`` can be created and written, and kept private
    (:func:`check_private`): found before anything is built, rather than as a traceback (and atexit
    handlers' tracebacks) once the run starts."""
    import tempfile

    run_dir = Path(run_dir)
    check_private(run_dir)
    made = [p for p in [run_dir, *run_dir.parents] if not p.exists()]  # what the check creates, deepest first
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-check-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"cannot write the run directory {run_dir} ({e.strerror or e}); pick a writable "
            f"run_root= or name=, or fix its permissions"
        ) from None
    finally:
        for p in made:  # nothing is left behind by the check (a later check may still refuse the run)
            try:
                p.rmdir()
            except OSError:
                break


def state_found(run_dir: Path) -> list[str]:
    """A short description of each kind of run state present (empty: nothing to lose)."""
    run_dir = Path(run_dir)
    found = []
    ckpts = list_checkpoints(run_dir)
    if ckpts:
        found.append(f"{len(ckpts)} checkpoint(s), newest step {checkpoint_step(ckpts[-1])}")
    wal = [p for p in wal_segments(buffer_dir(run_dir)) if p.stat().st_size > 0]
    if wal:
        found.append(f"a write-ahead log ({sum(p.stat().st_size for p in wal)} bytes)")
    steps = trained_steps(run_dir)
    if steps:
        found.append(f"metrics up to step {steps}")
    elif (run_dir / EVENTS).exists() and (run_dir / EVENTS).stat().st_size > 0:
        found.append("an event log")
    return found


def last_stop_reason(run_dir: Path) -> str | None:
    """Why the run's last learner stopped early (its last ``learner_stop`` event's reason: a failed
    component, a stop signal, ...), or None (it finished, or no such event)."""
    path = Path(run_dir) / EVENTS
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - (1 << 20)))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"learner_stop"' not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("kind") == "learner_stop":
            return event.get("reason") or None
    return None


def trained_steps(run_dir: Path) -> int:
    """The highest step in ``metrics.jsonl`` (0 when none)."""
    best = 0
    path = Path(run_dir) / METRICS
    if path.exists():
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    best = max(best, int(json.loads(line).get("step", 0)))
                except (ValueError, TypeError, AttributeError):
                    continue  # a torn last line
    return best


# -- the lock ------------------------------------------------------------------------------------
class RunLock:
    """Exclusive lock on a run directory for this process's life (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._lock = FileLock(self.run_dir / LOCK_FILE, timeout=0)

    def acquire(self) -> None:
        """Take the lock (creating the run directory, private: mode 0700) and record this pid;
        RunDirError if held."""
        check_private(self.run_dir)
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(self.run_dir)  # (made by someone else in between: refused all the same)
        os.chmod(self.run_dir, 0o700)  # (checkpoints and weights are no one else's to read)
        try:
            self._lock.acquire()
        except Timeout:
            raise RunDirError(_in_use(self.run_dir)) from None
        (self.run_dir / PID_FILE).write_text(f"{os.getpid()}\n")
        atexit.register(self.release)  # the OS drops the lock at exit anyway; this removes the pid file

    def release(self) -> None:
        if self._lock.is_locked:
            (self.run_dir / PID_FILE).unlink(missing_ok=True)
            self._lock.release()


def check_unlocked(run_dir: Path) -> None:
    """RunDirError naming the holder's pid if a learner holds the lock; writes nothing."""
    if not (Path(run_dir) / LOCK_FILE).exists():
        return
    probe = FileLock(Path(run_dir) / LOCK_FILE, timeout=0)
    try:
        probe.acquire()
    except Timeout:
        raise RunDirError(_in_use(run_dir)) from None
    probe.release()


def _in_use(run_dir: Path) -> str:
    try:
        pid = (Path(run_dir) / PID_FILE).read_text().strip() or "unknown"
    except OSError:
        pid = "unknown"
    return f"{run_dir} is in use by another learner (pid {pid}); stop it first, or give this run another name=..."


# -- the decision --------------------------------------------------------------------------------
def plan_start(cfg: Config) -> StartPlan:
    """Decide fresh or resume for ``cfg`` (``checkpoint.resume``); reads only (see module doc)."""
    run_dir = cfg.run_dir
    state = state_found(run_dir)
    if not state:
        return StartPlan(run_dir, "fresh", state=state)
    if not cfg.checkpoint.resume:
        ended = last_stop_reason(run_dir)
        raise RunDirError(
            f"{run_dir} already holds a run ({'; '.join(state)}"
            f"{f'; it ended: {ended}' if ended else ''}): use {CHOICES}"
        )
    ckpt, damaged = select_checkpoint(run_dir)
    step = checkpoint_step(ckpt) if ckpt is not None else 0
    if ckpt is None and trained_steps(run_dir) > 0:
        why = (
            f" (newest: {damaged[0][1]})"
            if damaged
            else " (the weights of its trained steps were never saved; checkpoint.every saves more often)"
        )
        raise RunDirError(
            f"cannot resume {run_dir}: it has no intact checkpoint{why}, and metrics.jsonl shows "
            f"{trained_steps(run_dir)} step(s) trained, which a resume would repeat; start again "
            f"with --overwrite or a new name=..."
        )
    previous = previous_snapshot(run_dir, step)
    changes = config_changes(previous, cfg) if previous is not None else []
    frozen = [k for k, _, _ in changes if _is_frozen(k)]
    if frozen:
        raise RunDirError(
            f"cannot resume {run_dir} with a different {', '.join(frozen)} (the checkpoint was "
            f"trained with {previous.name}'s); keep it, or start a new run with name=..."
        )
    return StartPlan(
        run_dir,
        "resume",
        step=step,
        checkpoint=ckpt,
        damaged=damaged,
        changes=changes,
        previous_config=previous,
        state=state,
    )


def prepare(cfg: Config, overwrite: bool = False) -> StartPlan:
    """Everything a start checks before anything is written: the lock, then the plan. With
    ``overwrite`` (and not resuming) the old run's files are removed under the lock first."""
    if overwrite and cfg.checkpoint.resume:
        raise RunDirError("--overwrite and --resume (checkpoint.resume=true) contradict each other: choose one")
    check_unlocked(cfg.run_dir)
    if overwrite and state_found(cfg.run_dir):
        lock = RunLock(cfg.run_dir)
        lock.acquire()
        try:
            removed = remove_run_files(cfg.run_dir)
        finally:
            lock.release()
        print(
            f"[asyncrl] --overwrite: removed {len(removed)} file(s)/folder(s) of the previous run in {cfg.run_dir}",
            flush=True,
        )
    return plan_start(cfg)


def remove_run_files(run_dir: Path) -> list[Path]:
    """Delete what asyncrl wrote in ``run_dir`` (``RUN_FILES``); returns the paths removed."""
    removed = []
    for pattern in RUN_FILES:
        for p in sorted(Path(run_dir).glob(pattern)):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
    return removed


# -- config snapshots ----------------------------------------------------------------------------
def snapshot_path(run_dir: Path, step: int, resumed: bool) -> Path:
    return config_snapshot(run_dir, step if resumed else None)


def _snapshots(run_dir: Path) -> list[tuple[int, Path]]:
    out = []
    for p in Path(run_dir).glob("config.resume-*.yaml"):
        tail = p.name[len("config.resume-") : -len(".yaml")]
        if tail.isdigit():
            out.append((int(tail), p))
    return sorted(out)


def previous_snapshot(run_dir: Path, step: int) -> Path | None:
    """The config of the segment that trained up to ``step``: the newest ``config.resume-<M>``
    with M < step, else ``config.yaml`` (None if there is none)."""
    earlier = [p for m, p in _snapshots(run_dir) if m < step]
    if earlier:
        return earlier[-1]
    first = config_snapshot(run_dir)
    return first if first.exists() else None


def write_snapshot(cfg: Config, plan: StartPlan) -> Path:
    """Write this segment's config snapshot; a resume at step N also removes the snapshots of
    segments that started at or after N (their steps were rolled back)."""
    resumed = plan.mode == "resume"
    if resumed:
        for m, p in _snapshots(plan.run_dir):
            if m >= plan.step:
                p.unlink()
    path = snapshot_path(plan.run_dir, plan.step, resumed)
    path.write_text(dump_config(cfg))
    return path


def config_changes(previous: Path, cfg: Config) -> list[tuple[str, Any, Any]]:
    """Keys whose values differ between the snapshot ``previous`` and ``cfg``, as (key, old, new)."""
    try:
        old = flat_keys(yaml.safe_load(previous.read_text()) or {})
    except (OSError, yaml.YAMLError) as e:
        raise RunDirError(f"cannot compare the config with {previous}: {e}") from None
    new = flat_keys(cfg.model_dump(mode="json"))
    keys = sorted(set(old) | set(new))
    return [
        (k, old.get(k), new.get(k))
        for k in keys
        if old.get(k) != new.get(k) and not any(k == i or k.startswith(i + ".") for i in IGNORED_ON_RESUME)
    ]


def _is_frozen(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") for f in FROZEN_ON_RESUME)


# -- metrics of rolled-back steps ----------------------------------------------------------------
def discard_metrics_after(run_dir: Path, step: int) -> int:
    """Move ``metrics.jsonl`` lines past ``step`` (trained after the checkpoint a resume starts from,
    so their weights are gone) to ``metrics.discarded.jsonl``; returns how many. The file is cut at
    the first such line, so step numbers never repeat."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        data = f.read()
    offset, cut = 0, None
    for line in data.splitlines(keepends=True):
        try:
            s = int(json.loads(line).get("step", 0))
        except (ValueError, TypeError, AttributeError):
            s = step + 1 if not line.endswith(b"\n") else None  # a torn last line goes too
        if s is not None and s > step:
            cut = offset
            break
        offset += len(line)
    if cut is None:
        return 0
    tail = data[cut:]
    with open(Path(run_dir) / METRICS_DISCARDED, "ab") as f:
        f.write(tail if tail.endswith(b"\n") else tail + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.truncate(path, cut)
    return tail.count(b"\n") + (0 if tail.endswith(b"\n") else 1)
