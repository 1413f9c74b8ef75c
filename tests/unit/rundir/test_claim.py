"""Start-up decisions on a run directory (asyncrl.rundir.claim.plan_start), read-only: fresh,
resume, or refused with the choices named."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.rundir.claim import RunDirError, plan_start
from tests.support.wal import write_wal


def _cfg(tmp_path, *extra):
    return load_config(None, [f"run_root={tmp_path}", "name=r", *extra])


def test_a_run_dir_with_state_needs_resume_or_overwrite(tmp_path):
    assert plan_start(_cfg(tmp_path)).mode == "fresh"  # nothing there
    write_wal(tmp_path / "r" / "buffer", ["a"])
    with pytest.raises(RunDirError, match="already holds a run.*--resume.*name=.*--overwrite"):
        plan_start(_cfg(tmp_path))
    plan = plan_start(_cfg(tmp_path, "checkpoint.resume=true"))  # a WAL, no step trained: resume at 0
    assert (plan.mode, plan.step, plan.checkpoint) == ("resume", 0, None)
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(RunDirError, match="no intact checkpoint.*2 step\\(s\\) trained"):
        plan_start(_cfg(tmp_path, "checkpoint.resume=true"))
