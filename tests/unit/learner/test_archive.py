"""Issue 63.2: the episode archive (``asyncrl replay``) read from hostile files. A record with a valid
checksum whose frame inflates far past what its head declares (an archive bomb) is refused before it
is allocated; a directory or a FIFO where a step file should be, a malformed meta.json and a deeply
nested head are one-line ArchiveErrors, never a traceback or a replay blocked for ever."""

from __future__ import annotations

import json
import os
import threading
import tracemalloc
import zlib

import numpy as np
import pytest

from asyncrl.learner.archive import (
    MAX_FRAME_BYTES,
    ArchiveError,
    EpisodeArchive,
    archive_dir,
    read_meta,
    read_step,
    step_file,
    verify_steps,
)
from asyncrl.rundir.record_file import write_frames
from asyncrl.types import Episode, Trajectory


def _episode() -> Episode:
    mask = np.r_[np.zeros(4), np.ones(5)]
    t = Trajectory(
        token_ids=np.arange(3, 12),
        loss_mask=mask,
        behavior_logprobs=-0.5 * mask,
        policy_version=0,
        reward=1.0,
        group_id="g",
    )
    return Episode(trajectories=[t], actor_id="actor-0")


def _archive(tmp_path):
    arc = EpisodeArchive(tmp_path, 1.0, 0, {"seed": 0}, warn=print)
    arc.write(1, [_episode(), _episode()], keep_rows=False)
    return step_file(tmp_path, 1)


def _rewrite(path, head: dict | bytes, frames: list[bytes]) -> None:
    """A record with a valid checksum: what a hostile writer can always make."""
    raw = head if isinstance(head, bytes) else json.dumps(head).encode()
    with open(path, "wb") as f:
        write_frames(f, [raw, *frames])


def test_a_valid_archive_reads_back(tmp_path):
    _archive(tmp_path)
    episodes, keep = read_step(tmp_path, 1)
    assert len(episodes) == 2 and not keep and np.array_equal(episodes[0].trajectories[0].token_ids, np.arange(3, 12))
    assert read_meta(tmp_path) == {"seed": 0}


def test_an_archive_bomb_is_refused_before_it_is_allocated(tmp_path):
    path = _archive(tmp_path)
    bomb = zlib.compress(b"\0" * (512 << 20), 9)  # 0.5 MB that inflates to 512 MiB
    assert len(bomb) < 1 << 20
    tracemalloc.start()
    try:
        _rewrite(path, {"step": 1, "keep_rows": False, "frames": [1], "sizes": [4096]}, [bomb])
        with pytest.raises(ArchiveError, match="inflates past 4096 bytes"):
            read_step(tmp_path, 1)
        # a head that declares it (or any frame past the cap) is refused without inflating anything
        _rewrite(path, {"step": 1, "keep_rows": False, "frames": [1], "sizes": [512 << 20]}, [bomb])
        with pytest.raises(ArchiveError, match=f"at most {MAX_FRAME_BYTES} a frame"):
            read_step(tmp_path, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak
    # an older archive's head has no sizes: the frame cap alone (not the whole bomb)
    _rewrite(path, {"step": 1, "keep_rows": False, "frames": [1]}, [zlib.compress(b"\0" * (MAX_FRAME_BYTES + 10), 1)])
    with pytest.raises(ArchiveError, match=f"inflates past {MAX_FRAME_BYTES} bytes"):
        read_step(tmp_path, 1)


def test_what_is_not_a_regular_file_is_refused_and_a_fifo_does_not_block(tmp_path):
    path = _archive(tmp_path)
    path.unlink()
    path.mkdir()
    with pytest.raises(ArchiveError, match="the step file is a directory, expected a regular file"):
        verify_steps(tmp_path, [1])
    path.rmdir()
    os.mkfifo(path)
    result: dict = {}

    def replay():
        try:
            read_step(tmp_path, 1)
        except ArchiveError as e:
            result["error"] = str(e)

    worker = threading.Thread(target=replay, daemon=True)
    worker.start()
    worker.join(timeout=60)  # (a blocked open would never return)
    assert not worker.is_alive() and "is a FIFO" in result.get("error", ""), result


def test_a_malformed_meta_or_head_is_one_line(tmp_path):
    path = _archive(tmp_path)
    meta = archive_dir(tmp_path) / "meta.json"
    for text, expect in (
        ("{not json", "JSONDecodeError"),
        ("[1, 2]", "a JSON list, expected an object"),
        ("[" * 100_000 + "]" * 100_000, "RecursionError"),
    ):
        meta.write_text(text)
        with pytest.raises(ArchiveError, match=expect) as e:
            read_meta(tmp_path)
        assert "\n" not in str(e.value)
    _rewrite(path, b"[" * 100_000 + b"]" * 100_000, [b"x"])
    with pytest.raises(ArchiveError, match="RecursionError"):
        read_step(tmp_path, 1)
    _rewrite(path, {"step": 1, "frames": "many"}, [b"x"])
    with pytest.raises(ArchiveError, match="damaged archive record"):
        read_step(tmp_path, 1)
