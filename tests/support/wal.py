"""A write-ahead log of small episodes, for the tests of WAL records and of resumes."""

from __future__ import annotations

from asyncrl.learner.ingest.buffer import EpisodeQueue
from asyncrl.rundir.record_file import RecordScan, encode_record
from asyncrl.types import Episode
from asyncrl.wire.codec import encode_episode
from tests.support.factories import episode, trajectory


def wal_episode(eid: str, version: int = 0, n: int = 6) -> Episode:
    return episode(eid, trajectory(n, prompt=2, version=version, logprob=0.0, group_id=eid))


def write_wal(directory, ids, segment: int = 0) -> EpisodeQueue:
    buf = EpisodeQueue(directory, capacity=10_000)
    buf.open_wal(segment)
    for eid in ids:
        ep = wal_episode(eid)
        assert buf.add(ep, encode_episode(ep))
    buf.sync()
    buf.close()
    return buf


def restored_ids(directory) -> tuple[set[str], list[RecordScan]]:
    buf = EpisodeQueue(directory, capacity=10_000)
    report = buf.restore(None, set())
    return set(buf.episodes), report.truncated


def resume_append_crash_resume(directory, kept: set[str], tag: str) -> None:
    """After a first restore: append acknowledged episodes, crash mid-write (half a record at the
    tail), restore again: everything acknowledged is there, the half record is not."""
    buf = EpisodeQueue(directory, capacity=10_000)
    buf.restore(None, set())
    buf.open_wal(0)
    after = {f"{tag}-after-{i}" for i in range(3)}
    for eid in sorted(after):
        ep = wal_episode(eid)
        buf.add(ep, encode_episode(ep))
    buf.sync()
    buf.close()
    torn = encode_record(encode_episode(wal_episode(f"{tag}-torn")))
    with open(directory / "wal-00000000.bin", "ab") as f:
        f.write(torn[: len(torn) // 2])
    ids, cut = restored_ids(directory)
    assert ids == kept | after, f"{tag}: lost {sorted(kept | after - ids)}"
    assert len(cut) == 1 and cut[0].bytes_cut == len(torn) // 2
