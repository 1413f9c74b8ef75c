"""Wire codec throughput vs raw pyzmq, for a realistic episode and a weights message.

    .venv/bin/python bench/bench_wire.py [--seconds 1.0]

Prints, for an episode (64 trajectories x 40 tokens, with recorded log-probs on half) and a
1M-parameter float32 weights message:
  codec      encode + decode (to Episode / torch tensors) in memory, messages/s and MB/s
             (for weights both sides are zero-copy, so this is pure per-message overhead);
  wire       encode -> PUSH -> tcp://127.0.0.1 -> PULL -> decode, messages/s;
  raw        the same bytes pre-built, PUSH -> PULL with no encode/decode, messages/s;
  ratio      wire / raw (1.0 = the codec costs nothing over pyzmq itself);
  transports raw over tcp://127.0.0.1 (unauthenticated: what the learner bound before issue 41),
             over ipc:// in a private directory (its default on one host) and over tcp with CURVE
             (its sockets with wire.curve_dir), messages/s and MB/s.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from wire_util import measure_ingest, timed_rate  # noqa: E402 (bench/, beside this script)

from asyncrl.types import Episode, Task, Trajectory
from asyncrl.wire.codec import decode, decode_episode, decode_weights, encode_episode, encode_weights


def make_episode(n_traj: int = 64, n_tokens: int = 40) -> Episode:
    rng = np.random.default_rng(0)
    trajs = []
    for i in range(n_traj):
        mask = np.r_[np.zeros(n_tokens // 2), np.ones(n_tokens - n_tokens // 2)]
        replay = i % 2 == 0
        trajs.append(
            Trajectory(
                token_ids=rng.integers(0, 32000, n_tokens),
                loss_mask=mask,
                behavior_logprobs=-rng.random(n_tokens) * mask,
                policy_version=3,
                reward=float(i % 2),
                scores={"acc": float(i % 2), "format": 1.0},
                sample_type="solver",
                group_id=f"g{i // 8}",
                task_id=f"t{i // 8}",
                is_replay=replay,
                recorded_logprobs=-rng.random(n_tokens) if replay else None,
                exp_mask=mask if replay else None,
                text="<answer>42</answer>",
            )
        )
    task = Task(id="t0", prompt=[{"role": "user", "content": "What is 20+22?"}], answer="42")
    return Episode(
        trajectories=trajs,
        actor_id="actor-0",
        task=task,
        decision={"learnable": [True] * 8},
        metrics={"unified_filter/kept": 8.0},
    )


def payload_mb(frames: list) -> float:
    return sum(memoryview(f).nbytes for f in frames) / 1e6


def report(name: str, frames: list, codec_fn, build, handle, seconds: float) -> None:
    mb = payload_mb(frames)
    codec = timed_rate(codec_fn, seconds)
    n = max(10, min(int(codec * seconds), int(seconds * 1e3 / mb)))  # <= ~1 GB per run
    wire = measure_ingest(frames, n, build=build, handle=handle)
    raw = measure_ingest([bytes(memoryview(f)) for f in frames], n)
    print(f"{name}: {len(frames)} frames, {mb * 1e3:.1f} kB")
    print(f"  codec  {codec:10.0f} msg/s  {codec * mb:8.0f} MB/s   (encode + decode, in memory)")
    print(f"  wire   {wire:10.0f} msg/s  {wire * mb:8.0f} MB/s   (encode, PUSH/PULL tcp, decode)")
    print(f"  raw    {raw:10.0f} msg/s  {raw * mb:8.0f} MB/s   (pre-built bytes, PUSH/PULL tcp)")
    print(f"  ratio wire/raw = {wire / raw:.2f}   (n = {n} messages)")
    plain = [bytes(memoryview(f)) for f in frames]
    for transport in ("tcp", "ipc", "curve"):
        rate = measure_ingest(plain, n, transport=transport)
        print(f"  {transport:<6} {rate:10.0f} msg/s  {rate * mb:8.0f} MB/s   (pre-built bytes, {transport})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="time per codec measurement")
    args = ap.parse_args()
    torch.set_num_threads(1)

    ep = make_episode()
    report(
        "episode 64 x 40 tokens",
        encode_episode(ep),
        lambda: decode_episode(decode(encode_episode(ep))),
        build=lambda: encode_episode(ep),
        handle=lambda fr: decode_episode(decode(fr)),
        seconds=args.seconds,
    )

    weights = {"w": torch.randn(1000, 1000)}  # 1M float32 parameters
    report(
        "weights 1M float32",
        encode_weights(weights, 1),
        lambda: decode_weights(decode(encode_weights(weights, 1))),
        build=lambda: encode_weights(weights, 1),
        handle=lambda fr: decode_weights(decode(fr)),
        seconds=args.seconds,
    )


if __name__ == "__main__":
    main()
