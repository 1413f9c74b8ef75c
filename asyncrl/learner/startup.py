"""How a learner takes its run directory and picks up where the run left off.

:class:`Startup` claims the run directory (``asyncrl.rundir.claim``: refused before anything is written
if it is locked or holds a run that ``checkpoint.resume`` does not continue; ``--overwrite``
deletes the old run first), sets it up for the plan (damaged checkpoints moved aside, metrics of
rolled-back steps moved out, this segment's config snapshot), and later restores the model,
optimizer, hooks and buffer from the plan's checkpoint plus the write-ahead log. Findings are
printed at once and logged as events once the event log is open (``flush``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..rundir.claim import RunLock, StartPlan, discard_metrics_after, plan_start, prepare, write_snapshot
from ..rundir.layout import CheckpointError, clean_partial, quarantine_checkpoint, read_addresses
from .checkpoint import read_checkpoint, read_critic

_ANY_VERSION = 1 << 62


def _receipt_check(validator):
    """``validate(episode, message)`` for ``EpisodeQueue.restore``: the learner's receipt checks,
    without the future-version one (after a fallback to an older checkpoint, episodes of the
    versions it forgot are legitimate, as they were when acknowledged)."""
    from .ingest.server import Arrival

    return lambda ep, msg: validator.check(Arrival(ep, [], msg.arrays), _ANY_VERSION)


class Startup:
    def __init__(self, cfg, overwrite: bool):
        """Check (read-only), lock the run dir for this process's life, decide again under the
        lock, then set the directory up for the plan."""
        self.cfg, self.run_dir = cfg, cfg.run_dir
        self.notes: list[tuple[str, dict[str, Any]]] = []
        prepare(cfg, overwrite=overwrite)
        self.lock = RunLock(self.run_dir)
        self.lock.acquire()
        self.plan: StartPlan = plan_start(cfg)
        if self.plan.mode == "fresh" and cfg.checkpoint.resume:
            print(f"[learner] nothing to resume in {self.run_dir}: starting a fresh run", flush=True)
        for path, problem in self.plan.damaged:
            moved = quarantine_checkpoint(path)
            self.note(
                "checkpoint_damaged",
                f"checkpoint {path.name} is damaged: {problem}; moved to {moved.name}",
                path=str(path),
                problem=problem,
                moved_to=str(moved),
            )
        clean_partial(self.run_dir)
        self._set_up_segment()

    def _set_up_segment(self) -> None:
        plan = self.plan
        if plan.mode == "resume":
            discarded = discard_metrics_after(self.run_dir, plan.step)
            if discarded:
                self.note(
                    "metrics_discarded",
                    f"{discarded} metrics line(s) after step {plan.step} moved to metrics.discarded.jsonl",
                    count=discarded,
                    after_step=plan.step,
                )
        snapshot = write_snapshot(self.cfg, plan)
        if plan.changes:
            keys = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in plan.changes)
            self.note(
                "config_changed",
                f"config changed since {plan.previous_config.name}: {keys}",
                previous=plan.previous_config.name,
                snapshot=snapshot.name,
                changes=[{"key": k, "old": old, "new": new} for k, old, new in plan.changes],
            )

    def note(self, kind: str, line: str, **fields) -> None:
        """Print a start-up finding now; it is logged as an event by :meth:`flush`."""
        print(f"[learner] {line}", flush=True)
        self.notes.append((kind, fields))

    def previous_addresses(self) -> dict | None:
        """The addresses a resumed learner binds again (so that waiting actors reconnect)."""
        return read_addresses(self.run_dir) if self.plan.mode == "resume" else None

    def restore(self, model, load, hooks, buffer, validator=None, critic=None) -> tuple[int, dict, Any]:
        """Load the plan's checkpoint (if any): its states, checked against the one-process
        ``model``, go to ``load(model_state, optimizer_state)`` (``Ranks.load``: every learner
        rank's model and optimizer; with a ``critic``, its states too when the checkpoint has them), its files to ``hooks``; rebuild ``buffer`` from it and the WAL.
        Every restored record is checked as on receipt by ``validator`` (``EpisodeValidator``: what
        fails is quarantined, never trained). Returns ``(version, checkpoint state, restore report)``."""
        ckpt = self.plan.checkpoint
        state = {}
        if ckpt is not None:
            weights, optim_state, state = read_checkpoint(ckpt, model)
            extra = {}
            if critic is not None:
                extra["critic"] = read_critic(ckpt, critic)
                if extra["critic"] is None:
                    self.note(
                        "critic_fresh",
                        f"checkpoint {ckpt.name} has no critic (that run used none): the "
                        f"critic starts from its initial weights",
                        checkpoint=str(ckpt),
                    )
            try:
                load(weights, optim_state, **extra)
            except (RuntimeError, ValueError, KeyError) as e:
                raise CheckpointError(f"checkpoint {ckpt} cannot be loaded into the model: {str(e)[:300]}") from e
        version = int(state.get("version", self.plan.step))
        for hook in hooks if ckpt is not None else ():
            hook.load(ckpt, version)
        report = buffer.restore(
            ckpt / "buffer.bin" if ckpt is not None else None,
            set(state.get("seen", [])),
            validate=_receipt_check(validator) if validator is not None else None,
        )
        for scan in report.damaged:
            for d in scan.damaged[:-1] if scan.problem else scan.damaged:
                self.note(
                    "wal_damaged",
                    f"{scan.path}: {d.end - d.start} damaged byte(s) at offset {d.start} "
                    f"({d.problem}; {d.records} record(s) lost there), kept in {d.quarantine}; read on "
                    f"from the next valid record at {d.end}",
                    file=str(scan.path),
                    offset=d.start,
                    end=d.end,
                    records_lost=d.records,
                    reason=d.problem,
                    quarantine=str(d.quarantine),
                )
        for source, eid, reason in report.invalid:
            self.note(
                "wal_quarantined",
                f"{source}: episode {eid} fails the receipt checks ({reason}); not "
                f"trained, kept in {report.quarantine / 'invalid-records.bin'}",
                file=source,
                episode_id=eid,
                reason=reason,
            )
        for scan in report.truncated:
            self.note(
                "wal_truncated",
                f"{scan.path}: cut {scan.bytes_cut} byte(s) at offset {scan.good_bytes} after "
                f"{scan.records} good record(s): {scan.problem}",
                file=str(scan.path),
                offset=scan.good_bytes,
                bytes_cut=scan.bytes_cut,
                records_kept=scan.records,
                reason=scan.problem,
            )
        return version, state, report

    def flush(self, log, version: int, buffered: int, report) -> None:
        """Log the start-up findings and, for a resume, the ``resume`` event."""
        for kind, fields in self.notes:
            log.event(kind, version, **fields)
        if self.plan.mode != "resume":
            return
        ckpt: Path | None = self.plan.checkpoint
        where = f"checkpoint {ckpt}" if ckpt is not None else "no checkpoint (no step was trained)"
        print(
            f"[learner] resumed from step {version} ({where}; {buffered} episode(s) buffered, "
            f"{report.recovered} recovered from the WAL)",
            flush=True,
        )
        log.event(
            "resume",
            version,
            checkpoint=str(ckpt) if ckpt is not None else None,
            buffered=buffered,
            recovered_from_wal=report.recovered,
            undecodable_wal_records=report.undecodable,
        )
