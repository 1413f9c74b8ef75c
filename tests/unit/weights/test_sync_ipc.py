"""Shared-memory weight sync (``sync.type: ipc``): bit-exact versions through real segments, torn
versions refused, bad references refused, and no segment left behind by a run that ends or is killed
(real learner and actor processes with the HF engine over loopback ZeroMQ)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from asyncrl.lifecycle import pid_alive
from asyncrl.weights import WeightsError, make_publisher, make_receiver
from asyncrl.weights.ipc import PREFIX, IpcPublisher, IpcReceiver
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.messages import TensorSpec, Weights
from tests.conftest import SMALL_RUN, kill_tree, read_jsonl, run_cli, start_cli

COMMON = [*SMALL_RUN, "sync.type=ipc"]


def _cfg(tmp_path):
    return SimpleNamespace(type="ipc", dir=str(tmp_path), keep=1, every=1)


def _segments(directory) -> list[str]:
    return sorted(p.name for p in directory.glob(f"{PREFIX}*"))


def test_a_hundred_versions_arrive_bit_exact_and_leave_no_segment(tmp_path):
    pub, rec = make_publisher(_cfg(tmp_path), tmp_path), make_receiver(_cfg(tmp_path))
    assert isinstance(pub, IpcPublisher) and isinstance(rec, IpcReceiver)
    g = torch.Generator().manual_seed(0)
    try:
        for v in range(1, 101):
            state = {
                "w": torch.randn(7, 5, generator=g),
                "b": torch.randn(3, generator=g).to(torch.bfloat16),
                "e": torch.randn(11, 2, generator=g),
            }
            version, got = rec.tensors(decode(pub.frames(state, v)))  # through the real wire encoding
            assert version == v and set(got) == set(state)
            for k, t in state.items():
                assert got[k].dtype == t.dtype and torch.equal(got[k], t), (v, k)
            assert len(_segments(tmp_path)) == 2  # two slots, reused for every version
    finally:
        rec.close()
        pub.close()
    assert _segments(tmp_path) == []


def test_a_version_overwritten_before_it_is_read_is_refused_not_loaded_torn(tmp_path):
    pub, rec = IpcPublisher(_cfg(tmp_path)), IpcReceiver(_cfg(tmp_path))
    try:
        old = decode(pub.frames({"w": torch.zeros(4)}, 1))
        pub.frames({"w": torch.ones(4)}, 2)
        pub.frames({"w": torch.full((4,), 3.0)}, 3)  # slot of version 1 now holds 3
        with pytest.raises(WeightsError, match="holds version 3, not 1"):
            rec.tensors(old)
        version, got = rec.tensors(decode(pub.frames({"w": torch.full((4,), 4.0)}, 4)))
        assert version == 4 and got["w"].tolist() == [4.0] * 4
    finally:
        rec.close()
        pub.close()


@pytest.mark.parametrize(
    "body, match",
    [
        (Weights(version=1, segment="../../etc/passwd", layout=[]), "not an asyncrl shared-memory segment"),
        (Weights(version=1, segment=f"{PREFIX}1-ab-1-0", layout=[]), "does not exist"),
        (Weights(version=1, path="/x.safetensors"), "expects sync.type=ipc"),
    ],
)
def test_bad_references_are_refused_with_the_reason(tmp_path, body, match):
    with pytest.raises(WeightsError, match=match):
        IpcReceiver(_cfg(tmp_path)).tensors(decode(encode("weights", body)))


def test_a_layout_outside_the_segment_is_refused(tmp_path):
    pub, rec = IpcPublisher(_cfg(tmp_path)), IpcReceiver(_cfg(tmp_path))
    try:
        good = decode(pub.frames({"w": torch.zeros(16)}, 1))
        bad = Weights(
            version=1,
            segment=good.body.segment,
            layout=[TensorSpec(name="w", dtype="float32", shape=[1 << 20], offset=0, nbytes=4 << 20)],
        )
        with pytest.raises(WeightsError, match="do not fit"):
            rec.tensors(decode(encode("weights", bad)))
    finally:
        rec.close()
        pub.close()


@pytest.mark.slow
def test_a_run_with_ipc_sync_trains_on_new_weights_and_cleans_up(tmp_path, tiny_overrides):
    shm = tmp_path / "shm"
    res = run_cli(
        "run",
        *tiny_overrides,
        *COMMON,
        f"sync.dir={shm}",
        f"run_root={tmp_path}",
        "name=ipc",
        "train.total_steps=4",
        timeout=240,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    episodes = [e for e in read_jsonl(tmp_path / "ipc" / "events.jsonl") if e["kind"] == "episode"]
    # credits after step 1 require version >= 1: the actor generated with weights read from shared memory
    assert max(e["policy_version"] for e in episodes) >= 1, [e["policy_version"] for e in episodes]
    assert _segments(shm) == []  # the learner removed its segments on exit
    metrics = read_jsonl(tmp_path / "ipc" / "metrics.jsonl")
    applied = [m["sync/applied_ms_mean"] for m in metrics if "sync/applied_ms_mean" in m]
    assert applied and all(0 <= ms < 60_000 for ms in applied), metrics  # publish -> applied, per step


@pytest.mark.slow
def test_segments_of_a_killed_learner_are_swept_by_the_next(tmp_path, tiny_overrides):
    shm = tmp_path / "shm"
    proc = start_cli(
        "run",
        *tiny_overrides,
        *COMMON,
        f"sync.dir={shm}",
        f"run_root={tmp_path}",
        "name=k",
        "train.total_steps=100000",
        log=tmp_path / "run.log",
    )
    try:
        deadline = time.time() + 180
        while time.time() < deadline and len(_segments(shm)) < 2:
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-2000:]
            time.sleep(0.2)
        assert len(_segments(shm)) == 2, (tmp_path / "run.log").read_text()[-2000:]
    finally:
        kill_tree(proc)
    left = _segments(shm)
    assert len(left) == 2  # SIGKILL: nobody removed them
    owners = {int(name[len(PREFIX) :].split("-")[0]) for name in left}
    deadline = time.time() + 60  # a killed process takes a moment to be gone (it may be reaped late)
    while any(pid_alive(pid) for pid in owners) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(pid) for pid in owners), owners
    IpcPublisher(_cfg(shm)).close()  # the next publisher on the host sweeps segments of dead learners
    assert _segments(shm) == []
