"""Core benchmark: learner ingest vs raw pyzmq, weight publish -> applied latency, async vs sync.

    .venv/bin/python bench/bench_core.py [--steps 40] [--episodes 2000] [--skip-runs | --only-runs]
    .venv/bin/python bench/bench_core.py --only-runs --steps 300 --threads 1,1 2,1 2,2   # thread pairs

Prints three tables:
1. Learner ingest: episodes sent by a PUSH in another process (as an actor's are) and received by
   the learner's real path (PULL -> decode -> validate -> WAL append -> fsync per poll -> ack), by the
   floor of any checked and durable ingest (PULL -> decode checked against the wire schema -> append
   to a file -> fsync per batch of up to 256), by the same without the decode (PULL -> append ->
   fsync), and by a bare pyzmq receive of the same bytes, each as a ratio to the bare one; then the learner path's stages timed one by one (microseconds per
   episode, no sockets): decode, validate, WAL append, fsync (one per 256 episodes, as one poll).
2. Weight sync: time from ``publish_weights`` on the learner to the new weights applied in an actor
   process's engine (the embedded demo model), over loopback.
3. Wall time for the same number of optimizer steps with the quick-start config, asynchronous
   (max_staleness 1) versus synchronous (max_staleness 0), plus completions per second; with
   ``--threads``, sync and async for each pair of learner/actor torch thread counts instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import load_config  # noqa: E402
from asyncrl.learner.ingest.buffer import EpisodeQueue  # noqa: E402
from asyncrl.learner.ingest.peers import EpisodeValidator  # noqa: E402
from asyncrl.learner.ingest.server import LearnerServer  # noqa: E402
from asyncrl.lifecycle import freeze_startup_heap  # noqa: E402
from asyncrl.rundir.record_file import encode_record  # noqa: E402
from asyncrl.types import Episode, Task, Trajectory  # noqa: E402
from asyncrl.wire.codec import decode, decode_weights, encode_episode, encode_msg, encode_weights  # noqa: E402
from asyncrl.wire.sockets import bind  # noqa: E402


def demo_episode(n_traj: int, prompt_len: int, gen_len: int, rng) -> Episode:
    task = Task(id="arith:12+34", prompt=[{"role": "user", "content": "12+34="}], answer=46)
    T = prompt_len + gen_len
    mask = np.r_[np.zeros(prompt_len), np.ones(gen_len)]
    trajs = [
        Trajectory(
            token_ids=rng.integers(0, 100, T),
            loss_mask=mask,
            behavior_logprobs=-rng.random(T) * mask,
            policy_version=0,
            reward=float(i % 2),
            scores={"reward": float(i % 2)},
            group_id="g",
            task_id=task.id,
            text="46",
        )
        for i in range(n_traj)
    ]
    return Episode(trajectories=trajs, actor_id="bench", task=task)


def encoded_episodes(n: int, n_traj: int, prompt_len: int, gen_len: int) -> list[list]:
    rng = np.random.default_rng(0)
    return [encode_episode(demo_episode(n_traj, prompt_len, gen_len, rng)) for _ in range(n)]


def send_episodes(address: str, go_address: str, n: int, n_traj: int, prompt_len: int, gen_len: int) -> None:
    """The sender process: encodes ``n + 1`` episodes, connects a PUSH to ``address``, sends the
    first (a warm-up), waits for a message on ``go_address`` and sends the other ``n``."""
    encoded = encoded_episodes(n + 1, n_traj, prompt_len, gen_len)
    ctx = zmq.Context()
    push, go = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    go.connect(go_address)
    push.connect(address)
    push.send_multipart(encoded[0], copy=False)
    if not go.poll(120_000):
        raise SystemExit("bench sender: no go from the receiver within 120 s")
    go.recv()
    for frames in encoded[1:]:
        push.send_multipart(frames, copy=False)
    push.close(linger=-1)  # until all are delivered
    ctx.destroy(0)


def _receive(address: str, n: int, shape: tuple, take) -> float:
    """Episodes per second received by ``take`` (called as ``take(timeout_ms) -> count`` until
    ``n`` arrived) from a sender in another process, as actors are; timed from the go sent after
    the warm-up episode to the last episode, so the sender's start-up is not counted."""
    ctx = zmq.Context()
    go = ctx.socket(zmq.PUSH)
    go.linger = 0
    proc = subprocess.Popen(
        [sys.executable, __file__, "--send", address, bind(go, "127.0.0.1", 0), str(n), *map(str, shape)]
    )
    try:
        got = 0
        while got == 0:
            got = take(120_000)  # the warm-up episode
        t0 = time.perf_counter()
        go.send(b"go")
        got = 0
        while got < n:
            got += take(60_000)
        elapsed = time.perf_counter() - t0
        proc.wait(60)
    finally:
        proc.kill()
        ctx.destroy(0)
    return n / elapsed


def _draining(pull, handle=None, fd: int | None = None):
    """A ``take`` for :func:`_receive`: every message waiting on ``pull`` (at most 256, as in one
    learner poll), each passed to ``handle``, then one fsync of ``fd``."""

    def take(timeout_ms: int) -> int:
        if not pull.poll(timeout_ms):
            return 0
        got = 0
        while got < 256:
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if handle is not None:
                handle(frames)
            got += 1
        if fd is not None:
            os.fsync(fd)
        return got

    return take


def bench_ingest(n: int, n_traj: int, prompt_len: int, gen_len: int) -> dict:
    """Four receivers of the same episodes from a sender process: the learner's real path; the
    least any checked and durable ingest must do (receive, decode and check the message against the
    wire schema, append it to a file, fsync per batch); the same without the check (receive and
    write); and a bare pyzmq receive."""
    shape = (n_traj, prompt_len, gen_len)
    nbytes = sum(memoryview(f).nbytes for f in encoded_episodes(1, *shape)[0])
    cfg = load_config(None)
    with tempfile.TemporaryDirectory() as tmp:
        net = LearnerServer(cfg.wire, lambda ch, err: print("bad message:", err))
        validator = EpisodeValidator(vocab_size=128, limits=net.limits)
        buf = EpisodeQueue(Path(tmp), capacity=10**9)
        buf.open_wal(0)

        def learner_take(timeout_ms: int) -> int:  # what the learner's loop does per poll
            arrivals, _ = net.poll(timeout_ms)
            got = 0
            for arrival in arrivals:
                problem = validator.check(arrival, version=0)
                if problem is not None:
                    raise RuntimeError(f"bench episode rejected: {problem}")
                got += buf.add(arrival.episode, arrival.frames)
            buf.sync()
            net.ack({"bench": [a.episode.id for a in arrivals]})
            return got

        learner_rate = _receive(net.addresses["episodes"], n, shape, learner_take)
        net.close()
        header_bytes = net.limits.header_bytes  # the learner's own bound on an episode header

        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        address = bind(pull, "127.0.0.1", 0)
        fd = os.open(Path(tmp) / "floor.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

        def check_and_write(frames) -> None:
            decode(frames, max_header_bytes=header_bytes, kinds=("episode",))
            os.write(fd, encode_record(frames))

        floor_rate = _receive(address, n, shape, _draining(pull, check_and_write, fd))
        write_rate = _receive(address, n, shape, _draining(pull, lambda fr: os.write(fd, encode_record(fr)), fd))
        os.close(fd)
        raw_rate = _receive(address, n, shape, _draining(pull))
        ctx.destroy(0)
    return {
        "trajectories/episode": n_traj,
        "bytes/episode": nbytes,
        "episodes": n,
        "learner_episodes_per_s": learner_rate,
        "learner_MB_per_s": learner_rate * nbytes / 1e6,
        "floor_episodes_per_s": floor_rate,
        "write_only_episodes_per_s": write_rate,
        "raw_pyzmq_msgs_per_s": raw_rate,
        "raw_MB_per_s": raw_rate * nbytes / 1e6,
        "ratio_learner_to_raw": learner_rate / raw_rate,
        "ratio_floor_to_raw": floor_rate / raw_rate,
        "ratio_write_only_to_raw": write_rate / raw_rate,
    }


def ingest_stages(n: int, n_traj: int, prompt_len: int, gen_len: int) -> dict:
    """Microseconds per episode of each stage of the learner's ingest path, timed on its own over
    ``n`` pre-received episodes (no sockets), in the order the learner runs them."""
    rng = np.random.default_rng(0)
    received = [
        [zmq.Frame(bytes(memoryview(f))) for f in encode_episode(demo_episode(n_traj, prompt_len, gen_len, rng))]
        for _ in range(n)
    ]
    cfg = load_config(None)
    net = LearnerServer(cfg.wire, lambda ch, err: print("bad message:", err))
    validator = EpisodeValidator(vocab_size=128, limits=net.limits)
    arrivals = []
    t0 = time.perf_counter()
    for frames in received:
        net._take_episode(frames, arrivals)  # what LearnerServer.poll does with each episode message
    t1 = time.perf_counter()
    for arrival in arrivals:
        if validator.check(arrival, version=0) is not None:
            raise RuntimeError("bench episode rejected")
    t2 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        buf = EpisodeQueue(Path(tmp), capacity=10**9)
        buf.open_wal(0)
        write = sync = 0.0
        for i in range(0, n, 256):
            t3 = time.perf_counter()
            for arrival in arrivals[i : i + 256]:
                buf.add(arrival.episode, arrival.frames)
            t4 = time.perf_counter()
            buf.sync()
            write, sync = write + t4 - t3, sync + time.perf_counter() - t4
    net.close()
    us = 1e6 / n
    return {
        "trajectories/episode": n_traj,
        "decode_us": (t1 - t0) * us,
        "validate_us": (t2 - t1) * us,
        "wal_append_us": write * us,
        "fsync_us": sync * us,
    }


def weights_probe(address: str, rounds: int) -> None:
    """Runs in the actor-side process: apply every weights message, report the time applied."""
    import torch

    from asyncrl.engine.hf import HFEngine
    from asyncrl.models.loading import load_policy

    torch.set_num_threads(1)
    model, tok, _ = load_policy(load_config(None).model)
    engine = HFEngine(model, tok)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send_multipart(encode_msg("subscribe", actor_id="probe", have=-1))
    for _ in range(rounds + 1):
        version, tensors = decode_weights(decode(sock.recv_multipart(copy=False)))
        engine.update_weights(tensors, version)
        sock.send_multipart(encode_msg("subscribe", actor_id="probe", have=version, applied_at=time.time()))
    sock.close(0)
    ctx.destroy(0)


def bench_weights(rounds: int) -> dict:
    import torch

    from asyncrl.models.loading import load_policy

    cfg = load_config(None)
    model, _, _ = load_policy(cfg.model)
    state = {k: v.detach().contiguous() for k, v in model.named_parameters()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    applied: dict[int, float] = {}

    def record(channel, err):
        raise RuntimeError(err)

    net = LearnerServer(cfg.wire, record)
    orig = net.subscribers.on_subscribe

    def on_subscribe(identity, body):
        if body.applied_at is not None:
            applied[body.have] = body.applied_at
        orig(identity, body)

    net.subscribers.on_subscribe = on_subscribe
    net.subscribers.publish(encode_weights(state, 0), 0)
    probe = subprocess.Popen([sys.executable, __file__, "--probe", net.addresses["weights"], str(rounds)])
    sent: dict[int, float] = {}
    while 0 not in applied:
        net.poll(100)
    for v in range(1, rounds + 1):
        with torch.no_grad():
            for t in state.values():
                t.add_(1e-6)
        sent[v] = time.time()
        net.subscribers.publish(encode_weights(state, v), v)
        while v not in applied:
            net.poll(100)
    probe.wait(timeout=60)
    net.close()
    lat = np.array([applied[v] - sent[v] for v in range(1, rounds + 1)]) * 1000
    return {
        "weights_MB": nbytes / 1e6,
        "rounds": rounds,
        "publish_to_applied_ms_median": float(np.median(lat)),
        "publish_to_applied_ms_p90": float(np.percentile(lat, 90)),
    }


DEFAULT_RUNS = (
    ("sync (max_staleness 0)", ["buffer.max_staleness=0"]),
    ("async (max_staleness 1)", ["buffer.max_staleness=1"]),
    ("async, 2 actors (max_staleness 2)", ["buffer.max_staleness=2", "actor.num=2"]),
)


def thread_runs(pairs: list[str]) -> list[tuple[str, list[str]]]:
    """Sync and async runs for each ``LEARNER,ACTOR`` torch thread pair (``auto`` allowed)."""
    out = []
    for pair in pairs:
        learner, _, actor = pair.partition(",")
        for label, staleness in (("sync", 0), ("async", 1)):
            out.append(
                (
                    f"{label}, threads learner {learner} / actor {actor}",
                    [f"buffer.max_staleness={staleness}", f"train.threads={learner}", f"actor.threads={actor}"],
                )
            )
    return out


def bench_runs(steps: int, runs=DEFAULT_RUNS) -> list[dict]:
    rows = []
    for label, overrides in runs:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable,
                "-m",
                "asyncrl",
                "run",
                "-c",
                str(ROOT / "configs/quickstart.yaml"),
                f"run_root={tmp}",
                "name=bench",
                f"train.total_steps={steps}",
                *overrides,
                "eval.every=0",
                "eval.size=1",
                "log.progress=false",
                "checkpoint.every=0",
            ]
            t0 = time.time()
            subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
            wall = time.time() - t0
            metrics = [json.loads(line) for line in open(Path(tmp) / "bench" / "metrics.jsonl")]
            events = [json.loads(line) for line in open(Path(tmp) / "bench" / "events.jsonl")]
        start = next(e["t"] for e in events if e["kind"] == "learner_start")
        loop = metrics[-1]["t"] - start
        samples = sum(m["batch_trajectories"] for m in metrics)
        rows.append(
            {
                "mode": label,
                "steps": len(metrics),
                "process_wall_s": wall,
                "train_loop_wall_s": loop,
                "completions_per_s": samples / loop,
                "max_staleness_seen": max(m["staleness_max"] for m in metrics),
                "reward_first_10pct": float(np.mean([m["reward_mean"] for m in metrics[: max(1, steps // 10)]])),
                "reward_last_10pct": float(np.mean([m["reward_mean"] for m in metrics[-max(1, steps // 10) :]])),
            }
        )
    return rows


def _print(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    for r in rows:
        print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--skip-runs", action="store_true")
    ap.add_argument("--only-runs", action="store_true", help="just the quick-start runs")
    ap.add_argument(
        "--threads",
        nargs="*",
        metavar="LEARNER,ACTOR",
        help="instead of the default runs: sync and async runs for each torch thread pair, e.g. 1,1 2,1",
    )
    ap.add_argument("--probe", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--send", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument(
        "--default-gc",
        action="store_true",
        help="keep Python's collector settings (asyncrl learn freezes its start-up heap: asyncrl.lifecycle)",
    )
    args = ap.parse_args()
    if args.probe:
        weights_probe(args.probe[0], int(args.probe[1]))
        return
    if args.send:
        send_episodes(args.send[0], args.send[1], *map(int, args.send[2:]))
        return
    if not args.only_runs:
        if not args.default_gc:
            freeze_startup_heap()  # as asyncrl learn does once its model is built
        _print(
            "learner ingest (PULL -> decode -> validate -> WAL + fsync -> ack) vs the floor (PULL -> schema check "
            "-> file + fsync) vs raw pyzmq; same bytes from a sender process, same run",
            [bench_ingest(args.episodes, 8, 8, 6), bench_ingest(args.episodes // 4, 64, 40, 40)],
        )
        _print(
            "learner ingest stages, microseconds per episode (no sockets)",
            [ingest_stages(args.episodes, 8, 8, 6), ingest_stages(args.episodes // 4, 64, 40, 40)],
        )
        _print(
            "weight sync: publish on the learner -> applied in an actor process (embedded demo model)",
            [bench_weights(args.rounds)],
        )
    if not args.skip_runs:
        runs = thread_runs(args.threads) if args.threads else DEFAULT_RUNS
        _print(f"quick-start config, {args.steps} steps: async vs synchronous", bench_runs(args.steps, runs))


if __name__ == "__main__":
    main()
