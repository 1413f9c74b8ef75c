"""Fault injection for durability (issue 19 items 1, 3, 4, 5; issue 11 item 2): torn, garbage and
zero-filled WAL tails; failed writes; damaged checkpoints; a second learner; reused run names;
explicit resume. Each case that involves acknowledged episodes counts their ids."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
import torch

from asyncrl.config import load_config
from asyncrl.learner.checkpoint import save_checkpoint
from asyncrl.learner.ingest.buffer import EpisodeQueue
from asyncrl.rundir.claim import RunDirError, plan_start
from asyncrl.rundir.layout import MANIFEST, list_checkpoints, select_checkpoint, verify_checkpoint
from asyncrl.rundir.record_file import RecordError, RecordScan, encode_record, read_frame_records, scan_records
from asyncrl.types import Episode, Trajectory
from asyncrl.wire.codec import decode, decode_episode, encode_episode
from tests.conftest import (
    ROOT,
    ResumableRun,
    checkpoint_buffer_ids,
    effective_training,
    read_jsonl,
    run_cli,
    subprocess_env,
    wal_ids,
)
from tests.conftest import SMALL_RUN as COMMON
from tests.support.factories import episode, trajectory


def _episode(eid: str, version: int = 0, n: int = 6) -> Episode:
    return episode(eid, trajectory(n, prompt=2, version=version, logprob=0.0, group_id=eid))


def _write_wal(directory, ids, segment: int = 0) -> EpisodeQueue:
    buf = EpisodeQueue(directory, capacity=10_000)
    buf.open_wal(segment)
    for eid in ids:
        ep = _episode(eid)
        assert buf.add(ep, encode_episode(ep))
    buf.sync()
    buf.close()
    return buf


def _restored_ids(directory) -> tuple[set[str], list[RecordScan]]:
    buf = EpisodeQueue(directory, capacity=10_000)
    report = buf.restore(None, set())
    return set(buf.episodes), report.truncated


def _resume_append_crash_resume(directory, kept: set[str], tag: str) -> None:
    """After a first restore: append acknowledged episodes, crash mid-write (half a record at the
    tail), restore again: everything acknowledged is there, the half record is not."""
    buf = EpisodeQueue(directory, capacity=10_000)
    buf.restore(None, set())
    buf.open_wal(0)
    after = {f"{tag}-after-{i}" for i in range(3)}
    for eid in sorted(after):
        ep = _episode(eid)
        buf.add(ep, encode_episode(ep))
    buf.sync()
    buf.close()
    torn = encode_record(encode_episode(_episode(f"{tag}-torn")))
    with open(directory / "wal-00000000.bin", "ab") as f:
        f.write(torn[: len(torn) // 2])
    ids, cut = _restored_ids(directory)
    assert ids == kept | after, f"{tag}: lost {sorted(kept | after - ids)}"
    assert len(cut) == 1 and cut[0].bytes_cut == len(torn) // 2


# -- WAL records -----------------------------------------------------------------------------------
def test_torn_tail_at_every_byte_of_the_last_record(tmp_path):
    src = tmp_path / "src"
    _write_wal(src, ["a", "b", "c"])
    wal = src / "wal-00000000.bin"
    data = wal.read_bytes()
    last_start = len(data) - len(encode_record(encode_episode(_episode("c"))))
    for cut_at in range(last_start + 1, len(data)):  # every torn length of the last record
        d = tmp_path / f"cut{cut_at}"
        d.mkdir()
        (d / wal.name).write_bytes(data[:cut_at])
        ids, cut = _restored_ids(d)
        assert ids == {"a", "b"}, cut_at
        assert [(c.good_bytes, c.bytes_cut) for c in cut] == [(last_start, cut_at - last_start)]
        assert (d / wal.name).stat().st_size == last_start  # cut back before anything is appended
        _resume_append_crash_resume(d, {"a", "b"}, f"cut{cut_at}")
        shutil.rmtree(d)


@pytest.mark.parametrize("tail", ["random", "huge_length", "magic_then_garbage", "zeros", "zero_page"])
def test_garbage_and_zero_tails_are_cut_without_huge_allocations(tmp_path, tail):
    ids = [f"e{i}" for i in range(5)]
    _write_wal(tmp_path, ids)
    rng = random.Random(tail)
    junk = {
        "random": bytes(rng.randrange(256) for _ in range(300)),
        "huge_length": b"ARW1" + b"\xff" * 8 + bytes(40),
        "magic_then_garbage": b"ARW1"
        + (200).to_bytes(4, "little")
        + b"\x00" * 4
        + bytes(rng.randrange(256) for _ in range(200)),
        "zeros": bytes(25),
        "zero_page": bytes(4096),
    }[tail]
    wal = tmp_path / "wal-00000000.bin"
    good = wal.stat().st_size
    with open(wal, "ab") as f:
        f.write(junk)
    assert len(list(read_frame_records(wal, strict=False))) == 5  # no empty records from zeros
    tracemalloc.start()
    got, cut = _restored_ids(tmp_path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, f"restoring a {good}-byte WAL allocated {peak} bytes"
    assert got == set(ids)
    assert [(c.good_bytes, c.bytes_cut) for c in cut] == [(good, len(junk))], cut
    _resume_append_crash_resume(tmp_path, set(ids), tail)


def test_a_damaged_byte_stops_reading_at_that_record(tmp_path):
    _write_wal(tmp_path, ["a", "b", "c"])
    wal = tmp_path / "wal-00000000.bin"
    data = bytearray(wal.read_bytes())
    second = len(encode_record(encode_episode(_episode("a"))))
    data[second + 20] ^= 0x01  # one flipped bit in b's payload
    wal.write_bytes(bytes(data))
    scan = RecordScan(wal)
    assert len(list(scan_records(wal, scan))) == 1
    assert scan.good_bytes == second and "checksum" in scan.problem
    with pytest.raises(RecordError, match=f"{wal}.*checksum.*at byte {second}"):
        list(read_frame_records(wal))  # a checkpoint file is read strictly


@pytest.mark.parametrize("where", ["payload", "header", "length"])
def test_one_damaged_byte_in_the_middle_loses_only_its_record(tmp_path, where):
    """25.4: a flipped byte in the middle of a WAL cut everything after it (127 of 254 intact
    episodes gone). Reading resynchronises on the next valid record: only the damaged record is
    lost, its bytes are quarantined and reported, and the segment is rewritten without them."""
    ids = [f"e{i:03d}" for i in range(254)]
    _write_wal(tmp_path, ids)
    wal = tmp_path / "wal-00000000.bin"
    size = len(encode_record(encode_episode(_episode("e000"))))  # every record here has this size
    data = bytearray(wal.read_bytes())
    middle = 127 * size
    data[middle + {"payload": 40, "header": 1, "length": 5}[where]] ^= 0x10
    wal.write_bytes(bytes(data))
    buf = EpisodeQueue(tmp_path, capacity=10_000)
    report = buf.restore(None, set())
    assert set(buf.episodes) == set(ids) - {"e127"}  # every other record is recovered
    assert report.recovered == 253 and not report.truncated
    (scan,) = report.damaged
    (d,) = scan.damaged
    assert (d.start, d.end, d.records) == (middle, middle + size, 1), d
    assert d.quarantine.read_bytes() == bytes(data[middle : middle + size])
    assert wal.stat().st_size == 253 * size  # rewritten without the damaged bytes
    buf2 = EpisodeQueue(tmp_path, capacity=10_000)
    report2 = buf2.restore(None, set())
    assert set(buf2.episodes) == set(ids) - {"e127"} and not report2.damaged and not report2.truncated
    _resume_append_crash_resume(tmp_path, set(ids) - {"e127"}, where)


def test_restored_records_are_checked_as_on_receipt_and_quarantined(tmp_path):
    """25.5: a record written straight into the WAL (valid checksum, token id 10**6) was restored
    and crashed every resume at the step that took it. It now fails the receipt checks on restore,
    is quarantined and reported, and the rest are restored."""
    from asyncrl.config import load_config as _load
    from asyncrl.learner.ingest.peers import EpisodeValidator
    from asyncrl.learner.ingest.server import Arrival, Limits

    _write_wal(tmp_path, ["a", "b"])
    evil = _episode("evil")
    evil.trajectories[0].token_ids = np.array([1, 2, 10**6, 3, 4, 5])
    with open(tmp_path / "wal-00000000.bin", "ab") as f:
        f.write(encode_record(encode_episode(evil)))
    _write_wal(tmp_path, ["c"], segment=1)
    validator = EpisodeValidator(100, Limits.from_config(_load(None, []).wire, 64))
    buf = EpisodeQueue(tmp_path, capacity=10_000)
    report = buf.restore(None, set(), validate=lambda ep, msg: validator.check(Arrival(ep, [], msg.arrays), 0))
    assert set(buf.episodes) == {"a", "b", "c"}
    assert [(eid, reason.split(":")[0]) for _, eid, reason in report.invalid] == [("evil", "token_range")]
    assert "evil" in buf.seen  # (acknowledged once: never taken again)
    kept = [decode_episode(decode(r)).id for r in read_frame_records(tmp_path / "quarantine" / "invalid-records.bin")]
    assert kept == ["evil"]
    assert [decode_episode(decode(r)).id for r in read_frame_records(tmp_path / "wal-00000000.bin")] == ["a", "b"]


@pytest.mark.slow
def test_a_resume_with_a_poisoned_wal_record_trains_on(tmp_path, tiny_overrides):
    """25.5 end to end: a resume that restores a record with an impossible token id reports and
    quarantines it, and trains to the end instead of crashing at the step that took it."""
    overrides = [
        *tiny_overrides,
        *COMMON,
        f"run_root={tmp_path}",
        "name=poison",
        "checkpoint.every=2",
        "buffer.max_staleness=1000",
    ]
    res = _cli("run", *overrides, "train.total_steps=2")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    evil = _episode("evil", n=6)
    evil.trajectories[0].token_ids = np.array([1, 2, 10**6, 3, 4, 5])
    wal = sorted((tmp_path / "poison" / "buffer").glob("wal-*.bin"))[-1]
    with open(wal, "ab") as f:
        f.write(encode_record(encode_episode(evil)))
    res = _cli("run", *overrides, "train.total_steps=5", "--resume")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "episode evil fails the receipt checks (token_range" in res.stdout
    events = read_jsonl(tmp_path / "poison" / "events.jsonl")
    assert [e["episode_id"] for e in events if e["kind"] == "wal_quarantined"] == ["evil"]
    assert "evil" not in {e.get("episode_id") for e in events if e["kind"] == "episode"}
    assert [m["step"] for m in read_jsonl(tmp_path / "poison" / "metrics.jsonl")][-1] == 5


def test_a_wal_of_the_old_format_is_refused_by_name(tmp_path):
    ep = _episode("old")
    frames = [bytes(memoryview(f.buffer if hasattr(f, "buffer") else f).cast("B")) for f in encode_episode(ep)]
    old = len(frames).to_bytes(4, "little") + b"".join(len(f).to_bytes(8, "little") + f for f in frames)
    (tmp_path / "wal-00000000.bin").write_bytes(old)
    with pytest.raises(RecordError, match="wal-00000000.bin: written by an older asyncrl"):
        EpisodeQueue(tmp_path, 100).restore(None, set())
    assert (tmp_path / "wal-00000000.bin").read_bytes() == old  # nothing cut


_FULL_DISK_WAL = """
import json, resource, signal, sys
from pathlib import Path
import numpy as np
from asyncrl.learner.ingest.buffer import EpisodeQueue
from asyncrl.types import Episode, Trajectory
from asyncrl.wire.codec import encode_episode
def _episode(eid, n):
    return Episode(id=eid, trajectories=[Trajectory(token_ids=np.arange(n), loss_mask=[1] * n,
                                                    behavior_logprobs=[0.0] * n, policy_version=0)])
buf = EpisodeQueue(Path(sys.argv[1]), 10_000)
buf.open_wal(0)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
acked = []
for i in range(10_000):
    ep = _episode(f"e{i}", n=50)
    try:
        buf.add(ep, encode_episode(ep))
        buf.sync()
    except OSError as e:
        print(json.dumps({"acked": acked, "errno": e.errno}))
        break
    acked.append(ep.id)
"""


def test_a_write_that_fails_part_way_is_cut_back(tmp_path):
    """A real failed write (the file-size limit, as a full disk would): the WAL still ends on a
    whole record, holds exactly the episodes acknowledged, and takes appends after a restore."""
    one = Episode(
        id="e5",
        trajectories=[
            Trajectory(token_ids=np.arange(50), loss_mask=[1] * 50, behavior_logprobs=[0.0] * 50, policy_version=0)
        ],
    )
    size = len(encode_record(encode_episode(one)))  # (what the script's episodes e0..e9 take each)
    limit = 4 * size + size // 2  # mid-record: the write that fails has written part of its record
    res = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_WAL, str(tmp_path), str(limit)],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    wal = tmp_path / "wal-00000000.bin"
    scan = RecordScan(wal)
    ids = [decode_episode(decode(f)).id for f in scan_records(wal, scan)]
    assert scan.problem is None and scan.size < limit
    assert ids == out["acked"] and len(ids) >= 2
    _resume_append_crash_resume(tmp_path, set(ids), "efbig")


# -- checkpoints -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy(tiny_overrides):
    from asyncrl.models.loading import load_policy

    cfg = load_config(None, tiny_overrides)
    model, tokenizer, _ = load_policy(cfg.model, cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(8).unsqueeze(0)).logits.mean().backward()
    opt.step()  # a real optimizer state (exp_avg, exp_avg_sq per parameter)
    return model, tokenizer, opt


def _two_checkpoints(run_dir, policy) -> EpisodeQueue:
    model, tokenizer, opt = policy
    buf = EpisodeQueue(run_dir / "buffer", 1000)
    buf.open_wal(0)
    for step in (2, 4):
        for i in range(6):
            ep = _episode(f"s{step}-{i}", version=step)
            buf.add(ep, encode_episode(ep))
        save_checkpoint(run_dir, step, model, tokenizer, opt, buf, {}, keep=2)
    return buf


@pytest.mark.parametrize("victim", ["model/model.safetensors", "optimizer.pt", "state.json", "buffer.bin", MANIFEST])
def test_a_truncated_checkpoint_file_is_named_and_the_older_one_chosen(tmp_path, policy, victim):
    _two_checkpoints(tmp_path, policy)
    newest = tmp_path / "checkpoints" / "step_00000004"
    assert verify_checkpoint(newest) is None
    f = newest / victim
    os.truncate(f, f.stat().st_size // 2)
    chosen, damaged = select_checkpoint(tmp_path)
    assert chosen == tmp_path / "checkpoints" / "step_00000002"
    assert len(damaged) == 1 and damaged[0][0] == newest and str(f) in damaged[0][1], damaged
    assert len(checkpoint_buffer_ids(chosen)) == 6  # the older checkpoint's buffer reads whole


def test_a_failed_checkpoint_write_leaves_no_temp_dir(tmp_path, policy, tiny_overrides):
    _two_checkpoints(tmp_path, policy)
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from pathlib import Path
        from asyncrl.config import load_config
        from asyncrl.learner.ingest.buffer import EpisodeQueue
        from asyncrl.learner.checkpoint import save_checkpoint
        from asyncrl.models.loading import load_policy
        cfg = load_config(None, {tiny_overrides!r})
        model, tok, _ = load_policy(cfg.model, cfg.seed)
        opt = torch.optim.AdamW(model.parameters())
        buf = EpisodeQueue(Path(sys.argv[1]) / "buffer", 100)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
        try:
            save_checkpoint(Path(sys.argv[1]), 6, model, tok, opt, buf, {{}}, keep=2)
        except Exception as e:
            print("raised", type(e).__name__)
    """)
    weights = (tmp_path / "checkpoints" / "step_00000004" / "model" / "model.safetensors").stat().st_size
    res = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), str(weights // 2)],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "raised" in res.stdout, res.stdout[-1000:] + res.stderr[-2000:]  # SafetensorError (EFBIG)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]
    assert verify_checkpoint(root / "step_00000004") is None


# -- start-up decisions (read-only) ----------------------------------------------------------------
def _cfg(tmp_path, *extra):
    return load_config(None, [f"run_root={tmp_path}", "name=r", *extra])


def test_a_run_dir_with_state_needs_resume_or_overwrite(tmp_path):
    assert plan_start(_cfg(tmp_path)).mode == "fresh"  # nothing there
    _write_wal(tmp_path / "r" / "buffer", ["a"])
    with pytest.raises(RunDirError, match="already holds a run.*--resume.*name=.*--overwrite"):
        plan_start(_cfg(tmp_path))
    plan = plan_start(_cfg(tmp_path, "checkpoint.resume=true"))  # a WAL, no step trained: resume at 0
    assert (plan.mode, plan.step, plan.checkpoint) == ("resume", 0, None)
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(RunDirError, match="no intact checkpoint.*2 step\\(s\\) trained"):
        plan_start(_cfg(tmp_path, "checkpoint.resume=true"))


# -- real processes --------------------------------------------------------------------------------
def _tree(run_dir) -> dict:
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*")}


def _cli(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=ROOT, timeout=timeout)


@pytest.mark.slow
def test_a_second_learner_is_refused_naming_the_first(tmp_path, tiny_overrides):
    overrides = [*tiny_overrides, *COMMON, "train.total_steps=50"]
    with ResumableRun(tmp_path, "one", overrides) as run:
        first = run.start_learner()
        addrs = run.addresses()
        before = _tree(run.dir)
        for command in (
            ["learn", *run.overrides, "--resume"],
            ["run", *run.overrides, "--resume"],
            ["learn", *run.overrides],
        ):
            res = _cli(*command, timeout=120)
            assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
            line = res.stderr.strip()
            assert "\n" not in line and f"in use by another learner (pid {first.pid})" in line, line
        assert first.poll() is None, "the first learner stopped"
        assert json.loads((run.dir / "addresses.json").read_text()) == addrs
        after = _tree(run.dir)
        assert {k: v for k, v in after.items() if k != "events.jsonl"} == {
            k: v for k, v in before.items() if k != "events.jsonl"
        }  # the first learner may log


@pytest.mark.slow
def test_a_reused_name_is_refused_with_nothing_written_and_overwrite_starts_fresh(tmp_path, tiny_overrides):
    overrides = [*tiny_overrides, *COMMON, f"run_root={tmp_path}", "name=reuse", "train.total_steps=3"]
    run_dir = tmp_path / "reuse"
    res = _cli("run", *overrides)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    old_ids = wal_ids(run_dir) | {
        e["episode_id"] for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "episode"
    }
    assert old_ids
    before = _tree(run_dir)
    for command in ("run", "learn"):
        res = _cli(command, *overrides, "train.lr=5e-4", timeout=120)
        assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
        line = res.stderr.strip()
        assert "\n" not in line and "already holds a run" in line
        assert "--resume" in line and "name=" in line and "--overwrite" in line
        assert _tree(run_dir) == before, f"asyncrl {command} wrote into the run dir before refusing"

    res = _cli("run", *overrides, "train.lr=5e-4", "--overwrite")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "--overwrite: removed" in res.stdout
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["kind"] for e in events].count("learner_start") == 1 and not any(e["kind"] == "resume" for e in events)
    trained = {e["episode_id"] for e in events if e["kind"] == "episode"}
    assert trained and not (trained & old_ids), "the fresh run trained the old run's episodes"
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert "lr: 0.0005" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
def test_resume_continues_steps_and_records_changed_config(tmp_path, tiny_overrides):
    overrides = [*tiny_overrides, *COMMON, f"run_root={tmp_path}", "name=cont", "checkpoint.every=2"]
    run_dir = tmp_path / "cont"
    res = _cli("run", *overrides, "train.total_steps=4")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    first_config = (run_dir / "config.yaml").read_text()
    res = _cli("run", *overrides, "train.total_steps=6", "train.lr=5e-4", "--resume")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "resumed from step 4" in res.stdout
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert (run_dir / "config.yaml").read_text() == first_config  # the first segment's snapshot
    assert "lr: 0.0005" in (run_dir / "config.resume-4.yaml").read_text()
    changed = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "config_changed"]
    assert len(changed) == 1 and {c["key"]: (c["old"], c["new"]) for c in changed[0]["changes"]} == {
        "train.lr": (0.001, 0.0005),
        "train.total_steps": (4, 6),
    }

    before = _tree(run_dir)
    res = _cli("run", *overrides, "train.total_steps=8", "model.embedded.hidden_size=64", "--resume", timeout=120)
    assert res.returncode == 2 and "model.embedded.hidden_size" in res.stderr, res.stderr[-2000:]
    assert _tree(run_dir) == before


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_keeping_the_wal(tmp_path, tiny_overrides):
    total = 9
    overrides = [
        *tiny_overrides,
        *COMMON,
        f"train.total_steps={total}",
        "checkpoint.every=2",
        "buffer.max_staleness=1000",
        "buffer.capacity=12",
    ]
    with ResumableRun(tmp_path, "dmg", overrides) as run:
        run.start_learner()
        run.start_actor()
        run.wait_version(5)  # checkpoints at steps 2 and 4
        run.kill_learner()
        older, newest = list_checkpoints(run.dir)[-2:]
        acked = run.wal_ids() | checkpoint_buffer_ids(older)  # the WAL is kept back to the older checkpoint
        victim = newest / "model" / "model.safetensors"
        os.truncate(victim, victim.stat().st_size // 2)
        run.resume()
        run.finish()
    events = run.events()
    damaged = [e for e in events if e["kind"] == "checkpoint_damaged"]
    assert len(damaged) == 1 and str(victim) in damaged[0]["problem"]
    assert str(victim) in run.log(2)
    resume = [e for e in events if e["kind"] == "resume"]
    assert len(resume) == 1 and resume[0]["checkpoint"] == str(older)
    trained = effective_training(events)
    assert len(trained) == len(set(trained))
    acknowledged = acked | {e["episode_id"] for e in events if e["kind"] == "episode"}
    lost = acknowledged - set(trained) - checkpoint_buffer_ids(list_checkpoints(run.dir)[-1])
    assert len(acknowledged) >= 20 and not lost, f"{len(lost)} of {len(acknowledged)} acknowledged episodes lost"
    assert [m["step"] for m in run.metrics()] == list(range(1, total + 1))


@pytest.mark.slow
def test_resume_without_a_checkpoint_after_trained_steps_is_refused(tmp_path, tiny_overrides):
    overrides = [*tiny_overrides, *COMMON, "train.total_steps=100"]
    with ResumableRun(tmp_path, "nock", overrides) as run:
        run.start_learner()  # checkpoint.every=0 (COMMON)
        run.start_actor()
        run.wait_version(2)
        run.kill_learner()
    before = _tree(run.dir)
    res = _cli("learn", *run.overrides, "--resume", timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "no intact checkpoint" in res.stderr and "--overwrite" in res.stderr
    assert _tree(run.dir) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs (a real full disk) needs root")
@pytest.mark.parametrize("fits", ["nothing", "weights"])  # the optimizer state (torch.save) is the one that fails
def test_a_full_disk_at_a_checkpoint_is_an_oserror_and_leaves_nothing(tmp_path, tiny_overrides, fits):
    """63.7: a checkpoint on a full disk (a real tmpfs, filled but ``free_kib``) raises an OSError (ENOSPC),
    whichever writer meets it (safetensors, torch.save: their own exception types before), which the
    learner turns into its one-line stop (``Learner._stop_on_write_error``); no partial checkpoint is left."""
    import errno

    import torch

    from asyncrl.config import load_config
    from asyncrl.learner.checkpoint import save_checkpoint
    from asyncrl.learner.ingest.buffer import EpisodeQueue
    from asyncrl.models.loading import load_policy

    cfg = load_config(None, tiny_overrides)
    model, tok, _ = load_policy(cfg.model, cfg.seed)
    opt = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()
    opt.step()  # (an optimizer state to save)
    probe = save_checkpoint(
        tmp_path / "probe", 2, model, tok, opt, EpisodeQueue(tmp_path / "probe" / "buffer", 100), {}, keep=2
    )
    model_bytes = sum(f.stat().st_size for f in (probe / "model").rglob("*") if f.is_file())
    assert (probe / "optimizer.pt").stat().st_size > 16 << 10
    free_kib = 8 if fits == "nothing" else model_bytes // 1024 + 16 + 4 * 4  # (tmpfs takes 4 KiB pages a file)
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        buf = EpisodeQueue(mnt / "run" / "buffer", 100)
        (mnt / "run" / "checkpoints").mkdir(parents=True)
        with open(mnt / "filler", "wb") as f:  # the disk full but free_kib
            f.write(b"\0" * (os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize - free_kib * 1024))
        with pytest.raises(OSError) as e:
            save_checkpoint(mnt / "run", 2, model, tok, opt, buf, {}, keep=2)
        assert e.value.errno == errno.ENOSPC, e.value
        assert list((mnt / "run" / "checkpoints").iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
