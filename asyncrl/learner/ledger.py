"""The task ledger: the learner deals every fresh training task and trains each task of an epoch
exactly once, across kills and resumes (``tasks.ledger``; docs/guide/guarantees.md).

A *slot* is one place in the training stream: ``(epoch, position)``. For a finite task list
(files, datasets, import paths) epoch ``e`` is the list in an order shuffled with the run's seed
and ``e``; the endless arithmetic stream is one epoch. The learner deals slots with credits
(``Credit.deal``: the task and a *ticket* ``"<epoch>.<position>.<deal>"``); the actor generates
only what it was dealt and sends each episode back with its ticket. A slot is then:

- *out*: dealt, its episode not here yet (one or more tickets: a slot dealt again keeps the old one);
- *held*: its first delivered episode is in the buffer (a later one for the slot is a duplicate:
  acknowledged, recorded, never trained);
- *resolved*: trained at a step, or dropped and counted as used.

A slot whose episode is refused (``rejected``), dropped by the staleness bound (``stale``) or by
dynamic sampling (``filtered``) is dealt again when ``tasks.requeue`` names the reason, else it is
resolved as used; ``withheld`` (experience replay's solved set) is used. A ticket whose actor is
gone (not in the actor table for ``wire.lease_s``), or that the actor's hello does not name as
still held (it restarted its queue), is dealt again: ``actor_lost``.

Durability: the state goes into every checkpoint (``ledger.json``), with the size of the
append-only record ``<run>/ledger.jsonl`` at that moment (fsynced first). A resume truncates the
record back to that size (the steps after the checkpoint were lost with it, and are trained again)
and says how many records it rolled back; then the WAL's episodes are taken in again. So the
record always describes the run's one surviving timeline, and ``asyncrl ledger RUN`` reads it.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import msgspec

from ..rundir.layout import LEDGER, fsync_path
from ..types import Episode, Task

REQUEUE_REASONS = ("stale", "rejected", "filtered")
_STATE_FILE = "ledger.json"
_SWEEP_EVERY_S = 1.0

Slot = tuple[int, int]


def parse_ticket(ticket: str) -> Slot | None:
    """``(epoch, position)`` of a ticket, or None when it is not one of a ledger's."""
    parts = ticket.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


class TaskLedger:
    """The learner's deal of fresh tasks and its record (module docstring). Used as a learner hook:
    it deals with the credits, records what each step trained, and saves itself in checkpoints."""

    needs_rows: ClassVar[bool] = False
    owned_stats: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        tasks: list[Task] | None,
        stream: Callable[[], Iterator[Task]] | None,
        seed: int,
        run_dir: Path,
        requeue: list[str],
        grace_s: float,
        event: Callable[..., None] | None = None,
    ):
        """``tasks``: the training list (None: the endless ``stream()``, one epoch)."""
        self.tasks, self._stream_factory, self.seed = tasks, stream, seed
        self.requeue, self.grace_s = set(requeue), grace_s
        self.event = event or (lambda *a, **k: None)
        self.path = Path(run_dir) / LEDGER
        self.size = len(tasks) if tasks is not None else None
        self.epoch, self.pos, self.deals = 0, 0, 0
        self.requeued: deque[Slot] = deque()  # dealt again before new slots
        self.out: dict[str, dict[str, Any]] = {}  # ticket -> {slot, identity, actor, since (monotonic)}
        self.held: dict[Slot, str] = {}  # slot -> the ticket of its episode in the buffer
        self.done: dict[int, set[int]] = {}  # resolved positions of epochs not yet closed, at or past low
        self.low: dict[int, int] = {}  # per open epoch: every position below it is resolved (keeps done small)
        self.closed: set[int] = set()  # epochs whose every slot is resolved
        self.stream_tasks: dict[int, Task] = {}  # endless stream: the task of each unresolved position
        self.counts: dict[str, int] = {}  # this process's counts by record kind and reason
        self.withheld: Callable[[], set[str]] = set  # experience replay's solved set (dealt as used)
        self._log_bytes = 0  # the record's size at the restored checkpoint
        self._log = None
        self._stream: Iterator[Task] | None = None
        self._stream_at = 0
        self._orders: dict[int, list[int]] = {}
        self._last_sweep = 0.0

    # -- what the slots hold --------------------------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.size))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 2}
            self._orders[epoch] = order
        return self._orders[epoch]

    def task_at(self, slot: Slot) -> Task:
        epoch, pos = slot
        if self.tasks is not None:
            return self.tasks[self._order(epoch)[pos]]
        if pos not in self.stream_tasks:
            if self._stream is None or self._stream_at > pos:
                self._stream, self._stream_at = self._stream_factory(), 0
            while self._stream_at < pos:
                next(self._stream)
                self._stream_at += 1
            self.stream_tasks[pos] = next(self._stream)
            self._stream_at += 1
        return self.stream_tasks[pos]

    def _next_slot(self) -> Slot:
        if self.requeued:
            return self.requeued.popleft()
        if self.size is not None and self.pos >= self.size:
            self.epoch, self.pos = self.epoch + 1, 0
        if self.pos == 0 and self.size is not None:
            self._record("epoch", epoch=self.epoch, size=self.size)
        slot = (self.epoch, self.pos)
        self.pos += 1
        return slot

    # -- dealing (the hook's credit_work) -------------------------------------------------------
    def credit_work(self, actor, n: int, version: int) -> dict[str, Any]:
        """Deal ``n`` slots to ``actor`` (an ``ActorState``): the credit message's ``deal``."""
        from ..wire.messages import Dealt

        identity = actor.identity.decode(errors="replace")
        withheld = self.withheld()
        taken = {o["slot"] for o in self.out.values()}  # (after a resume the cursor passes slots again)
        dealt = []
        for _ in range(100_000):
            if len(dealt) >= n:
                break
            slot = self._next_slot()
            if slot in self.held or slot in taken or self._resolved(slot):
                continue
            task = self.task_at(slot)
            if withheld and task.id in withheld:
                self._resolve(slot, version, "dropped", reason="withheld", requeued=False)
                continue
            self.deals += 1
            ticket = f"{slot[0]}.{slot[1]}.{self.deals}"
            self.out[ticket] = {"slot": slot, "identity": identity, "actor": actor.actor_id, "since": time.monotonic()}
            dealt.append(Dealt(task=task, ticket=ticket))
        return {"deal": dealt} if dealt else {}

    # -- what arrives and what is refused (``Peers``) -------------------------------------------
    def arrived(self, ep: Episode, version: int) -> bool:
        """An episode is in the buffer: False when its slot already has one (a duplicate: the
        caller takes it out of the buffer; it is recorded, never trained)."""
        slot = parse_ticket(ep.ticket) if ep.ticket else None
        if slot is None:
            return True  # (not dealt by a ledger: e.g. an experience-replay assignment)
        self.out.pop(ep.ticket, None)
        if slot in self.held or self._resolved(slot):
            task_id = ep.task.id if ep.task is not None else None  # (a resolved slot's task may be forgotten)
            self._record("duplicate", step=version, slot=[*slot, task_id], episode=ep.id, actor=ep.actor_id)
            return False
        self.held[slot] = ep.ticket
        return True

    def refused(self, ep: Episode, reason: str, version: int) -> None:
        """An episode the learner refused (not in the buffer): its slot is dealt again or used."""
        slot = parse_ticket(ep.ticket) if ep.ticket else None
        if slot is None or self.out.pop(ep.ticket, None) is None or slot in self.held or self._resolved(slot):
            return
        self._drop(slot, "rejected", version, detail=reason)

    def dropped(self, ep: Episode, reason: str, version: int) -> None:
        """The buffer dropped a held episode (``stale`` or ``filtered``)."""
        slot = parse_ticket(ep.ticket) if ep.ticket else None
        if slot is None or self.held.get(slot) != ep.ticket:
            return
        del self.held[slot]
        self._drop(slot, reason, version)

    def hello(self, actor_id: str, identity: bytes, holding: list[str], version: int) -> None:
        """An actor (re)joined: its tickets that it does not hold any more are dealt again."""
        ident = identity.decode(errors="replace")
        keep = set(holding)
        for ticket in [t for t, o in self.out.items() if o["identity"] == ident and t not in keep]:
            self._lost(ticket, version, f"{actor_id} no longer holds it (it said hello again)")
        for ticket in keep - set(self.out):  # dealt by a learner life whose record was lost with a kill
            slot = parse_ticket(ticket)
            if slot is not None and slot not in self.held and not self._resolved(slot):
                self.out[ticket] = {"slot": slot, "identity": ident, "actor": actor_id, "since": time.monotonic()}

    def sweep(self, live: set[bytes], version: int) -> None:
        """Tickets of actors absent from the table for ``grace_s`` are dealt again (at most once a second)."""
        now = time.monotonic()
        if now - self._last_sweep < _SWEEP_EVERY_S:
            return
        self._last_sweep = now
        names = {i.decode(errors="replace") for i in live}
        for ticket, o in list(self.out.items()):
            if o["identity"] in names:
                o["since"] = now
            elif now - o["since"] > self.grace_s:
                self._lost(ticket, version, f"{o['actor']} is gone")

    def _lost(self, ticket: str, version: int, why: str) -> None:
        o = self.out.pop(ticket)
        slot = tuple(o["slot"])
        if slot in self.held or self._resolved(slot) or any(tuple(x["slot"]) == slot for x in self.out.values()):
            return
        self._drop(slot, "actor_lost", version, detail=why, force_requeue=True)

    # -- training (the hook's after_step) --------------------------------------------------------
    def before_batch(self, episodes: list[Episode], version: int) -> None:
        pass

    def after_step(self, episodes: list[Episode], result, version: int) -> dict[str, float]:
        """The step ``version + 1`` trained ``episodes``: their slots are resolved."""
        trained = []
        for ep in episodes:
            slot = parse_ticket(ep.ticket) if ep.ticket else None
            if slot is None or self.held.get(slot) != ep.ticket:
                continue
            del self.held[slot]
            trained.append(self._slot_record(slot) + [ep.id])
            self._mark_done(slot)  # (after: an endless stream forgets a resolved position's task)
        if trained:
            self._record("trained", step=version + 1, slots=trained)
        return {
            "ledger/trained": float(len(trained)),
            "ledger/out": float(len(self.out)),
            "ledger/epoch": float(self.epoch),
            "ledger/requeued_total": float(sum(v for k, v in self.counts.items() if k.endswith(":requeued"))),
            "ledger/duplicates_total": float(self.counts.get("duplicate", 0)),
        }

    # -- resolution -----------------------------------------------------------------------------
    def _resolved(self, slot: Slot) -> bool:
        epoch, pos = slot
        return epoch in self.closed or pos < self.low.get(epoch, 0) or pos in self.done.get(epoch, ())

    def _drop(self, slot: Slot, reason: str, version: int, detail: str = "", force_requeue: bool = False) -> None:
        requeue = force_requeue or reason in self.requeue
        if requeue:
            self.requeued.append(slot)
            self._record(
                "dropped", step=version, slot=self._slot_record(slot), reason=reason, requeued=True, detail=detail
            )
        else:
            self._resolve(slot, version, "dropped", reason=reason, requeued=False, detail=detail)

    def _resolve(self, slot: Slot, version: int, kind: str, **fields) -> None:
        self._record(kind, step=version, slot=self._slot_record(slot), **fields)
        self._mark_done(slot)

    def _mark_done(self, slot: Slot) -> None:
        epoch, pos = slot
        done = self.done.setdefault(epoch, set())
        done.add(pos)
        low = self.low.get(epoch, 0)
        while low in done:  # (positions resolve about in order: the set holds only those past a gap)
            done.discard(low)
            low += 1
        self.low[epoch] = low
        if self.tasks is None:
            self.stream_tasks.pop(pos, None)
        elif low >= self.size:  # every slot of the epoch resolved: it is closed
            del self.done[epoch], self.low[epoch]
            self.closed.add(epoch)
            self._record("epoch_done", epoch=epoch)

    def _slot_record(self, slot: Slot) -> list:
        return [slot[0], slot[1], self.task_at(slot).id]

    # -- the record file ------------------------------------------------------------------------
    def open_log(self, version: int) -> None:
        """Open ``ledger.jsonl`` for appending, cut back to its size at the restored checkpoint (0 for a
        new run): records of steps that were lost with a kill are rolled back and said so."""
        rolled = 0
        if self.path.exists() and self.path.stat().st_size > self._log_bytes:
            with open(self.path, "rb") as f:
                f.seek(self._log_bytes)
                rolled = sum(1 for line in f if line.strip())
            os.truncate(self.path, self._log_bytes)
        self._log = open(self.path, "a", encoding="utf-8")
        fsync_path(self.path.parent)
        if version or rolled:
            self._record("resume", step=version, rolled_back=rolled)
            if rolled:
                self.event(
                    "ledger_rolled_back",
                    version,
                    records=rolled,
                    message=f"the task ledger rolled back {rolled} records written after the checkpoint of step "
                    f"{version}; their tasks are trained again",
                )

    def _record(self, kind: str, **fields) -> None:
        key = (
            kind
            if kind != "dropped"
            else f"dropped:{fields.get('reason')}:" + ("requeued" if fields.get("requeued") else "used")
        )
        self.counts[key] = self.counts.get(key, 0) + 1
        if self._log is not None:
            self._log.write(json.dumps({"kind": kind, "t": round(time.time(), 3), **fields}) + "\n")

    def close(self) -> None:
        if self._log is not None:
            self._log.flush()
            self._log.close()
            self._log = None

    # -- checkpoints (the hook's save / load) ----------------------------------------------------
    def save(self, directory: Path) -> None:
        """Flush and fsync the record, then write the state with the record's size."""
        size = 0
        if self._log is not None:
            self._log.flush()
            os.fsync(self._log.fileno())
            size = self._log.tell()
        state = {
            "epoch": self.epoch,
            "pos": self.pos,
            "deals": self.deals,
            "size": self.size,
            "requeued": [list(s) for s in self.requeued],
            "out": {
                t: {"slot": list(o["slot"]), "identity": o["identity"], "actor": o["actor"]}
                for t, o in self.out.items()
            },
            "held": {f"{s[0]}.{s[1]}": t for s, t in self.held.items()},
            "done": {str(e): sorted(p) for e, p in self.done.items()},
            "low": {str(e): n for e, n in self.low.items()},
            "closed": sorted(self.closed),
            "stream_tasks": {str(p): msgspec.to_builtins(t) for p, t in self.stream_tasks.items()},
            "log_bytes": size,
        }
        (Path(directory) / _STATE_FILE).write_text(json.dumps(state))

    def load(self, directory: Path, version: int) -> None:
        path = Path(directory) / _STATE_FILE
        if not path.exists():
            return
        state = json.loads(path.read_text())
        if state.get("size") != self.size:
            self.event(
                "warning",
                version,
                source="tasks.ledger",
                message=f"the checkpoint's task ledger is over {state.get('size')} tasks, the run now has "
                f"{self.size}: starting a new ledger",
            )
            self._log_bytes = int(state.get("log_bytes", 0))
            return
        now = time.monotonic()
        self.epoch, self.pos, self.deals = state["epoch"], state["pos"], state["deals"]
        self.requeued = deque(tuple(s) for s in state["requeued"])
        self.out = {t: {**o, "slot": tuple(o["slot"]), "since": now} for t, o in state["out"].items()}
        self.held = {tuple(int(x) for x in k.split(".")): t for k, t in state["held"].items()}
        self.done = {int(e): set(p) for e, p in state["done"].items()}
        self.low = {int(e): int(n) for e, n in state.get("low", {}).items()}
        self.closed = set(state.get("closed", []))
        self.stream_tasks = {int(p): msgspec.convert(t, Task) for p, t in state["stream_tasks"].items()}
        self._log_bytes = int(state["log_bytes"])

    def checkpoint_saved(self, path: Path, version: int) -> None:
        pass

    def recovered(self, buffer, version: int) -> int:
        """After a resume: the buffer's episodes (the checkpoint's and the WAL's) are held; those whose
        slot is held by another episode or resolved are duplicates, taken out. Returns how many."""
        dupes = []
        for eid, (ep, _) in list(buffer.episodes.items()):
            slot = parse_ticket(ep.ticket) if ep.ticket else None
            if slot is None or self.held.get(slot) == ep.ticket:
                continue
            if not self.arrived(ep, version):
                dupes.append(eid)
        for eid in dupes:
            buffer.discard(eid)
        return len(dupes)


def make_ledger(cfg, event) -> TaskLedger | None:
    """The learner's ledger when ``tasks.ledger`` is on."""
    if not cfg.tasks.ledger:
        return None
    from ..envs.tasks import split_tasks, task_stream

    train, _ = split_tasks(cfg.tasks)
    return TaskLedger(
        train,
        (lambda: task_stream(cfg.tasks, cfg.seed)) if train is None else None,
        cfg.seed,
        cfg.run_dir,
        cfg.tasks.requeue,
        grace_s=cfg.wire.lease_s,
        event=event,
    )
