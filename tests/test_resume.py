"""Kill the learner mid-run and resume it: nothing acknowledged is lost, nothing is trained twice."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from asyncrl.learner.buffer import read_frame_records
from asyncrl.wire.codec import decode, decode_episode

from .conftest import cli, read_jsonl, subprocess_env, wait_for_file
from .test_pipeline import COMMON, _start, _stop

pytestmark = pytest.mark.slow


def _wal_ids(run_dir) -> set[str]:
    ids = set()
    for wal in (run_dir / "buffer").glob("wal-*.bin"):
        for frames in read_frame_records(wal):
            ids.add(decode_episode(decode(frames)).id)
    return ids


def _trained(events) -> list[tuple[int, str]]:
    return [(e["step"], e["episode_id"]) for e in events if e["kind"] == "episode"]


def test_kill_and_resume(tmp_path, tiny_overrides):
    total = 12
    overrides = [*tiny_overrides, *COMMON, f"run_root={tmp_path}", "name=resume",
                 f"train.total_steps={total}", "checkpoint.every=3", "buffer.max_staleness=2"]
    run_dir = tmp_path / "resume"
    learner = _start(["learn", *overrides], tmp_path / "learner1.log")
    procs = [learner]
    try:
        addrs = wait_for_file(run_dir / "addresses.json", learner)
        actor = _start(["serve", *overrides, "--connect", addrs["control"]], tmp_path / "actor.log")
        procs.append(actor)
        t0 = time.time()
        while time.time() - t0 < 180:  # kill between checkpoints, once step 4 is trained
            m = read_jsonl(run_dir / "metrics.jsonl")
            if m and m[-1]["version"] >= 4:
                break
            time.sleep(0.05)
        learner.send_signal(signal.SIGKILL)
        learner.wait(timeout=10)
        before = read_jsonl(run_dir / "events.jsonl")
        acked_before_kill = _wal_ids(run_dir)  # everything the learner acknowledged since its last checkpoint
        ckpt_version = max(e["step"] for e in before if e["kind"] == "checkpoint")
        trained_before_ckpt = {eid for step, eid in _trained(before) if step <= ckpt_version}
        time.sleep(1.5)  # the actor keeps generating into the void meanwhile
        learner2 = _start(["learn", *overrides], tmp_path / "learner2.log")
        procs.append(learner2)
        learner2.wait(timeout=240)
        assert learner2.returncode == 0, (tmp_path / "learner2.log").read_text()[-3000:]
        actor.wait(timeout=30)
    finally:
        _stop(procs)

    events = read_jsonl(run_dir / "events.jsonl")
    resume = [e for e in events if e["kind"] == "resume"]
    assert resume and resume[0]["step"] == ckpt_version
    after = events[events.index(resume[0]):]
    trained_after = [eid for _, eid in _trained(after)]
    assert len(trained_after) == len(set(trained_after)), "an episode was trained twice after resume"
    assert not (set(trained_after) & trained_before_ckpt), "an episode in the checkpoint was trained again"
    final_buffer = {decode_episode(decode(f)).id for f in read_frame_records(
        sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "buffer.bin")}
    lost = acked_before_kill - trained_before_ckpt - set(trained_after) - final_buffer
    assert not lost, f"{len(lost)} acknowledged episodes were lost"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert metrics[-1]["version"] == total
