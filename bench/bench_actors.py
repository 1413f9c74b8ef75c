"""One learner, hundreds of actors (issue 28): ``asyncrl learn`` on loopback against N simulated
actors in this one process, each speaking the real protocol over its own sockets (a DEALER for
control: hello, welcome, credits, acks; a heartbeat DEALER sending ``status`` every
``--heartbeat`` seconds; a PUSH for episodes), generating an episode the moment it holds a credit
(no model: the learner is the thing measured). Episodes are valid GRPO episodes of the embedded
model's vocabulary (8 trajectories of 24 tokens, 8 generated), tagged with the version of the
credit that asked for them.

Printed per run (N = 1 and N = --actors): the learner's training steps/s, control messages/s
(both ways), episodes/s, the learner's CPU share (of one core) and RSS at the start and end of the
measured window, ack latency p50/p99 (push -> ack), and the share of the learner's wall time spent
ingesting (decode, validate, WAL, ack: its ``ingest_s`` metric). The simulated actors do not
subscribe to weights (at scale that is the per-node relay's job, bench/bench_ray.py).

    .venv/bin/python bench/bench_actors.py [--actors 256 1000] [--seconds 60]

Until 2026-11-27 the simulator made its sockets in one context with libzmq's default cap of 1,023
sockets: at 1,000 actors (2,000 sockets before any episode) it failed after about 500, and the
cleanup's ``Context.term`` then waited for ever on the sockets it had made (the learner saw half
the actors go silent and drop). It now raises the cap and destroys the context.
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

from asyncrl.analysis.jsonl import quiet_records  # noqa: E402
from asyncrl.types import Episode, Trajectory  # noqa: E402
from asyncrl.wire.codec import decode, encode, encode_episode  # noqa: E402
from asyncrl.wire.messages import Hello, Status, Subscribe  # noqa: E402
from asyncrl.wire.sockets import apply_curve_client, make_curve_keys  # noqa: E402


def _episode(actor: str, n: int, version: int, rng) -> list:
    trajs = []
    for k in range(8):
        ids = rng.integers(4, 60, 24)
        mask = np.r_[np.zeros(16), np.ones(8)]
        trajs.append(
            Trajectory(
                ids,
                mask,
                np.where(mask > 0, -1.0, 0.0),
                version,
                reward=float(k % 2),
                group_id=f"{actor}-{n}",
                task_id=f"t{n}",
                text="12",
            )
        )
    return encode_episode(Episode(trajs, actor_id=actor, id=f"{actor}-{n}", created_at=time.time()))


class SimActor:
    def __init__(self, ctx, i: int, control: str, capacity: int, curve: str | None = None):
        self.id, self.capacity, self.curve = f"sim-{i}", capacity, curve
        self.identity = f"{self.id}:{os.getpid()}".encode()
        self.control = self.socket(ctx, zmq.DEALER, self.identity)
        self.control.connect(control)
        self.hb = self.socket(ctx, zmq.DEALER, self.identity + b":hb")
        self.hb.connect(control)
        self.push = None
        self.credits = self.version = self.sent = 0
        self.pending: dict[str, float] = {}
        self.control.send_multipart(encode("hello", Hello(actor_id=self.id, capacity=capacity, pid=os.getpid())))
        self.weights = None  # with --relays: a subscription to its host's relay
        self.weights_version, self.weights_in = -1, 0

    def socket(self, ctx, kind: int, identity: bytes | None = None):
        """A socket to the learner: a CURVE client with this actor's own bundle under ``curve`` (the
        keys' root, off loopback), as ``asyncrl serve`` makes it."""
        sock = ctx.socket(kind)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve:
            apply_curve_client(sock, self.curve, self.id)
        return sock

    def subscribe(self, ctx, relay: str) -> None:
        """Take weights from ``relay`` (an ``asyncrl relay``'s ipc address), as an actor started with
        ``--weights-address`` does: ``subscribe`` with the version held, again after each version."""
        self.weights = ctx.socket(zmq.DEALER)
        self.weights.setsockopt(zmq.IDENTITY, self.identity + b":w")
        self.weights.setsockopt(zmq.LINGER, 0)
        self.weights.connect(relay)
        self.ask_weights()

    def ask_weights(self) -> None:
        self.weights.send_multipart(
            encode("subscribe", Subscribe(actor_id=self.id, have=self.weights_version)), zmq.NOBLOCK
        )

    def on_weights(self, frames) -> None:
        """A version from the relay (ipc: its header only; the tensors stay in the relay's shared memory)."""
        self.weights_version = decode(frames, kinds=("weights",)).body.version
        self.weights_in += 1
        self.ask_weights()

    def status(self) -> None:
        self.hb.send_multipart(
            encode(
                "status",
                Status(
                    actor_id=self.id,
                    identity=self.identity.decode(),
                    capacity=self.capacity,
                    version=self.version,
                    unacked=len(self.pending),
                    credits=self.credits,
                ),
            ),
            zmq.NOBLOCK,
        )


def start_relays(k: int, weights: str, env: dict, workdir: Path) -> tuple[list[subprocess.Popen], list[str]]:
    """``k`` ``asyncrl relay`` processes subscribed to the learner's ``weights`` address; their ipc addresses."""
    procs, addresses = [], []
    for i in range(k):
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "asyncrl",
                "relay",
                "-c",
                "configs/quickstart.yaml",
                "--learner-weights",
                weights,
                "--relay-id",
                f"r{i}",
                "--sock-dir",
                str(workdir / f"relay-{i}"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs.append(p)
        line = p.stdout.readline()
        if not line.startswith("relay listening on "):
            raise RuntimeError(f"relay {i} did not start: {line!r}")
        addresses.append(line.split("relay listening on ", 1)[1].strip())
    return procs, addresses


def simulate(
    ids: list[int],
    control: str,
    relay_addrs: list[str],
    window: tuple[float, float],
    heartbeat: float,
    curve: str | None = None,
    on_window=None,
) -> dict:
    """The simulated actors ``ids``, from now until ``window``'s end (absolute times): hello, status
    every ``heartbeat`` s, an episode per credit, acks timed; with ``relay_addrs`` each subscribes to
    one of them. Counts what happens inside ``window``; ``on_window()`` is called as it opens."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * len(ids) + 64)  # up to four sockets an actor; libzmq default cap: 1,023
    actors: list[SimActor] = []
    try:
        for k, i in enumerate(ids):  # (appended one by one: a failure part way still closes those made)
            actors.append(SimActor(ctx, i, control, capacity=4, curve=curve))
            if relay_addrs:  # actors spread over the relays as over hosts, each host's relay serving its actors
                actors[-1].subscribe(ctx, relay_addrs[k % len(relay_addrs)])
        poller = zmq.Poller()
        by_sock, weights_socks = {}, set()
        for a in actors:
            for sock in (a.control, a.hb, a.weights):
                if sock is not None:
                    poller.register(sock, zmq.POLLIN)
                    by_sock[sock] = a
            if a.weights is not None:
                weights_socks.add(a.weights)
        rng = np.random.default_rng(ids[0] if ids else 0)
        msgs_in = msgs_out = episodes = 0
        latencies: list[float] = []
        next_hb = time.time()
        opened, weights0, cpu0 = False, 0, 0
        while time.time() < window[1]:
            now = time.time()
            if now >= next_hb:
                for a in actors:
                    a.status()
                msgs_out += len(actors)
                next_hb = now + heartbeat
            for sock, _ in poller.poll(20):
                a = by_sock[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    msgs_in += 1
                    if sock in weights_socks:
                        a.on_weights(frames)
                        continue
                    msg = decode(frames)
                    if msg.kind == "welcome" and a.push is None:
                        a.push = a.socket(ctx, zmq.PUSH)
                        a.push.connect(msg.body.addresses["episodes"])
                        a.credits = 0
                    elif msg.kind == "credit":
                        a.credits += msg.body.n
                        a.version = max(a.version, msg.body.min_version)
                    elif msg.kind == "ack":
                        t = time.time()
                        for eid in msg.body.ids:
                            sent = a.pending.pop(eid, None)
                            if sent is not None and opened:
                                latencies.append(t - sent)
            for a in actors:
                while a.push is not None and a.credits > 0:
                    a.sent += 1
                    eid = f"{a.id}-{a.sent}"
                    a.push.send_multipart(_episode(a.id, a.sent, a.version, rng), copy=False)
                    a.pending[eid] = time.time()
                    a.credits -= 1
                    episodes += 1 if opened else 0
                    msgs_out += 1
            if not opened and time.time() >= window[0]:
                opened, weights0, cpu0 = True, sum(a.weights_in for a in actors), _cpu(os.getpid())
                msgs_in = msgs_out = 0
                if on_window:
                    on_window()
        return {
            "msgs": msgs_in + msgs_out,
            "episodes": episodes,
            "latencies": latencies,
            "weights_in": sum(a.weights_in for a in actors) - weights0,
            "cpu_ticks": _cpu(os.getpid()) - cpu0,
            "weights_versions": [a.weights_version for a in actors],
            "actors": len(actors),
        }
    finally:
        ctx.destroy(linger=0)  # every socket of the context closed, then the context (term alone waits for
        # any socket left open, e.g. one made before a failure: it hung here with 1,000 actors)


def _learner_args(workdir: Path, name: str, n_actors: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "asyncrl",
        "learn",
        "-c",
        "configs/quickstart.yaml",
        f"run_root={workdir}",
        f"name={name}",
        "train.total_steps=1000000",
        "eval.every=0",
        "eval.size=8",
        "checkpoint.every=0",
        "log.progress=false",
        "buffer.max_staleness=4",
        f"wire.max_actors={max(n_actors * 2, 16)}",
        "wire.lease_s=30",
        "--overwrite",
    ]


def _wait_addresses(run_dir: Path, learner: subprocess.Popen) -> dict:
    deadline = time.time() + 300
    while not (run_dir / "addresses.json").exists():
        if time.time() > deadline or learner.poll() is not None:
            raise RuntimeError("the learner did not start")
        time.sleep(0.2)
    return json.loads((run_dir / "addresses.json").read_text())


class Snapshot:
    """The learner's counters at one moment: steps, CPU ticks, RSS, ingest seconds, weights sent."""

    def __init__(self, run_dir: Path, pid: int, relay_pids: list[int]):
        self.t, self.steps, self.cpu, self.rss = time.time(), _steps(run_dir), _cpu(pid), _rss(pid)
        self.ingest, (self.sent, self.version) = _ingest(run_dir), _sync(run_dir)
        self.relays_cpu = sum(_cpu(p) for p in relay_pids)


def _row(n_actors: int, relays: int, run_dir: Path, a: Snapshot, b: Snapshot, sims: list[dict]) -> dict:
    tick = os.sysconf("SC_CLK_TCK")
    wall = b.t - a.t
    latencies = [x for r in sims for x in r["latencies"]]
    lat = np.array(latencies) * 1000 if latencies else np.array([np.nan])
    newest = _lines(run_dir)[-1:]  # the learner's last metrics line (its version)
    versions = [v for r in sims for v in r["weights_versions"]]
    return {
        "actors": n_actors,
        "steps_per_s": (b.steps - a.steps) / wall,
        "control_msgs_per_s": sum(r["msgs"] for r in sims) / wall,
        "episodes_per_s": sum(r["episodes"] for r in sims) / wall,
        "learner_cpu": (b.cpu - a.cpu) / tick / wall,
        # what else shares the machine's cores: the simulators, and the relays
        "simulator_cpu": sum(r["cpu_ticks"] for r in sims) / tick / wall,
        "relays_cpu": (b.relays_cpu - a.relays_cpu) / tick / wall,
        "rss_mb_start": a.rss / 1e6,
        "rss_mb_end": b.rss / 1e6,
        "ack_ms_p50": float(np.percentile(lat, 50)),
        "ack_ms_p99": float(np.percentile(lat, 99)),
        "ingest_share": (b.ingest - a.ingest) / wall,
        # with relays: each version reaches the actors through them; the learner sends it once per relay
        "relays": relays,
        "weights_per_actor_per_s": sum(r["weights_in"] for r in sims) / wall / max(n_actors, 1),
        "learner_sends_per_version": (b.sent - a.sent) / max(b.version - a.version, 1) / _weights_bytes(run_dir),
        "actors_on_version_ge_newest_minus_2": (
            sum(v >= newest[0]["version"] - 2 for v in versions) / n_actors if relays and newest else None
        ),
    }


def run(n_actors: int, seconds: float, heartbeat: float, workdir: Path, relays: int = 0) -> dict:
    """One learner on loopback; the simulated actors in this process (and ``relays`` relays)."""
    name = f"n{n_actors}"
    run_dir = workdir / name
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    learner = subprocess.Popen(
        _learner_args(workdir, name, n_actors), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    relay_procs: list[subprocess.Popen] = []
    try:
        addrs = _wait_addresses(run_dir, learner)
        relay_procs, relay_addrs = start_relays(relays, addrs["weights"], env, run_dir) if relays else ([], [])
        start = time.time() + 15.0  # warm-up
        snaps: list[Snapshot] = []
        sim = simulate(
            list(range(n_actors)),
            addrs["control"],
            relay_addrs,
            (start, start + seconds),
            heartbeat,
            on_window=lambda: snaps.append(Snapshot(run_dir, learner.pid, [p.pid for p in relay_procs])),
        )
        end = Snapshot(run_dir, learner.pid, [p.pid for p in relay_procs])
        return _row(n_actors, relays, run_dir, snaps[0], end, [sim])
    finally:
        for p in relay_procs:
            p.terminate()
        learner.terminate()
        for p in [learner, *relay_procs]:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_hosts(n_actors: int, seconds: float, heartbeat: float, workdir: Path, n_hosts: int) -> dict:
    """The learner on namespace host 0 (its own address, CURVE keys), and on each of ``n_hosts``
    more hosts a relay (``asyncrl relay``, its own CURVE key) and a simulator process whose actors
    (spread evenly over the hosts, each with its own CURVE key) subscribe to that host's relay."""
    from asyncrl.testing.netns import Hosts, available

    why = available()
    if why:
        raise SystemExit(f"--hosts: {why}")
    name = f"h{n_actors}"
    run_dir = workdir / name
    keys = workdir / "keys"
    make_curve_keys(str(keys), [f"relay-h{h}" for h in range(1, n_hosts + 1)] + [f"sim-{i}" for i in range(n_actors)])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    logs = workdir / f"logs-{name}"
    logs.mkdir(exist_ok=True)
    with Hosts(n_hosts + 1) as hosts:
        learner = hosts.run(
            0,
            [*_learner_args(workdir, name, n_actors), f"wire.host={hosts.ips[0]}", f"wire.curve_dir={keys / 'server'}"],
            logs / "learner.log",
            env=env,
            cwd=ROOT,
        )
        addrs = _wait_addresses(run_dir, learner)
        relays, relay_addrs = [], []
        for h in range(1, n_hosts + 1):
            relays.append(
                hosts.run(
                    h,
                    [
                        sys.executable,
                        "-m",
                        "asyncrl",
                        "relay",
                        "-c",
                        "configs/quickstart.yaml",
                        "--learner-weights",
                        addrs["weights"],
                        "--relay-id",
                        f"h{h}",
                        "--sock-dir",
                        str(workdir / f"relay-{name}-{h}"),
                        f"wire.curve_dir={keys}",
                    ],
                    logs / f"relay-{h}.log",
                    env=env,
                    cwd=ROOT,
                )
            )
        for h, p in enumerate(relays, start=1):
            deadline = time.time() + 120
            while "relay listening on " not in (logs / f"relay-{h}.log").read_text():
                if time.time() > deadline or p.poll() is not None:
                    raise RuntimeError(f"relay {h} did not start: {(logs / f'relay-{h}.log').read_text()[-1000:]}")
                time.sleep(0.2)
            line = next(x for x in (logs / f"relay-{h}.log").read_text().splitlines() if "relay listening on " in x)
            relay_addrs.append(line.split("relay listening on ", 1)[1].strip())
        start = time.time() + 20.0 + n_actors / 100  # warm-up (each actor's CURVE handshakes take a moment)
        sims = []
        for h in range(1, n_hosts + 1):
            spec = {
                "ids": list(range(h - 1, n_actors, n_hosts)),
                "control": addrs["control"],
                "relays": [relay_addrs[h - 1]],
                "window": [start, start + seconds],
                "heartbeat": heartbeat,
                "curve": str(keys),
            }
            (workdir / f"sim-{name}-{h}.json").write_text(json.dumps(spec))
            sims.append(
                hosts.run(
                    h,
                    [
                        sys.executable,
                        str(Path(__file__).resolve()),
                        "--simulate",
                        str(workdir / f"sim-{name}-{h}.json"),
                    ],
                    logs / f"sim-{h}.log",
                    env=env,
                    cwd=ROOT,
                )
            )
        relay_pids = [p.pid for p in relays]
        while time.time() < start:
            time.sleep(0.05)
        a = Snapshot(run_dir, learner.pid, relay_pids)
        while time.time() < start + seconds:
            time.sleep(0.05)
        b = Snapshot(run_dir, learner.pid, relay_pids)
        results = []
        for h, p in enumerate(sims, start=1):
            p.wait(timeout=300)
            out = workdir / f"sim-{name}-{h}.json.out"
            if not out.exists():
                raise RuntimeError(
                    f"simulator on host {h} wrote nothing: {(logs / f'sim-{h}.log').read_text()[-2000:]}"
                )
            results.append(json.loads(out.read_text()))
        row = _row(n_actors, n_hosts, run_dir, a, b, results)
        row["hosts"] = n_hosts
        return row


def simulate_main(spec_path: str) -> None:
    """``--simulate SPEC``: one host's simulator (run_hosts starts it there); writes SPEC.out."""
    spec = json.loads(Path(spec_path).read_text())
    result = simulate(
        spec["ids"], spec["control"], spec["relays"], tuple(spec["window"]), spec["heartbeat"], curve=spec.get("curve")
    )
    Path(spec_path + ".out").write_text(json.dumps(result))


def _lines(run_dir: Path) -> list[dict]:
    return quiet_records(run_dir / "metrics.jsonl")


def _steps(run_dir: Path) -> int:
    m = _lines(run_dir)
    return m[-1]["step"] if m else 0


def _ingest(run_dir: Path) -> float:
    m = _lines(run_dir)
    return m[-1].get("ingest_s", 0.0) if m else 0.0


def _sync(run_dir: Path) -> tuple[float, int]:
    """(the learner's weight bytes sent so far, its version), from its last metrics line."""
    m = _lines(run_dir)
    return (m[-1].get("sync/bytes_sent", 0.0), m[-1]["version"]) if m else (0.0, 0)


def _weights_bytes(run_dir: Path) -> float:
    """The bytes of one version's tensors (its ``weights_published`` event)."""
    for e in reversed(quiet_records(run_dir / "events.jsonl")):
        if e.get("kind") == "weights_published":
            return float(e["bytes"])
    return float("nan")


def _cpu(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--actors",
        type=int,
        nargs="+",
        default=[256, 1000],
        help="actor counts to measure beside the one-actor baseline",
    )
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--heartbeat", type=float, default=2.0, help="seconds between an actor's status messages")
    ap.add_argument(
        "--hosts",
        type=int,
        default=0,
        help=(
            "spread the actors over this many network-namespace hosts (as root), each with a relay and a simulator "
            "process, the learner on a host of its own with CURVE keys (replaces --relays)"
        ),
    )
    ap.add_argument("--simulate", help=argparse.SUPPRESS)
    ap.add_argument(
        "--relays",
        type=int,
        default=0,
        help=(
            "weight relays (asyncrl relay processes, as one per host) that the simulated actors subscribe to, "
            "spread evenly; 0: no weight subscriptions"
        ),
    )
    a = ap.parse_args()
    if a.simulate:
        return simulate_main(a.simulate)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for n in (1, *a.actors):
            if a.hosts:
                rows.append(run_hosts(n, a.seconds, a.heartbeat, Path(d), n_hosts=min(a.hosts, n)))
            else:
                rows.append(run(n, a.seconds, a.heartbeat, Path(d), relays=min(a.relays, n)))
            print(json.dumps(rows[-1]), flush=True)
    one = rows[0]
    print(
        f"\n{'actors':>7} {'steps/s':>8} {'ctl msg/s':>10} {'episodes/s':>11} {'CPU':>5} {'RSS MB start->end':>18} "
        f"{'ack p50/p99 ms':>15} {'ingest':>7} {'relays':>6} {'sends/version':>13} {'versions/actor/s':>16} "
        f"{'sim+relay CPU':>13}"
    )
    for r in rows:
        print(
            f"{r['actors']:7d} {r['steps_per_s']:8.2f} {r['control_msgs_per_s']:10.0f} {r['episodes_per_s']:11.1f} "
            f"{r['learner_cpu']:5.2f} {r['rss_mb_start']:8.0f} -> {r['rss_mb_end']:6.0f} "
            f"{r['ack_ms_p50']:7.1f}/{r['ack_ms_p99']:<7.1f} {100 * r['ingest_share']:6.1f}% {r['relays']:6d} "
            f"{r['learner_sends_per_version']:13.2f} {r['weights_per_actor_per_s']:16.2f} "
            f"{r['simulator_cpu']:6.2f}+{r['relays_cpu']:<6.2f}"
        )
    for many in rows[1:]:
        print(f"steps/s with {many['actors']} actors / with 1: {many['steps_per_s'] / one['steps_per_s']:.2f}x")


if __name__ == "__main__":
    main()
