"""Kill the learner mid-run (SIGKILL) twice, once with a torn write at the WAL's tail, and resume it
each time with ``--resume``: nothing acknowledged is lost, nothing is trained twice, step numbers
continue without repeats."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.rundir.layout import list_checkpoints
from asyncrl.rundir.record_file import encode_record
from asyncrl.types import Episode, Trajectory
from asyncrl.wire.codec import encode_episode
from tests.conftest import SMALL_RUN as COMMON
from tests.conftest import ResumableRun, checkpoint_buffer_ids, effective_training, read_jsonl
from tests.support.ledger_checks import ledger_duplicates

pytestmark = pytest.mark.slow


def _torn_write(run_dir) -> tuple[str, int]:
    """Append the first half of a valid record (a write the crash cut short, never acknowledged) to
    the newest WAL segment; returns its episode id and the bytes appended."""
    t = Trajectory(
        token_ids=np.arange(8),
        loss_mask=[0] * 4 + [1] * 4,
        behavior_logprobs=[0.0] * 8,
        policy_version=0,
        reward=0.0,
        group_id="torn",
    )
    record = encode_record(encode_episode(Episode(trajectories=[t], id="torn-write")))
    wal = sorted((run_dir / "buffer").glob("wal-*.bin"))[-1]
    with open(wal, "ab") as f:
        f.write(record[: len(record) // 2])
    return "torn-write", len(record) // 2


def test_kill_twice_with_a_torn_tail_and_resume(tmp_path, tiny_overrides):
    total = 14
    overrides = [
        *tiny_overrides,
        *COMMON,
        f"train.total_steps={total}",
        "checkpoint.every=3",
        # no episode may be dropped as stale, so that every acknowledged one must be trained
        "buffer.max_staleness=1000",
        "buffer.capacity=12",
    ]
    acked: set[str] = set()
    with ResumableRun(tmp_path, "resume", overrides) as run:
        run.start_learner()
        run.start_actor()
        run.wait_version(4)  # past the step-3 checkpoint
        run.kill_learner()
        acked |= run.wal_ids()  # acknowledged since the oldest kept checkpoint
        torn_id, torn_bytes = _torn_write(run.dir)
        first_resume = max(int(p.name.split("_")[1]) for p in list_checkpoints(run.dir))

        run.resume()
        run.wait_version(first_resume + 4)  # appended after the resume, one checkpoint on
        run.kill_learner()
        acked |= run.wal_ids()
        assert torn_id not in acked, "the torn record was not cut off before appending"

        run.resume()
        run.finish()

    events = run.events()
    resumes = [e for e in events if e["kind"] == "resume"]
    assert [e["step"] for e in resumes][:1] == [first_resume] and len(resumes) == 2
    log2 = run.log(2)
    assert f"resumed from step {first_resume}" in log2
    cut = [e for e in events if e["kind"] == "wal_truncated"]
    assert len(cut) == 1 and cut[0]["bytes_cut"] == torn_bytes and "torn record" in cut[0]["reason"], cut
    assert cut[0]["file"] in log2  # printed too

    trained = effective_training(events)
    assert len(trained) == len(set(trained)), "an episode was trained twice in the surviving history"
    final_buffer = checkpoint_buffer_ids(list_checkpoints(run.dir)[-1])
    every_trained = {e["episode_id"] for e in events if e["kind"] == "episode"}
    acknowledged = acked | every_trained  # trained at some point implies acknowledged
    lost = (
        acknowledged - set(trained) - final_buffer - ledger_duplicates(run.dir)
    )  # (duplicates: acknowledged, recorded, not trained)
    assert len(acknowledged) >= 40, f"only {len(acknowledged)} episodes: too few to test anything"
    assert not lost, f"{len(lost)} of {len(acknowledged)} acknowledged episodes were lost"
    assert torn_id not in every_trained | final_buffer

    metrics = run.metrics()
    assert [m["step"] for m in metrics] == list(range(1, total + 1)), "step numbers repeated or missing"
    assert metrics[-1]["dropped_stale"] == 0
    # lines of rolled-back steps (trained after the checkpoint a resume started from) moved aside
    discarded = read_jsonl(run.dir / "metrics.discarded.jsonl")
    assert all(m["step"] > first_resume for m in discarded)
