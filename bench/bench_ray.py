"""The Ray scheduler's figures (issue 27).

1. Learner bytes per weights version with and without the per-node relay, for 2 nodes x 4 actors,
   for the embedded demo model and for Qwen2.5-0.5B's shapes (random bf16 weights, 494M parameters):
   the learner's real weights socket (:class:`asyncrl.learner.ingest.server.LearnerServer`) publishes; without the
   relay 8 subscribers take every version from it, with it 2 relays (:class:`asyncrl.weights.relay.WeightRelay`)
   take it once each and serve 4 subscribers each from shared memory. Bytes are the learner's own
   count (``weights_bytes_sent``).
2. Time from ``asyncrl run`` to the first trained step: ``--scheduler local`` against ``--scheduler
   ray`` joining a simulated 3-node cluster (``ray.cluster_utils.Cluster``: head + 2 workers on
   this machine, 127.0.0.1), 4 actors on the workers. The cluster is started before the clock.

    .venv/bin/python bench/bench_ray.py [--versions 3] [--skip-start] [--skip-qwen]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import load_config  # noqa: E402
from asyncrl.learner.ingest.server import LearnerServer  # noqa: E402
from asyncrl.weights.relay import WeightRelay  # noqa: E402
from asyncrl.wire.codec import decode, encode, encode_weights  # noqa: E402
from asyncrl.wire.messages import Subscribe  # noqa: E402
from asyncrl.wire.sockets import send_frames  # noqa: E402


def qwen05b_shapes() -> dict[str, tuple[int, ...]]:
    h, inter, layers, kv, vocab = 896, 4864, 24, 128, 151936
    out = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.q_proj.bias": (h,),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    return out


def demo_state() -> dict[str, torch.Tensor]:
    from asyncrl.models.loading import load_policy

    cfg = load_config(None, [])
    model, _, _ = load_policy(cfg.model, 0, "cpu", cfg.tasks.prompt_format)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


class Subscriber:
    """A raw subscriber (an actor's weights socket): asks, takes each version, says it holds it."""

    def __init__(self, ctx, address: str, name: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, name.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.name, self.have = name, -1
        self.ask()

    def ask(self) -> None:
        send_frames(self.sock, encode("subscribe", Subscribe(actor_id=self.name, have=self.have)))

    def take(self) -> None:
        while self.sock.poll(0):
            frames = self.sock.recv_multipart(copy=False)
            self.have = decode(frames, kinds=("weights",)).body.version
            self.ask()


def relay_bytes(
    state: dict[str, torch.Tensor], versions: int, relay: bool, nodes: int = 2, per_node: int = 4
) -> tuple[int, int]:
    """(bytes the learner sent for ``versions`` versions, bytes of one weights message)."""
    wire = load_config(None, []).wire
    net = LearnerServer(wire, lambda *a: None)
    ctx = zmq.Context()
    relays, subs, threads = [], [], []
    shm = tempfile.mkdtemp(prefix="bench-relay-")
    try:
        if relay:
            for n in range(nodes):
                r = WeightRelay(net.addresses["weights"], f"n{n}", wire, SimpleNamespace(type="ipc", dir=shm))
                relays.append(r)
                threads.append(threading.Thread(target=r.run, daemon=True))
                subs += [Subscriber(ctx, r.address, f"a{n}-{i}") for i in range(per_node)]
        else:
            subs = [Subscriber(ctx, net.addresses["weights"], f"a{i}") for i in range(nodes * per_node)]
        for t in threads:
            t.start()
        size = 0
        for v in range(1, versions + 1):
            frames = encode_weights(state, v)
            size = sum(memoryview(f).nbytes for f in frames)
            net.subscribers.publish(frames, v)
            deadline = time.time() + 300
            while any(s.have != v for s in subs) and time.time() < deadline:
                net.poll(20)
                for s in subs:
                    s.take()
            if any(s.have != v for s in subs):
                raise RuntimeError(f"version {v} did not reach every subscriber")
        return net.subscribers.bytes_sent, size
    finally:
        for r in relays:
            r.stopping = True
        for t in threads:
            t.join(timeout=10)
        for r in relays:
            r.close()
        for s in subs:
            s.sock.close(0)
        ctx.term()
        net.close()


def time_to_first_step(scheduler: str, address: str | None, env: dict, workdir: Path) -> float:
    run = workdir / scheduler
    args = [
        sys.executable,
        "-m",
        "asyncrl",
        "run",
        "-c",
        "configs/quickstart.yaml",
        "--scheduler",
        scheduler,
        f"run_root={workdir}",
        f"name={scheduler}",
        "train.total_steps=100000",
        "actor.num=4",
        "eval.size=20",
        "eval.every=100000",
    ]
    if scheduler == "ray":
        args += [
            f"launch.ray.address={address}",
            "launch.learner.resources={learner: 1}",
            "launch.actor.resources={worker: 1}",
        ]
    t0 = time.time()
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        while time.time() - t0 < 600:
            if (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip():
                return time.time() - t0
            if proc.poll() is not None:
                raise RuntimeError(f"asyncrl run --scheduler {scheduler} exited with {proc.returncode}")
            time.sleep(0.1)
        raise RuntimeError("no trained step within 600 s")
    finally:
        proc.send_signal(2)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--skip-start", action="store_true", help="skip the time-to-first-step comparison")
    ap.add_argument("--skip-qwen", action="store_true", help="skip Qwen2.5-0.5B's shapes (about 1 GB a version)")
    a = ap.parse_args()

    models = [("demo (embedded)", demo_state)]
    if not a.skip_qwen:
        models.append(
            (
                "Qwen2.5-0.5B shapes, bf16",
                lambda: {k: torch.randn(s, dtype=torch.bfloat16) for k, s in qwen05b_shapes().items()},
            )
        )
    print(f"learner bytes per weights version, 2 nodes x 4 actors, {a.versions} versions")
    print(f"{'model':28s} {'message MB':>11s} {'no relay MB/v':>14s} {'relay MB/v':>11s} {'copies':>10s}")
    for name, make in models:
        state = make()
        rows = {}
        for relay in (False, True):
            sent, size = relay_bytes(state, a.versions, relay)
            rows[relay] = sent / a.versions
        print(
            f"{name:28s} {size / 1e6:11.1f} {rows[False] / 1e6:14.1f} {rows[True] / 1e6:11.1f} "
            f"{rows[False] / size:4.1f} -> {rows[True] / size:3.1f}",
            flush=True,
        )
        del state

    if a.skip_start:
        return
    os.environ.update(
        {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    )
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"learner": 1},
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2, resources={"worker": 2}, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with tempfile.TemporaryDirectory() as d:
            times = {s: time_to_first_step(s, cluster.address, env, Path(d)) for s in ("local", "ray")}
        print(
            f"asyncrl run to the first trained step, 4 actors: local {times['local']:.1f} s, ray (3-node simulated "
            f"cluster, started before) {times['ray']:.1f} s ({times['ray'] / times['local']:.2f}x)"
        )
        print(json.dumps({"first_step_s": times}))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
