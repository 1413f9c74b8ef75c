"""What state a run is in (running, finished, interrupted, crashed, waiting, silent) and which
folders are runs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..lifecycle import pid_alive
from ..rundir.layout import PID_FILE, RUN_MARKERS

if TYPE_CHECKING:
    from .store import RunStore


NA = "n/a"  # how a figure over zero samples is shown (never 0)
SILENT_AFTER_S = 120.0  # a live-only view with no news for this long: state "silent"


@dataclass
class RunState:
    """``state``: waiting (no learner yet), running, finished, interrupted (stopped by a signal or
    a failed actor before ``total_steps``), crashed (no ``learner_stop`` event and the learner is
    gone), or silent (a live-only view that has heard nothing for a while). ``reason``: one line."""

    state: str
    reason: str


def _learner_pid(run_dir: Path | None) -> int | None:
    if run_dir is None:
        return None
    try:
        text = (Path(run_dir) / PID_FILE).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def run_state(store: "RunStore", now: float | None = None) -> RunState:
    """The run's state from its records and, for a run directory, the learner's pid file.

    The latest ``learner_start`` decides which segment is looked at (a resumed run has a
    ``learner_stop`` of its earlier segment). Without a stop event: the pid file's process alive
    means running; a pid file naming a dead process (killed) or no pid file (the learner exited
    without its orderly stop, e.g. on an exception) means crashed."""
    now = time.time() if now is None else now
    starts, stops = store.records("learner_start"), store.records("learner_stop")
    last_start = max((float(r.get("t") or 0) for r in starts), default=None)
    stop = stops[-1] if stops else None
    if stop is not None and (last_start is None or float(stop.get("t") or 0) >= last_start):
        steps = (stop.get("summary") or {}).get("steps_trained")
        trained = f"{steps} step(s) trained" if steps is not None else f"stopped at step {stop.get('step')}"
        if stop.get("interrupted"):
            return RunState("interrupted", f"the learner was stopped before total_steps ({trained})")
        return RunState("finished", f"the learner finished at step {stop.get('step')} ({trained})")
    replayed = store.records("replay")  # an asyncrl replay's output: no learner, its own end record
    if replayed and not starts:
        r = replayed[-1]
        return RunState(
            "finished",
            f"a replay of {r.get('source', 'a run')} ({r.get('steps', '?')} steps; "
            f"{'bit for bit' if r.get('identical') else 'see replay.json'})",
        )
    if store.run_dir is None:  # only the live events socket
        if not store.revision:
            return RunState("waiting", "no event received yet")
        age = now - store.last_update
        if age > SILENT_AFTER_S:
            return RunState("silent", f"no event for {age:.0f} s and no learner_stop event")
        return RunState("running", f"last event {age:.0f} s ago")
    pid = _learner_pid(store.run_dir)
    if pid is not None and pid_alive(pid):
        return RunState(
            "running" if starts else "waiting",
            f"learner pid {pid} is alive" + ("" if starts else " (starting: loading the model)"),
        )
    if not starts and not store.metric_records():
        return RunState("waiting", "no learner has started in this directory yet")
    if pid is not None:
        return RunState("crashed", f"no learner_stop event and the learner (pid {pid}) is gone (killed?)")
    return RunState(
        "crashed",
        "no learner_stop event and no learner holds the run (it exited without stopping cleanly; see its output)",
    )


# ------------------------------------------------------------------------------------- runs and curves


def is_run_dir(path: str | Path) -> bool:
    """A directory holding any file a learner writes (``RUN_MARKERS``)."""
    path = Path(path)
    return path.is_dir() and any((path / m).exists() for m in RUN_MARKERS)


def list_runs(root: str | Path) -> list[Path]:
    """The run directories directly under ``root`` (a folder of runs such as ``runs/``), by name."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    return sorted((p for p in root.iterdir() if is_run_dir(p)), key=lambda p: p.name)


def actor_statuses(store: "RunStore", now: float | None = None):
    """The actors' latest status as the UI shows it. Once the run is over (finished, interrupted,
    crashed) an actor's silence and its lag behind the learner mean nothing any more: the status
    says the run's state ("run finished"); the lag, the unacknowledged episodes, the credits and
    the time since its last status are blank."""
    df = store.actors(now)
    state = run_state(store).state
    if not df.empty and state not in ("running", "waiting"):
        df["status"] = f"run {state}"
        for col in ("lag", "unacked", "credits", "last_status_s_ago"):  # (their last live values mislead)
            if col in df:
                df[col] = None
    return df
