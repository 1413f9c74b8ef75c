"""What the exactly-once tests share (issue 66): a small task file, and the check of a finished run's
task ledger against its episode archive (what each step of the surviving timeline trained)."""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.analysis.ledger import ledger_report, read_ledger
from asyncrl.learner.archive import archived_steps, read_step
from asyncrl.learner.ledger import parse_ticket
from asyncrl.rundir.layout import list_checkpoints

N_TASKS = 12


def task_files(tmp_path) -> tuple[str, str]:
    train, heldout = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    train.write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(N_TASKS))
    )
    heldout.write_text(
        "".join(json.dumps({"id": f"h{i}", "prompt": f"{i}+2=", "answer": i + 2}) + "\n" for i in range(4))
    )
    return str(train), str(heldout)


def check_exactly_once(run_dir: Path) -> None:
    """Every task of each closed epoch trained once or counted as used, by the ledger and by the archive;
    every task of an open epoch trained, used, not dealt yet, or in flight at the final checkpoint."""
    text, ok = ledger_report(run_dir)
    assert ok, text
    epochs, _ = read_ledger(run_dir)
    closed = [e for e in epochs.values() if e.closed]
    assert closed, text
    # the archive: what each step of the surviving timeline trained, slot by slot
    seen: dict[tuple[int, int], int] = {}
    for step in archived_steps(run_dir):
        for ep in read_step(run_dir, step)[0]:
            slot = parse_ticket(ep.ticket)
            assert slot is not None, f"step {step} trained episode {ep.id} of task {ep.task.id} without a dealt ticket"
            assert slot not in seen, f"slot {slot} (task {ep.task.id}) trained at steps {seen[slot]} and {step}"
            seen[slot] = step
    for e in closed:
        trained = {p for (epoch, p) in seen if epoch == e.epoch}
        assert trained | set(e.used) == set(range(N_TASKS)), (e.epoch, sorted(trained), dict(e.used), text)
        assert trained == set(e.trained), (e.epoch, text)
    # a task of an epoch still open is in flight at the end (the final checkpoint's ledger says where)
    state = json.loads((list_checkpoints(run_dir)[-1] / "ledger.json").read_text())
    in_flight = {tuple(o["slot"]) for o in state["out"].values()} | {tuple(s) for s in state["requeued"]}
    in_flight |= {tuple(int(x) for x in k.split(".")) for k in state["held"]}
    for e in epochs.values():
        if e.closed:
            continue
        undealt = set(range(state["pos"], N_TASKS)) if e.epoch == state["epoch"] else set()
        unaccounted = set(range(N_TASKS)) - set(e.trained) - set(e.used) - undealt
        assert unaccounted <= {p for (epoch, p) in in_flight if epoch == e.epoch}, (e.epoch, unaccounted, state)


def ledger_duplicates(run_dir: Path) -> set[str]:
    """Episode ids the task ledger acknowledged but did not train: a second delivery of a task whose
    slot already had one (a slow actor thought lost, a resend after a restart). "Nothing acknowledged
    is lost" means trained, buffered, dropped with a reason, or one of these."""
    path = Path(run_dir) / "ledger.jsonl"
    if not path.exists():
        return set()
    out = set()
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # (a live file's torn last line)
        if r.get("kind") == "duplicate":
            out.add(r["episode"])
    return out
