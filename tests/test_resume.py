"""Kill the learner mid-run (SIGKILL) twice, once with a torn write at the WAL's tail, and resume it
each time with ``--resume``: nothing acknowledged is lost, nothing is trained twice, step numbers
continue without repeats."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from asyncrl.learner.buffer import encode_record, read_frame_records
from asyncrl.learner.checkpoint import list_checkpoints
from asyncrl.types import Episode, Trajectory
from asyncrl.wire.codec import decode, decode_episode, encode_episode

from .conftest import read_jsonl, wait_for_file
from .test_pipeline import COMMON, _start, _stop

pytestmark = pytest.mark.slow


def _wal_ids(run_dir) -> set[str]:
    """Episode ids in every WAL segment (a killed learner's last record may be torn: stop there)."""
    ids = set()
    for wal in (run_dir / "buffer").glob("wal-*.bin"):
        for frames in read_frame_records(wal, strict=False):
            ids.add(decode_episode(decode(frames)).id)
    return ids


def _buffer_ids(ckpt) -> set[str]:
    return {decode_episode(decode(f)).id for f in read_frame_records(ckpt / "buffer.bin")}


def effective_training(events) -> list[str]:
    """Episode ids trained in the run's surviving history: each learner life's steps up to the
    checkpoint the next life resumed from (later steps were rolled back), then the last life's."""
    lives, current = [], []
    for e in events:
        if e["kind"] == "resume":
            lives.append((current, e["step"]))
            current = []
        elif e["kind"] == "episode":
            current.append((e["step"], e["episode_id"]))
    lives.append((current, None))
    return [eid for trained, upto in lives for step, eid in trained if upto is None or step <= upto]


def _wait_version(run_dir, proc, version: int, timeout: float = 240) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        m = read_jsonl(run_dir / "metrics.jsonl")
        if m and m[-1]["version"] >= version:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the learner exited ({proc.returncode}) before step {version}")
        time.sleep(0.05)
    raise AssertionError(f"no step {version} after {timeout:.0f} s")


def _torn_write(run_dir) -> tuple[str, int]:
    """Append the first half of a valid record (a write the crash cut short, never acknowledged) to
    the newest WAL segment; returns its episode id and the bytes appended."""
    t = Trajectory(token_ids=np.arange(8), loss_mask=[0] * 4 + [1] * 4, behavior_logprobs=[0.0] * 8,
                   policy_version=0, reward=0.0, group_id="torn")
    record = encode_record(encode_episode(Episode(trajectories=[t], id="torn-write")))
    wal = sorted((run_dir / "buffer").glob("wal-*.bin"))[-1]
    with open(wal, "ab") as f:
        f.write(record[: len(record) // 2])
    return "torn-write", len(record) // 2


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def test_kill_twice_with_a_torn_tail_and_resume(tmp_path, tiny_overrides):
    total = 14
    overrides = [*tiny_overrides, *COMMON, f"run_root={tmp_path}", "name=resume",
                 f"train.total_steps={total}", "checkpoint.every=3",
                 # no episode may be dropped as stale, so that every acknowledged one must be trained
                 "buffer.max_staleness=1000", "buffer.capacity=12"]
    run_dir = tmp_path / "resume"
    learner = _start(["learn", *overrides], tmp_path / "learner1.log")
    procs = [learner]
    acked: set[str] = set()
    try:
        addrs = wait_for_file(run_dir / "addresses.json", learner)
        actor = _start(["serve", *overrides, "--connect", addrs["control"]], tmp_path / "actor.log")
        procs.append(actor)
        _wait_version(run_dir, learner, 4)  # past the step-3 checkpoint
        _kill(learner)
        acked |= _wal_ids(run_dir)  # acknowledged since the oldest kept checkpoint
        torn_id, torn_bytes = _torn_write(run_dir)
        first_resume = max(int(p.name.split("_")[1]) for p in list_checkpoints(run_dir))

        learner2 = _start(["learn", *overrides, "--resume"], tmp_path / "learner2.log")
        procs.append(learner2)
        _wait_version(run_dir, learner2, first_resume + 4)  # appended after the resume, one checkpoint on
        _kill(learner2)
        acked |= _wal_ids(run_dir)
        assert torn_id not in acked, "the torn record was not cut off before appending"

        learner3 = _start(["learn", *overrides, "--resume"], tmp_path / "learner3.log")
        procs.append(learner3)
        learner3.wait(timeout=300)
        assert learner3.returncode == 0, (tmp_path / "learner3.log").read_text()[-3000:]
        actor.wait(timeout=60)
    finally:
        _stop(procs)

    events = read_jsonl(run_dir / "events.jsonl")
    resumes = [e for e in events if e["kind"] == "resume"]
    assert [e["step"] for e in resumes][:1] == [first_resume] and len(resumes) == 2
    log2 = (tmp_path / "learner2.log").read_text()
    assert f"resumed from step {first_resume}" in log2
    cut = [e for e in events if e["kind"] == "wal_truncated"]
    assert len(cut) == 1 and cut[0]["bytes_cut"] == torn_bytes and "torn record" in cut[0]["reason"], cut
    assert cut[0]["file"] in log2  # printed too

    trained = effective_training(events)
    assert len(trained) == len(set(trained)), "an episode was trained twice in the surviving history"
    final_buffer = _buffer_ids(list_checkpoints(run_dir)[-1])
    every_trained = {e["episode_id"] for e in events if e["kind"] == "episode"}
    acknowledged = acked | every_trained  # trained at some point implies acknowledged
    lost = acknowledged - set(trained) - final_buffer
    assert len(acknowledged) >= 40, f"only {len(acknowledged)} episodes: too few to test anything"
    assert not lost, f"{len(lost)} of {len(acknowledged)} acknowledged episodes were lost"
    assert torn_id not in every_trained | final_buffer

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, total + 1)), "step numbers repeated or missing"
    assert metrics[-1]["dropped_stale"] == 0
    # lines of rolled-back steps (trained after the checkpoint a resume started from) moved aside
    discarded = read_jsonl(run_dir / "metrics.discarded.jsonl")
    assert all(m["step"] > first_resume for m in discarded)
