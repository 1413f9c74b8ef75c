"""The run directory: config snapshot, metrics and events as JSON lines (schema in docs/design/events.md).

Every line is one JSON object with ``schema`` (EVENTS_SCHEMA), ``kind``, ``t`` (unix seconds) and
``step`` (learner policy version when written). Lines are flushed as written so that readers (the
UI, notebooks) can follow a live run; a reader must tolerate a truncated last line.

Metrics can also go to experiment trackers (``log.trackers``: tensorboard, wandb, trackio), each
through its own project's client library, imported only when named: :func:`check_trackers` turns a
missing library into a one-line error naming the pip package, before anything is built.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError
from ..metric_names import tag
from .layout import EVENTS, METRICS

EVENTS_SCHEMA = 1


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _clean(value.item())
    return value


class JsonlWriter:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> str:
        line = json.dumps(_clean(record), separators=(",", ":"))
        self._f.write(line + "\n")
        self._f.flush()
        return line

    def close(self) -> None:
        self._f.close()


# ------------------------------------------------------------------------------------- trackers
# name -> (module that must be importable, pip package that provides it)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
}


class TrackerError(ConfigError):
    """A tracker named in ``log.trackers`` that cannot be used; one line."""


def check_trackers(names: list[str]) -> None:
    """TrackerError (one line, naming the pip package) for an unknown or uninstalled tracker.
    Only looks the modules up: nothing is imported or started."""
    for name in names:
        if name not in TRACKERS:
            raise TrackerError(f"log.trackers: unknown tracker {name!r}; choose from {sorted(TRACKERS)}")
        module, package = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise TrackerError(
                f"log.trackers: {name} needs the {package!r} package, which is not installed: "
                f"pip install {package} (or remove {name} from log.trackers)"
            )
        if name == "wandb" and not _wandb_can_log():
            raise TrackerError(
                "log.trackers: wandb has no login here (no WANDB_API_KEY, no api key in ~/.netrc): "
                "run `wandb login`, or set WANDB_MODE=offline to log locally (wandb sync later), or "
                "remove wandb from log.trackers"
            )


def _wandb_can_log() -> bool:
    """Whether ``wandb.init`` can start without asking for a key: offline or disabled, an API key in
    the environment, or one in the netrc file ``wandb login`` writes (nothing is imported)."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get(
        "WANDB_DISABLED", ""
    ).lower() in ("true", "1"):
        return True
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        auth = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def _scalars(values: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record (bools and non-numbers left out)."""
    out = {}
    for k, v in values.items():
        if hasattr(v, "item") and callable(v.item):
            v = v.item()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    return out


class TensorBoardSink:
    """``<run>/tensorboard`` with PyTorch's TensorBoard writer (needs ``tensorboard``): scalars,
    the config as text, histograms, completions tables as markdown text. A resumed run appends to
    the same directory (TensorBoard shows it as one run)."""

    def __init__(self, run_dir: Path, name: str, project: str, config: dict, resume: bool = False):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        if config:
            import yaml

            self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def histograms(self, step: int, values: dict[str, list[float]]) -> None:
        import numpy as np

        for k, v in values.items():
            self.writer.add_histogram(k, np.asarray(v, dtype=np.float64), global_step=step)
        self.writer.flush()

    def table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        def cell(x):
            return str(x).replace("|", "\\|").replace("\n", "<br>")

        md = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        md += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
        self.writer.add_text(name, "\n".join(md), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


TRACKER_IDS = "trackers.json"  # in the run directory: the tracker run ids a resume continues


def _tracker_ids(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / TRACKER_IDS).read_text())
    except (OSError, ValueError):
        return {}


def _save_tracker_id(run_dir: Path, tracker: str, run_id: str) -> None:
    ids = {**_tracker_ids(run_dir), tracker: run_id}
    (Path(run_dir) / TRACKER_IDS).write_text(json.dumps(ids))


class WandbSink:
    """A Weights & Biases run named after the asyncrl run (files under ``<run>/wandb``; offline with
    ``WANDB_MODE=offline``). Its id is kept in ``<run>/trackers.json``: a resumed run continues it."""

    def __init__(self, run_dir: Path, name: str, project: str, config: dict, resume: bool = False):
        import wandb

        self.wandb = wandb
        known = _tracker_ids(run_dir).get("wandb") if resume else None
        self.run = wandb.init(
            project=project,
            name=name,
            dir=str(run_dir),
            config=config,
            reinit="create_new",
            **({"id": known, "resume": "allow"} if known else {}),
        )
        _save_tracker_id(run_dir, "wandb", self.run.id)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def histograms(self, step: int, values: dict[str, list[float]]) -> None:
        self.run.log({k: self.wandb.Histogram(v) for k, v in values.items()}, step=step)

    def table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioSink:
    """A Trackio run (stored where Trackio keeps its runs: ``TRACKIO_DIR``, by default under the
    Hugging Face cache; ``trackio show`` opens its dashboard). A resumed run continues the run of
    the same name."""

    def __init__(self, run_dir: Path, name: str, project: str, config: dict, resume: bool = False):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(
            project=project, name=name, config=config, embed=False, resume="allow" if resume else "never"
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def histograms(self, step: int, values: dict[str, list[float]]) -> None:
        self.run.log({k: self.trackio.Histogram(v) for k, v in values.items()}, step=step)

    def table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({name: self.trackio.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


_SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "trackio": TrackioSink}


def open_trackers(names: list[str], run_dir: Path, name: str, project: str, config: dict, resume: bool = False) -> list:
    """One sink per tracker in ``names`` (checked with :func:`check_trackers` first); ``resume``:
    continue the trackers' runs of this run (W&B by its saved id, Trackio by name)."""
    check_trackers(names)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return [_SINKS[n](Path(run_dir), name, project, config, resume=resume) for n in names]


class RunLog:
    """Writes ``metrics.jsonl`` and ``events.jsonl``; ``on_event`` hooks stream events live;
    ``trackers`` (from :func:`open_trackers`) get every metrics record's finite numbers. A tracker
    that fails is reported once and dropped: it never stops the run, the JSON lines stay complete."""

    def __init__(
        self, run_dir: Path, on_event: Callable[[dict[str, Any]], None] | None = None, trackers: list | None = None
    ):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics = JsonlWriter(self.dir / METRICS)
        self.events = JsonlWriter(self.dir / EVENTS)
        self.on_event = on_event
        self.trackers = list(trackers or [])

    def metric(self, step: int, values: dict[str, Any]) -> None:
        """A metrics line; the trackers get its numbers under section tags (``policy/loss``), the
        ``eval/*`` ones excepted: they go with the ``eval`` event, the one before training too."""
        self.metrics.write({"step": step, "t": time.time(), **values})
        scalars = {tag(k): v for k, v in _scalars(values).items() if not k.startswith("eval/")}
        self._to_trackers("log", step, scalars)

    def extras(
        self,
        step: int,
        histograms: dict[str, list[float]] | None = None,
        tables: dict[str, tuple[list[str], list[list]]] | None = None,
    ) -> None:
        """What only the trackers get: histograms (name -> values) and tables (name -> (columns, rows))."""
        if histograms:
            self._to_trackers("histograms", step, {k: v for k, v in histograms.items() if len(v)})
        for name, (columns, rows) in (tables or {}).items():
            if rows:
                self._to_trackers("table", step, name, columns, rows)

    def _to_trackers(self, method: str, step: int, *args) -> None:
        for sink in list(self.trackers):
            try:
                getattr(sink, method)(step, *args)
            except Exception as e:  # noqa: BLE001 - a tracker's own failure must not end the run
                self.trackers.remove(sink)
                print(
                    f"[learner] tracker {type(sink).__name__} failed ({e}); nothing more goes to it",
                    file=sys.stderr,
                    flush=True,
                )

    def event(self, kind: str, step: int, **fields: Any) -> None:
        record = {"schema": EVENTS_SCHEMA, "kind": kind, "t": time.time(), "step": step, **fields}
        self.events.write(record)
        if self.on_event is not None:
            self.on_event(_clean(record))
        if kind == "eval" and self.trackers:  # the held-out figures at the version evaluated (0 included)
            version = fields.get("version", step)
            self._to_trackers(
                "log", version, {f"eval/{k}": v for k, v in _scalars(fields).items() if k not in ("version", "step")}
            )
            samples = fields.get("samples") or []
            if samples:
                cols = ["prompt", "completion", "answer", "reward", "correct"]
                self._to_trackers(
                    "table",
                    version,
                    "eval/samples",
                    cols,
                    [[str(s.get(c)) if c in ("answer",) else s.get(c) for c in cols] for s in samples],
                )

    def close(self) -> None:
        self.metrics.close()
        self.events.close()
        for sink in self.trackers:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001
                print(f"[learner] closing tracker {type(sink).__name__} failed: {e}", file=sys.stderr, flush=True)
        self.trackers = []


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; a truncated or corrupt line is skipped (a live writer's tail)."""
    out = []
    if not Path(path).exists():
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
