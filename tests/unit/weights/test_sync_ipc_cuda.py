"""``sync.type: ipc`` with the learner on a GPU: the weights go to actors as CUDA IPC handles (no host
copy). The handle's message and its refusals are checked everywhere; the real cross-process mapping
and a run with the learner and the HF engine on CUDA need a GPU (``gpu``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from asyncrl.weights import WeightsError
from asyncrl.weights.ipc import HEADER_BYTES, PREFIX, IpcPublisher, IpcReceiver
from asyncrl.wire.codec import WireError, decode, encode
from asyncrl.wire.messages import CudaHandle, Weights
from tests.conftest import SMALL_RUN, read_jsonl, run_cli

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))

from ipc_child import digest, read_answer, write_frames  # noqa: E402


def _cfg(tmp_path, cuda_ipc=True):
    return SimpleNamespace(type="ipc", dir=str(tmp_path), keep=1, every=1, cuda_ipc=cuda_ipc)


def _handle(**over) -> CudaHandle:
    fields = dict(
        device=0,
        handle=b"\0" * 64,
        size=1024,
        offset=0,
        ref_counter=b"/torch_1_2",
        ref_counter_offset=0,
        event=b"\0" * 64,
        event_sync=True,
    )
    return CudaHandle(**{**fields, **over})


def test_cpu_weights_still_go_through_the_host_segment_with_no_handle(tmp_path):
    pub = IpcPublisher(_cfg(tmp_path))
    try:
        msg = decode(pub.frames({"w": torch.ones(8)}, 1))
        assert msg.body.cuda is None
        assert all(p.stat().st_size >= HEADER_BYTES + 32 for p in pub.segment_paths)  # the tensors are there
    finally:
        pub.close()


def test_a_handle_is_refused_by_an_actor_without_that_gpu(tmp_path, monkeypatch):
    pub = IpcPublisher(_cfg(tmp_path))
    try:
        good = decode(pub.frames({"w": torch.zeros(4)}, 1)).body
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # an actor that has no CUDA
        msg = Weights(version=1, segment=good.segment, layout=good.layout, cuda=_handle())
        with pytest.raises(WeightsError, match="CUDA device 0, which this actor cannot see.*sync.cuda_ipc=false"):
            IpcReceiver(_cfg(tmp_path)).tensors(decode(encode("weights", msg)))
    finally:
        pub.close()


@pytest.mark.parametrize(
    "over, field", [({"handle": b"x" * 300}, "handle"), ({"size": -1}, "size"), ({"event_sync": "yes"}, "event_sync")]
)
def test_a_malformed_handle_is_refused_at_decoding(over, field):
    fields = dict(
        device=0, handle=b"h", size=1, offset=0, ref_counter=b"r", ref_counter_offset=0, event=b"e", event_sync=True
    )
    fields.update(over)
    header = encode("weights", Weights(version=1, segment=f"{PREFIX}1-ab-1-0", layout=[]))
    import msgpack

    raw = msgpack.unpackb(header[0])
    raw["body"]["cuda"] = fields
    with pytest.raises(WireError, match=field):
        decode([msgpack.packb(raw)])


# --- on a GPU ----------------------------------------------------------------------------------------


def _child(directory):
    return subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "ipc_child.py"), str(directory), "--digest"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


@pytest.mark.gpu
def test_cuda_weights_reach_another_process_bit_exact_through_gpu_memory(tmp_path):
    g = torch.Generator().manual_seed(0)
    pub = IpcPublisher(_cfg(tmp_path))
    child = _child(tmp_path)
    try:
        allocated_v2 = None
        for v in range(1, 31):
            state = {
                "w": torch.randn(300, 70, generator=g).cuda(),
                "b": torch.randn(3, generator=g).to(torch.bfloat16).cuda(),
                "e": torch.randn(1000, 64, generator=g).to(torch.bfloat16).cuda(),
            }
            frames = pub.frames(state, v)
            body = decode(frames).body
            assert body.cuda is not None and body.cuda.device == state["w"].device.index
            assert all(p.stat().st_size == HEADER_BYTES + 1 for p in pub.segment_paths)  # the header only
            write_frames(child.stdin, frames)
            answer = read_answer(child)
            assert "error" not in answer, answer
            assert answer["version"] == v and answer["device"].startswith("cuda")
            assert answer["sha"] == {k: digest(t) for k, t in state.items()}, v
            if v == 2:
                allocated_v2 = answer["allocated"]
        assert answer["allocated"] == allocated_v2  # the child maps each slot once: nothing grows per version
    finally:
        child.stdin.close()
        child.wait(timeout=120)
        pub.close()
    assert child.returncode == 0
    assert list(tmp_path.glob(f"{PREFIX}*")) == []


@pytest.mark.gpu
def test_a_torn_cuda_version_is_refused(tmp_path):
    pub = IpcPublisher(_cfg(tmp_path))
    child = _child(tmp_path)
    try:
        old = pub.frames({"w": torch.zeros(64, device="cuda")}, 1)
        pub.frames({"w": torch.ones(64, device="cuda")}, 2)
        pub.frames({"w": torch.full((64,), 3.0, device="cuda")}, 3)  # version 1's slot now holds 3
        write_frames(child.stdin, old)
        assert "holds version 3, not 1" in read_answer(child)["error"]
    finally:
        child.stdin.close()
        child.wait(timeout=120)
        pub.close()


@pytest.mark.gpu
@pytest.mark.slow
def test_a_run_on_cuda_with_ipc_sync_trains_on_new_weights(tmp_path, tiny_overrides):
    shm = tmp_path / "shm"
    res = run_cli(
        "run",
        *tiny_overrides,
        *SMALL_RUN,
        "sync.type=ipc",
        f"sync.dir={shm}",
        "train.device=cuda",
        "engine.device=cuda",
        f"run_root={tmp_path}",
        "name=cuda",
        "train.total_steps=6",
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    episodes = [e for e in read_jsonl(tmp_path / "cuda" / "events.jsonl") if e["kind"] == "episode"]
    assert max(e["policy_version"] for e in episodes) >= 1
    metrics = read_jsonl(tmp_path / "cuda" / "metrics.jsonl")
    assert [m["step"] for m in metrics][-1] == 6
    assert any("sync/applied_ms_mean" in m for m in metrics)
    assert all(m["mismatch/logprob_abs_diff_mean"] < 1e-3 for m in metrics if "mismatch/logprob_abs_diff_mean" in m)
    assert list(shm.glob(f"{PREFIX}*")) == []
