"""Weight sync per transport: publish -> applied in another process, on this host.

    .venv/bin/python bench/bench_sync.py [--shapes embedded qwen0.5b] [--transports zmq filesystem ipc]
    .venv/bin/python bench/bench_sync.py --lora 0 16     # full weights against LoRA rank 16 (issue 32)

For each transport (``sync.type``) and tensor set, the publishing process does what the learner
does per version (a snapshot copy of the parameters where the transport needs one, then
``WeightPublisher.frames``) and sends the ``weights`` message over a loopback ZeroMQ socket; a
receiving process does what an actor does (``WeightReceiver.tensors`` on the decoded message, the
dtype and finite-value check ``check_weight_values``, then copies every tensor into its own
model-sized tensors, as ``Engine.update_weights`` does) and
answers with the version. The figure is the time from the start of the publish to that answer.

Tensor sets: ``embedded`` (the shapes of the default embedded model, float32) and ``qwen0.5b``
(Qwen2.5-0.5B's parameter shapes, bfloat16: 494M parameters, 988 MB), random values. ``nccl``
runs with the gloo backend (CPU); its first version includes the actor joining the group.

``--lora R`` (R > 0): the tensors of a version are LoRA adapters of rank R on the attention and MLP
projections (``model.lora``'s default targets), random values in float32 as the learner trains
them, and the receiver does what a LoRA actor's HF engine does: it merges them into a model of
those shapes (``asyncrl.weights.adapters.MergedAdapters``: ``W0 + (alpha / r) B @ A`` per targeted layer).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import zmq
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.weights import make_publisher, make_receiver  # noqa: E402
from asyncrl.weights.base import check_weight_values  # noqa: E402
from asyncrl.wire.codec import decode  # noqa: E402


def shapes(name: str) -> tuple[dict[str, tuple[int, ...]], torch.dtype]:
    """Parameter name -> shape of a tensor set, and its dtype."""
    model = _meta_model(name)
    return {k: tuple(v.shape) for k, v in model.named_parameters()}, next(model.parameters()).dtype


def _lora_settings(rank: int):
    from asyncrl.config import LoraSettings

    return LoraSettings(rank=rank, alpha=2.0 * rank)


def _meta_model(name: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    if name == "embedded":
        from asyncrl.config import load_config
        from asyncrl.models.tiny import embedded_llama_config
        from asyncrl.models.tokenizer import build_char_tokenizer

        config, dtype = (
            embedded_llama_config(load_config(None).model.embedded, len(build_char_tokenizer())),
            torch.float32,
        )
    else:
        config = Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
        dtype = torch.bfloat16
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).to(dtype)


def lora_shapes(name: str, rank: int) -> dict[str, tuple[int, ...]]:
    """Wire name -> shape of the rank-``rank`` adapters of tensor set ``name``."""
    from asyncrl.weights.adapters import expected_shapes, targeted

    lora = _lora_settings(rank)
    return expected_shapes(targeted(_meta_model(name), lora), lora.rank)


def make_state(name: str, lora: int = 0) -> dict[str, torch.Tensor]:
    spec, dtype = (lora_shapes(name, lora), torch.float32) if lora else shapes(name)
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in spec.items()}


def sync_config(transport: str, directory: str) -> SimpleNamespace:
    """The ``sync`` section both sides use (``nccl`` with the gloo backend on loopback)."""
    return SimpleNamespace(
        type=transport,
        dir=directory,
        keep=2,
        every=1,
        backend="gloo",
        group_host="127.0.0.1",
        group_port=0,
        timeout_s=60.0,
    )


def receive(address: str, transport: str, directory: str, tensor_set: str, lora: str = "0") -> None:
    """The receiving process: check (dtypes, finite values) and apply every version it is sent, as
    an actor does, and answer with its number."""
    merge = None
    if int(lora):  # a model of the set's shapes (values left as allocated) that the adapters merge into
        from asyncrl.weights.adapters import MergedAdapters

        merge = MergedAdapters(_meta_model(tensor_set).to_empty(device="cpu"), _lora_settings(int(lora)))
    else:
        spec, dtype = shapes(tensor_set)
        model = {k: torch.zeros(s, dtype=dtype) for k, s in spec.items()}
    receiver = make_receiver(sync_config(transport, directory))
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(address)
    sock.send(b"ready")
    while True:
        frames = sock.recv_multipart(copy=False)
        if frames[0].bytes == b"stop":
            break
        version, tensors = receiver.tensors(decode(frames))
        check_weight_values(tensors)  # (as an actor does before its engine takes a version)
        if merge is not None:
            merge.apply(tensors)
        else:
            for k, t in tensors.items():
                model[k].copy_(t)
        sock.send(str(version).encode())
    getattr(receiver, "close", lambda: None)()
    sock.close(0)


def bench(transport: str, state: dict[str, torch.Tensor], tensor_set: str, rounds: int, lora: int = 0) -> np.ndarray:
    import subprocess

    with tempfile.TemporaryDirectory() as directory:
        cfg = sync_config(transport, directory)
        publisher = make_publisher(cfg, Path(directory))
        snapshot = getattr(publisher, "needs_snapshot", True)
        poll = getattr(publisher, "poll", None)  # as Learner.pump calls it
        sock = zmq.Context.instance().socket(zmq.PAIR)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        child = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--receive",
                f"tcp://127.0.0.1:{port}",
                transport,
                directory,
                tensor_set,
                str(lora),
            ]
        )
        try:
            if not sock.poll(300_000):
                raise RuntimeError("the receiving process did not start")
            sock.recv()
            out = []
            for v in tqdm(range(1, rounds + 1), desc=f"{tensor_set} {transport} lora={lora}", leave=False):
                t0 = time.perf_counter()
                sent = {k: t.clone() for k, t in state.items()} if snapshot else state  # as Learner.publish
                sock.send_multipart(publisher.frames(sent, v), copy=False)
                while poll is not None and not sock.poll(5):  # nccl: actors join between publishes
                    poll()
                if int(sock.recv()) != v:
                    raise RuntimeError("the receiver answered with another version")
                out.append(time.perf_counter() - t0)
            sock.send(b"stop")
            child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            sock.close(0)
            getattr(publisher, "close", lambda: None)()
    return np.array(out) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["embedded", "qwen0.5b"], choices=["embedded", "qwen0.5b"])
    p.add_argument(
        "--transports",
        nargs="+",
        default=["zmq", "filesystem", "ipc", "nccl"],
        help="sync.type values (nccl runs with the gloo backend here)",
    )
    p.add_argument("--rounds", type=int, default=0, help="versions per figure (default: 30 embedded, 8 qwen0.5b)")
    p.add_argument(
        "--lora",
        nargs="+",
        type=int,
        default=[0],
        help="0: full weights; R: LoRA adapters of rank R merged by the receiver (e.g. --lora 0 16)",
    )
    p.add_argument("--receive", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.receive:
        return receive(*a.receive)
    print(
        "| tensors | weights | MB per version | transport | publish -> applied median ms | p90 ms |\n"
        "|---|---|---|---|---|---|"
    )
    for tensor_set in a.shapes:
        medians = {}
        for lora in a.lora:
            state = make_state(tensor_set, lora)
            mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
            what = f"LoRA r={lora}" if lora else "full"
            rounds = a.rounds or (30 if tensor_set == "embedded" or lora else 8)
            for transport in a.transports:
                ms = bench(transport, state, tensor_set, rounds, lora)[2:]  # the first two map and allocate
                medians[(lora, transport)] = (float(np.median(ms)), mb)
                print(
                    f"| {tensor_set} | {what} | {mb:.2f} | {transport} | {np.median(ms):.1f} | "
                    f"{np.percentile(ms, 90):.1f} |",
                    flush=True,
                )
            if (lora, "zmq") in medians and (lora, "ipc") in medians:
                print(
                    f"| {tensor_set} | {what} | | zmq / ipc | {medians[(lora, 'zmq')][0] / medians[(lora, 'ipc')][0]:.2f}x | |",
                    flush=True,
                )
        for lora in a.lora:
            for transport in a.transports:
                if lora and (0, transport) in medians:
                    (full_ms, full_mb), (ms, mb) = medians[(0, transport)], medians[(lora, transport)]
                    print(
                        f"| {tensor_set} | full / LoRA r={lora} | {full_mb / mb:.1f}x bytes | {transport} | "
                        f"{full_ms / ms:.1f}x time | |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
