"""Peers that misbehave: attack a live learner on loopback and print what happened.

    .venv/bin/python bench/bench_faults.py [SCENARIO ...] [--root TREE]

Scenarios (all by default): ``crafted`` (nine crafted messages, each against a fresh learner),
``poison`` (an episode with a token id past the vocabulary), ``hellos`` (200 hellos that vanish,
then a real actor), ``staleness0`` (an actor killed at ``max_staleness 0`` and a new one started),
``subscribers`` (20 weight subscribers that never read), ``bomb`` (a 5 MB msgpack bomb and a
64 MiB frame), ``flood`` (garbage while an actor trains), ``enospc`` (metrics.jsonl on /dev/full).

Everything goes through the ``asyncrl`` command line and raw ZeroMQ + msgpack frames, so the same
script measures any checkout (``--root``): before and after a change, on the same machine. It prints
figures (survived or exit code, versions trained, seconds, RSS, bytes); it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from asyncrl.testing.peer_attacks import (
    LiveRun,
    ScriptedActor,
    connect,
    crafted,
    episode_frames,
    frames,  # noqa: E402
    small_disk,
)

TINY = [
    "model.embedded.hidden_size=32",
    "model.embedded.num_layers=1",
    "model.embedded.num_heads=2",
    "model.embedded.intermediate_size=64",
    "model.embedded.warmup_steps=20",
    "model.embedded.warmup_batch_size=16",
    "model.embedded.warmup_lr=3e-3",
]
COMMON = [
    "sampling.n=4",
    "sampling.max_new_tokens=4",
    "actor.tasks_per_batch=4",
    "train.batch_tasks=4",
    "train.lr=1e-3",
    "eval.size=8",
    "eval.every=0",
    "log.progress=false",
    "checkpoint.every=0",
    "actor.heartbeat_s=0.5",
]


def Run(root: Path, tmp: Path, name: str, extra: list[str], learner_prefix: list[str] = ()) -> LiveRun:
    """A live run of ``root``'s code with the tiny embedded model (cached beside ``tmp``)."""
    return LiveRun(
        tmp,
        name,
        [f"model.embedded.cache_dir={tmp.parent / 'models'}", *TINY, *COMMON, *extra],
        root=root,
        learner_prefix=learner_prefix,
    )


def schema(root: Path) -> int:
    out = subprocess.run(
        [sys.executable, "-c", "from asyncrl.wire.codec import SCHEMA_VERSION as s; print(s)"],
        env=dict(os.environ, PYTHONPATH=str(root)),
        capture_output=True,
        text=True,
        cwd=root,
    )
    return int(out.stdout.strip())


def send(addrs: dict, channel: str, msg: list) -> zmq.Socket:
    s = connect(zmq.PUSH if channel == "episodes" else zmq.DEALER, addrs[channel])
    s.send_multipart(msg)
    return s


# --- scenarios -------------------------------------------------------------------------------


def sc_crafted(root: Path, tmp: Path) -> None:
    sv = schema(root)
    for i, (name, channel, msg) in enumerate(crafted(sv)):
        run = Run(root, tmp, f"crafted{i}", ["train.total_steps=3"])
        try:
            s = send(run.addresses, channel, msg)
            died = run.died(8)
            outcome = (
                f"learner DIED (exit {run.learner.returncode}): {run.log_tail()}" if died else "learner alive after 8 s"
            )
            if not died:
                run.actor()
                trained = run.wait_version(3, 180)
                outcome += f"; then trained to version 3: {'yes' if trained is not None else 'NO'}"
            s.close()
        finally:
            run.stop()
        print(f"  crafted {i + 1} {name} ({channel}): {outcome}", flush=True)


def sc_poison(root: Path, tmp: Path) -> None:
    sv = schema(root)
    run = Run(root, tmp, "poison", ["train.total_steps=3", "train.batch_tasks=1"])
    try:
        actor = ScriptedActor(run.addresses, sv, "evil", capacity=1)
        actor.send(episode_frames(sv, "evil", "poison-1", token=10**6))
        deadline = time.time() + 10
        while time.time() < deadline and not (actor.acked or actor.rejected):
            actor.read_acks()
        died = run.died(30)
        wal = b"".join(p.read_bytes() for p in (run.dir / "buffer").glob("wal-*.bin"))
        print(
            f"  poisoned episode (token id 10**6): acked {sorted(actor.acked)}, rejected {actor.rejected}, "
            f"in the WAL: {b'poison-1' in wal}, learner "
            f"{'DIED (exit %s): %s' % (run.learner.returncode, run.log_tail()) if died else 'alive'}",
            flush=True,
        )
        if died:  # does a restart replay it?
            run.procs.remove(run.learner)
            run.learner = run.start("learn", [], "learner2")
            died2 = run.died(60)
            print(
                f"  restart: {'DIED again (exit %s): %s' % (run.learner.returncode, run.log_tail('learner2')) if died2 else 'alive'}",
                flush=True,
            )
        actor.close()
    finally:
        run.stop()


def sc_hellos(root: Path, tmp: Path) -> None:
    sv = schema(root)
    run = Run(root, tmp, "hellos", ["train.total_steps=400"])
    try:
        fakes = [
            send(run.addresses, "control", frames(sv, "hello", {"actor_id": f"fake{i}", "capacity": 8}))
            for i in range(200)
        ]
        time.sleep(2)
        for f in fakes:
            f.close()
        run.actor()
        t = run.wait_version(1, 90)
        print(
            f"  200 vanished hellos, then a real actor: first step after "
            f"{'%.1f s' % t if t is not None else 'NONE within 90 s'}; version now {run.version()}",
            flush=True,
        )
    finally:
        run.stop()


def sc_staleness0(root: Path, tmp: Path) -> None:
    run = Run(root, tmp, "stale0", ["train.total_steps=400", "buffer.max_staleness=0"])
    try:
        a = run.actor()
        run.wait_version(2, 180)
        a.send_signal(signal.SIGKILL)
        a.wait()
        v = run.version()
        run.actor("actor-1", 1)
        t = run.wait_version(v + 2, 90)
        print(
            f"  max_staleness 0, actor killed at version {v}, new actor started: two more steps after "
            f"{'%.1f s' % t if t is not None else 'NONE within 90 s'}; version now {run.version()}",
            flush=True,
        )
    finally:
        run.stop()


def sc_subscribers(root: Path, tmp: Path) -> None:
    sv = schema(root)
    run = Run(
        root,
        tmp,
        "subs",
        [
            "train.total_steps=100000",
            "model.embedded.hidden_size=128",
            "model.embedded.intermediate_size=512",
            "model.embedded.num_heads=4",
        ],
    )
    try:
        run.actor()
        run.wait_version(3, 300)
        rss0, v0 = run.rss_mb(), run.version()
        subs = [
            send(run.addresses, "weights", frames(sv, "subscribe", {"actor_id": f"s{i}", "have": -1}))
            for i in range(20)
        ]
        for s in subs:
            s.setsockopt(zmq.RCVBUF, 4096)
        time.sleep(60)
        print(
            f"  20 subscribers that never read, 60 s: learner RSS {rss0:.0f} -> {run.rss_mb():.0f} MB over "
            f"{run.version() - v0} published versions",
            flush=True,
        )
        for s in subs:
            s.close()
    finally:
        run.stop()


def _watch(run: LiveRun, seconds: float) -> tuple[float, float]:
    """(longest gap between training steps, peak learner RSS in MB) over the next ``seconds``."""
    t_end, peak, last_v, last_t, gap = time.time() + seconds, 0.0, run.version(), time.time(), 0.0
    while time.time() < t_end and run.learner.poll() is None:
        peak = max(peak, run.rss_mb())
        v = run.version()
        if v != last_v:
            gap, last_v, last_t = max(gap, time.time() - last_t), v, time.time()
        time.sleep(0.05)
    return max(gap, time.time() - last_t), peak


def sc_bomb(root: Path, tmp: Path) -> None:
    sv = schema(root)
    run = Run(root, tmp, "bomb", ["train.total_steps=100000"])
    try:
        run.actor()
        run.wait_version(3, 300)
        bomb = episode_frames(sv, "bomb", "bomb-1", decision={"x": [[{}] * 60000 for _ in range(80)]})
        big = frames(sv, "episode", {}, [{"name": "x", "dtype": "uint8", "shape": [64 << 20]}], [b"\0" * (64 << 20)])
        for name, msg in (("5 MB msgpack bomb (episode decision of 4.8 M empty maps)", bomb), ("64 MiB frame", big)):
            _, rss0 = _watch(run, 2)
            s = send(run.addresses, "episodes", msg)
            gap, peak = _watch(run, 20)
            print(
                f"  {name}: longest pause between steps {gap:.1f} s over 20 s, learner RSS {rss0:.0f} -> "
                f"peak {peak:.0f} MB, learner {'alive' if run.learner.poll() is None else 'DIED'}",
                flush=True,
            )
            s.close()
    finally:
        run.stop()


def sc_flood(root: Path, tmp: Path) -> None:
    run = Run(root, tmp, "flood", ["train.total_steps=100000"])
    try:
        run.actor()
        run.wait_version(3, 300)
        v0, t0 = run.version(), time.time()
        time.sleep(20)
        quiet = (run.version() - v0) / (time.time() - t0)
        ev0 = (run.dir / "events.jsonl").stat().st_size
        socks = [
            connect(zmq.PUSH, run.addresses["episodes"]),
            connect(zmq.DEALER, run.addresses["control"]),
            connect(zmq.DEALER, run.addresses["weights"]),
        ]
        v0, t0, sent = run.version(), time.time(), 0
        rng = np.random.default_rng(0)
        while time.time() - t0 < 20:
            for s in socks:
                try:
                    s.send(rng.bytes(int(rng.integers(1, 200))), zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
        flood = (run.version() - v0) / (time.time() - t0)
        time.sleep(12)  # one summary period of the rate-limited log (wire.bad_log_every_s)
        ev = (run.dir / "events.jsonl").stat().st_size - ev0
        lines = (run.dir / "events.jsonl").read_bytes()[ev0:].splitlines()
        about = [ln for ln in lines if b'"bad_message"' in ln[:80] or b'"messages_suppressed"' in ln[:80]]
        print(
            f"  garbage flood 20 s ({sent} frames): steps/s {quiet:.2f} quiet -> {flood:.2f} flooded; "
            f"events.jsonl +{ev / 1e6:.1f} MB, of which {len(about)} lines / {sum(map(len, about)) / 1e3:.0f} kB "
            f"about bad messages; learner {'alive' if run.learner.poll() is None else 'DIED'}",
            flush=True,
        )
        for s in socks:
            s.close()
    finally:
        run.stop()


def sc_enospc(root: Path, tmp: Path) -> None:
    run = Run(root, tmp, "enospc", ["train.total_steps=100000"], learner_prefix=small_disk(tmp / "enospc" / "buffer"))
    try:
        actor = run.actor()
        died = run.died(180)
        stops = run.events("learner_stop")
        time.sleep(40)  # past the actor's default actor.learner_timeout_s (30 s)
        log = (run.logs / "enospc-learner.log").read_text(errors="replace")
        print(
            f"  WAL on a full 48 KiB tmpfs: learner {'exit %s' % run.learner.returncode if died else 'alive'} at "
            f"version {run.version()}; traceback printed: {'Traceback' in log}; learner_stop event: "
            f"{stops[-1].get('reason') if stops else None}; last line: {run.log_tail()!r}",
            flush=True,
        )
        alog = (run.logs / "enospc-actor-0.log").read_text(errors="replace")
        said = [ln for ln in alog.splitlines() if "learner" in ln]
        print(
            f"  the actor 40 s later: {'running' if actor.poll() is None else 'exit %s' % actor.returncode}; "
            f"lines about the learner: {said[-2:]}",
            flush=True,
        )
    finally:
        run.stop()


def sc_public(root: Path, tmp: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl",
            "learn",
            f"run_root={tmp}",
            "wire.host=0.0.0.0",
            f"model.embedded.cache_dir={tmp.parent / 'models'}",
            *TINY,
        ],
        env=dict(os.environ, PYTHONPATH=str(root)),
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    out = (res.stdout + res.stderr).strip().splitlines()
    print(
        f"  asyncrl learn wire.host=0.0.0.0 (no keys): exit {res.returncode}, {len(out)} lines, traceback: "
        f"{any('Traceback' in ln for ln in out)}; last: {out[-1][:160] if out else ''!r}",
        flush=True,
    )


SCENARIOS = {
    "crafted": sc_crafted,
    "poison": sc_poison,
    "hellos": sc_hellos,
    "staleness0": sc_staleness0,
    "subscribers": sc_subscribers,
    "bomb": sc_bomb,
    "flood": sc_flood,
    "enospc": sc_enospc,
    "public": sc_public,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", default=[], help=f"any of {list(SCENARIOS)}")
    ap.add_argument("--root", default=str(HERE), help="the checkout to run (default: this one)")
    args = ap.parse_args()
    root = Path(args.root).resolve()
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; expected any of {list(SCENARIOS)}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenarios or list(SCENARIOS):
            print(f"== {name} ({root})", flush=True)
            (Path(tmp) / name).mkdir()
            SCENARIOS[name](root, Path(tmp) / name)


if __name__ == "__main__":
    main()
