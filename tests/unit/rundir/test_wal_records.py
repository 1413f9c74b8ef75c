"""The write-ahead log's records (asyncrl.rundir.record_file, read and cut back by the buffer's
restore): torn, garbage and zero-filled tails, damaged bytes, records that fail the receipt checks,
the old format, and a write that fails part way (issue 19 items 1, 3; issue 25.5)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from asyncrl.learner.ingest.buffer import EpisodeQueue
from asyncrl.rundir.record_file import RecordError, RecordScan, encode_record, read_frame_records, scan_records
from asyncrl.types import Episode, Trajectory
from asyncrl.wire.codec import decode, decode_episode, encode_episode
from tests.conftest import ROOT, subprocess_env
from tests.support.wal import restored_ids, resume_append_crash_resume, wal_episode, write_wal


# -- WAL records -----------------------------------------------------------------------------------
def test_torn_tail_at_every_byte_of_the_last_record(tmp_path):
    src = tmp_path / "src"
    write_wal(src, ["a", "b", "c"])
    wal = src / "wal-00000000.bin"
    data = wal.read_bytes()
    last_start = len(data) - len(encode_record(encode_episode(wal_episode("c"))))
    for cut_at in range(last_start + 1, len(data)):  # every torn length of the last record
        d = tmp_path / f"cut{cut_at}"
        d.mkdir()
        (d / wal.name).write_bytes(data[:cut_at])
        ids, cut = restored_ids(d)
        assert ids == {"a", "b"}, cut_at
        assert [(c.good_bytes, c.bytes_cut) for c in cut] == [(last_start, cut_at - last_start)]
        assert (d / wal.name).stat().st_size == last_start  # cut back before anything is appended
        resume_append_crash_resume(d, {"a", "b"}, f"cut{cut_at}")
        shutil.rmtree(d)


@pytest.mark.parametrize("tail", ["random", "huge_length", "magic_then_garbage", "zeros", "zero_page"])
def test_garbage_and_zero_tails_are_cut_without_huge_allocations(tmp_path, tail):
    ids = [f"e{i}" for i in range(5)]
    write_wal(tmp_path, ids)
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
    got, cut = restored_ids(tmp_path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, f"restoring a {good}-byte WAL allocated {peak} bytes"
    assert got == set(ids)
    assert [(c.good_bytes, c.bytes_cut) for c in cut] == [(good, len(junk))], cut
    resume_append_crash_resume(tmp_path, set(ids), tail)


def test_a_damaged_byte_stops_reading_at_that_record(tmp_path):
    write_wal(tmp_path, ["a", "b", "c"])
    wal = tmp_path / "wal-00000000.bin"
    data = bytearray(wal.read_bytes())
    second = len(encode_record(encode_episode(wal_episode("a"))))
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
    write_wal(tmp_path, ids)
    wal = tmp_path / "wal-00000000.bin"
    size = len(encode_record(encode_episode(wal_episode("e000"))))  # every record here has this size
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
    resume_append_crash_resume(tmp_path, set(ids) - {"e127"}, where)


def test_restored_records_are_checked_as_on_receipt_and_quarantined(tmp_path):
    """25.5: a record written straight into the WAL (valid checksum, token id 10**6) was restored
    and crashed every resume at the step that took it. It now fails the receipt checks on restore,
    is quarantined and reported, and the rest are restored."""
    from asyncrl.config import load_config as _load
    from asyncrl.learner.ingest.peers import EpisodeValidator
    from asyncrl.learner.ingest.server import Arrival, Limits

    write_wal(tmp_path, ["a", "b"])
    evil = wal_episode("evil")
    evil.trajectories[0].token_ids = np.array([1, 2, 10**6, 3, 4, 5])
    with open(tmp_path / "wal-00000000.bin", "ab") as f:
        f.write(encode_record(encode_episode(evil)))
    write_wal(tmp_path, ["c"], segment=1)
    validator = EpisodeValidator(100, Limits.from_config(_load(None, []).wire, 64))
    buf = EpisodeQueue(tmp_path, capacity=10_000)
    report = buf.restore(None, set(), validate=lambda ep, msg: validator.check(Arrival(ep, [], msg.arrays), 0))
    assert set(buf.episodes) == {"a", "b", "c"}
    assert [(eid, reason.split(":")[0]) for _, eid, reason in report.invalid] == [("evil", "token_range")]
    assert "evil" in buf.seen  # (acknowledged once: never taken again)
    kept = [decode_episode(decode(r)).id for r in read_frame_records(tmp_path / "quarantine" / "invalid-records.bin")]
    assert kept == ["evil"]
    assert [decode_episode(decode(r)).id for r in read_frame_records(tmp_path / "wal-00000000.bin")] == ["a", "b"]


def test_a_wal_of_the_old_format_is_refused_by_name(tmp_path):
    ep = wal_episode("old")
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
def wal_episode(eid, n):
    return Episode(id=eid, trajectories=[Trajectory(token_ids=np.arange(n), loss_mask=[1] * n,
                                                    behavior_logprobs=[0.0] * n, policy_version=0)])
buf = EpisodeQueue(Path(sys.argv[1]), 10_000)
buf.open_wal(0)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
acked = []
for i in range(10_000):
    ep = wal_episode(f"e{i}", n=50)
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
    resume_append_crash_resume(tmp_path, set(ids), "efbig")
