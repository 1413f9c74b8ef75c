"""Reading a run's task ledger (``<run>/ledger.jsonl``, written by ``asyncrl.learner.ledger``):
per epoch, how many of its tasks were trained once, how many were dropped and why, which were dealt
again, which are still open, and the exactly-once check (no slot trained twice, no slot both trained
and counted as used). ``asyncrl ledger RUN`` prints :func:`ledger_report`.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..rundir.layout import LEDGER


@dataclass
class EpochLedger:
    epoch: int
    size: int | None = None  # None: an endless stream
    trained: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))  # position -> steps
    used: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))  # position -> reasons
    requeued: Counter = field(default_factory=Counter)  # reason -> times a slot was dealt again
    duplicates: int = 0
    closed: bool = False
    task_ids: dict[int, str] = field(default_factory=dict)

    @property
    def twice(self) -> list[int]:
        """Positions trained more than once, or both trained and counted as used."""
        return sorted(
            p
            for p in set(self.trained) | set(self.used)
            if len(self.trained.get(p, ())) + len(self.used.get(p, ())) > 1
        )

    @property
    def resolved(self) -> int:
        return len(set(self.trained) | set(self.used))


def read_ledger(run_dir: Path) -> tuple[dict[int, EpochLedger], list[dict]]:
    """The epochs of a run's ledger, and its resume records."""
    path = Path(run_dir) / LEDGER
    if not path.exists():
        raise FileNotFoundError(f"{path}: no task ledger (a run with tasks.ledger=true writes it)")
    epochs: dict[int, EpochLedger] = {}
    resumes = []

    def ep(e: int) -> EpochLedger:
        return epochs.setdefault(e, EpochLedger(e))

    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            kind = r.get("kind")
            if kind == "epoch":
                ep(r["epoch"]).size = r["size"]
            elif kind == "epoch_done":
                ep(r["epoch"]).closed = True
            elif kind == "trained":
                for e, p, task_id, *_ in r["slots"]:
                    ep(e).trained[p].append(r["step"])
                    ep(e).task_ids[p] = task_id
            elif kind == "dropped":
                e, p, task_id = r["slot"]
                ep(e).task_ids[p] = task_id
                if r.get("requeued"):
                    ep(e).requeued[r["reason"]] += 1
                else:
                    ep(e).used[p].append(r["reason"])
            elif kind == "duplicate":
                ep(r["slot"][0]).duplicates += 1
            elif kind == "resume":
                resumes.append(r)
    return epochs, resumes


def ledger_rows(run_dir: Path) -> tuple[list[dict], list[dict], bool]:
    """Per epoch: ``epoch``, ``tasks``, ``trained``, ``used``, ``open``, ``twice``, ``dealt again``
    (by reason), ``duplicates``, ``dropped as used`` (by reason), ``closed``; the resume records;
    whether the exactly-once check holds."""
    epochs, resumes = read_ledger(run_dir)
    rows = []
    for e in sorted(epochs):
        x = epochs[e]
        used = Counter(r for rs in x.used.values() for r in rs)
        rows.append(
            {
                "epoch": e,
                "tasks": "-" if x.size is None else x.size,
                "trained": len(x.trained),
                "used": sum(len(v) for v in x.used.values()),
                "open": "-" if x.size is None else x.size - x.resolved,
                "twice": len(x.twice),
                "dealt again": ", ".join(f"{k} {v}" for k, v in sorted(x.requeued.items())) or "0",
                "duplicates": x.duplicates,
                "dropped as used": ", ".join(f"{k} {v}" for k, v in sorted(used.items())) or "-",
                "closed": x.closed,
                "trained twice": [x.task_ids.get(p, p) for p in x.twice[:10]],
            }
        )
    return rows, resumes, not any(r["twice"] for r in rows)


def ledger_report(run_dir: Path) -> tuple[str, bool]:
    """The ledger as a table, and whether the exactly-once check holds."""
    rows, resumes, ok = ledger_rows(run_dir)
    lines = [
        f"task ledger of {run_dir} ({len(resumes)} resume(s), "
        f"{sum(r.get('rolled_back', 0) for r in resumes)} records rolled back with lost steps)"
    ]
    lines.append(
        f"{'epoch':>5} {'tasks':>6} {'trained':>8} {'used':>5} {'open':>5} {'twice':>6} {'dealt again':>12} "
        f"{'duplicates':>10}  dropped as used"
    )
    for r in rows:
        lines.append(
            f"{r['epoch']:>5} {r['tasks']!s:>6} {r['trained']:>8} {r['used']:>5} {r['open']!s:>5} "
            f"{r['twice']:>6} {r['dealt again']:>12} {r['duplicates']:>10}  {r['dropped as used']}"
            + ("  (closed)" if r["closed"] else "")
        )
        if r["twice"]:
            lines.append(f"      trained twice: {r['trained twice']}")
    lines.append(
        "exactly once: every task trained at most once per epoch"
        if ok
        else "exactly once: VIOLATED (tasks trained twice above)"
    )
    return "\n".join(lines), ok
