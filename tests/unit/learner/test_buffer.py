"""Replay buffer: staleness filtering, ordering, de-duplication, WAL durability and torn tails."""

from __future__ import annotations

from asyncrl.learner.ingest.buffer import EpisodeQueue
from asyncrl.learner.ingest.staleness import StalenessPolicy
from asyncrl.rundir.record_file import read_frame_records
from asyncrl.types import Episode
from asyncrl.wire.codec import decode, decode_episode, encode_episode
from tests.support.factories import episode


def _episode(version: int, eid: str) -> Episode:
    return episode(eid, version=version)


def _add(buf, version, eid):
    ep = _episode(version, eid)
    return buf.add(ep, encode_episode(ep))


def test_take_respects_staleness_and_order(tmp_path):
    buf = EpisodeQueue(tmp_path, capacity=100)
    buf.open_wal(0)
    for v, eid in [(5, "a"), (3, "b"), (4, "c"), (1, "old")]:
        assert _add(buf, v, eid)
    assert (
        buf.take(4, version=5, staleness=StalenessPolicy(2, "drop")) is None
    )  # "old" (staleness 4) is dropped: 3 left
    assert buf.dropped_stale == 1
    got = buf.take(2, version=5, staleness=StalenessPolicy(2, "drop"))
    assert [e.id for e in got] == ["b", "c"]  # oldest policy versions first
    assert [e.id for e in buf.take(1, version=5, staleness=StalenessPolicy(2, "drop"))] == ["a"]
    assert len(buf) == 0


def test_duplicates_are_refused_and_not_logged_twice(tmp_path):
    buf = EpisodeQueue(tmp_path, capacity=100)
    buf.open_wal(0)
    assert _add(buf, 0, "x")
    assert not _add(buf, 0, "x")
    buf.sync()
    assert len(list(read_frame_records(tmp_path / "wal-00000000.bin"))) == 1


def test_restore_from_checkpoint_and_wal_with_torn_tail(tmp_path):
    buf = EpisodeQueue(tmp_path, capacity=100)
    buf.open_wal(0)
    _add(buf, 0, "consumed")
    _add(buf, 0, "pending")
    buf.take(1, version=0, staleness=StalenessPolicy(0, "drop"))  # "consumed" leaves the buffer (trained)
    buf.save(tmp_path / "buffer.bin")  # checkpoint: "pending" + seen {consumed, pending}
    seen = set(buf.seen)
    buf.open_wal(1)
    _add(buf, 1, "after")
    buf.sync()
    with open(tmp_path / "wal-00000001.bin", "ab") as f:
        f.write(b"\x03\x00\x00\x00\x10")  # a torn record from a crash mid-write
    fresh = EpisodeQueue(tmp_path, capacity=100)
    report = fresh.restore(tmp_path / "buffer.bin", seen)
    assert report.recovered == 1 and report.from_checkpoint == 1
    assert [(t.path.name, t.bytes_cut) for t in report.truncated] == [("wal-00000001.bin", 5)]
    assert sorted(e.id for e, _ in fresh.episodes.values()) == ["after", "pending"]
    ep = fresh.take(2, version=1, staleness=StalenessPolicy(1, "drop"))[0]
    assert ep.trajectories[0].loss_mask.tolist() == [0, 0, 1, 1]
    assert decode_episode(decode(encode_episode(ep))).id == ep.id
