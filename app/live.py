"""Feeding a :class:`RunStore` live: a run directory poller and a subscriber to the learner's
``events`` PUB socket (ZeroMQ SUB; messages decoded with :func:`asyncrl.wire.codec.decode`); and
the catalog of runs an app shows (one run, or a folder of runs to pick from)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import zmq

from asyncrl.analysis import RunReader, RunStore, list_runs
from asyncrl.wire.codec import WireError, decode
from asyncrl.wire.sockets import apply_curve_client, drain


class DirPoller(threading.Thread):
    """Reads what the learner appended to the run directory every ``interval`` seconds."""

    def __init__(self, run_dir, store: RunStore, interval: float = 1.0):
        super().__init__(daemon=True, name="asyncrl-ui-files")
        self.reader = RunReader(run_dir, store)
        self.interval = interval
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.reader.poll()
            except OSError as e:  # e.g. the directory was removed: report, keep trying
                self.reader.store._warn(f"reading {self.reader.dir}: {e}")
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()


class EventSubscriber(threading.Thread):
    """SUB socket on the learner's events address; every ``event`` message's ``body.event`` record
    goes into the store (``metrics`` records too). Malformed messages are counted and skipped."""

    def __init__(self, address: str, store: RunStore, curve_dir: str | None = None):
        super().__init__(daemon=True, name="asyncrl-ui-events")
        if "://" not in address:
            raise ValueError(f"--connect wants a ZeroMQ address such as tcp://127.0.0.1:5555, got {address!r}")
        self.address = address
        self.store = store
        self.curve_dir = curve_dir
        self.received = 0
        self.bad = 0
        self.last: float | None = None
        self.error: str | None = None
        self._halt = threading.Event()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve_dir:
            apply_curve_client(self.sock, curve_dir)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(address)

    def status(self) -> dict:
        return {
            "address": self.address,
            "received": self.received,
            "last": self.last,
            "error": self.error if self.error else (f"{self.bad} malformed messages skipped" if self.bad else None),
        }

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._halt.is_set():
                if dict(poller.poll(250)):
                    drain(self.sock, self._handle, limit=1000)  # the one receive loop (asyncrl.wire.sockets)
        finally:
            self.sock.close(0)

    def _handle(self, frames) -> None:
        try:
            msg = decode(frames, kinds=("event",))  # typed: body.event is a JSON map
        except WireError as e:
            self.bad += 1
            self.error = f"last bad message: {e}"
            return
        self.received += 1
        self.last = time.time()
        self.store.add_events([msg.body.event])

    def stop(self) -> None:
        self._halt.set()


class RunCatalog:
    """The runs an app can show: one run (a :class:`RunStore`, fed by the caller), or a folder of
    runs (``asyncrl ui --run runs/``): every run directory under it (``asyncrl.analysis.list_runs``,
    looked up again on each call), each read by its own :class:`DirPoller` from the first time it
    is picked."""

    def __init__(
        self,
        store: RunStore | None = None,
        name: str = "run",
        folder=None,
        max_events_per_kind: int | None = None,
        interval: float = 1.0,
    ):
        if (store is None) == (folder is None):
            raise ValueError("RunCatalog wants either one run's store or a folder of runs")
        self.folder = None if folder is None else Path(folder)
        self.single = None if store is None else (name, store)
        self.max_events_per_kind = max_events_per_kind
        self.interval = interval
        self._open: dict[str, tuple[RunStore, DirPoller]] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        if self.single is not None:
            return [self.single[0]]
        try:
            return [p.name for p in list_runs(self.folder)]
        except FileNotFoundError:
            return []

    def newest(self, n: int) -> list[str]:
        """The ``n`` runs written to last (their newest record or config), newest first: what a folder
        of runs shows with none picked, as TensorBoard and W&B do."""
        if self.single is not None:
            return self.names()

        def written(name: str) -> float:
            run = self.folder / name
            times = [
                p.stat().st_mtime
                for p in (run / "events.jsonl", run / "metrics.jsonl", run / "config.yaml")
                if p.exists()
            ]
            return max(times, default=run.stat().st_mtime)

        return sorted(self.names(), key=written, reverse=True)[:n]

    def stores(self, names: list[str] | None) -> dict[str, RunStore]:
        """``name -> store`` of the picked runs in order (the first is the main one); the single
        run whatever is picked; unknown names are left out."""
        if self.single is not None:
            return {self.single[0]: self.single[1]}
        known = set(self.names())
        out = {}
        for name in names or []:
            if name in known and name not in out:
                out[name] = self._store(name)
        return out

    def _store(self, name: str) -> RunStore:
        with self._lock:
            if name not in self._open:
                store = RunStore(max_events_per_kind=self.max_events_per_kind)
                poller = DirPoller(self.folder / name, store, self.interval)
                poller.reader.poll()
                poller.start()
                self._open[name] = (store, poller)
            return self._open[name][0]

    def stop(self) -> None:
        with self._lock:
            for _, poller in self._open.values():
                poller.stop()
