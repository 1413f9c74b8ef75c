"""Misbehaving peers against a live learner, shared by tests/e2e/test_faults_peers.py and
bench/bench_faults.py: crafted frames built with raw msgpack (so they reach the learner whatever
the sending side's codec would allow), a scripted actor on real sockets, and a run of real
``asyncrl`` processes over loopback that is always stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

ROOT = Path(__file__).resolve().parents[2]  # the checkout (asyncrl/testing/ is two levels down)


# --- frames ------------------------------------------------------------------------------------


def frames(schema: int, kind: str, body: dict, arrays: list | None = None, bufs: list | None = None) -> list:
    """A message as raw frames: the msgpack header and the array buffers, unchecked."""
    header = {"schema": schema, "kind": kind, "body": body, "arrays": arrays or []}
    return [msgpack.packb(header, use_bin_type=True), *(bufs or [])]


def deep(n: int):
    """A list nested ``n`` levels deep."""
    v: object = 0
    for _ in range(n):
        v = [v]
    return v


def crafted(schema: int) -> list[tuple[str, str, list]]:
    """(name, channel, frames): nine messages that each stopped the learner before issue 19."""
    st = {"actor_id": "x", "identity": "x", "capacity": 1, "version": 0}
    return [
        ("hello capacity 'lots'", "control", frames(schema, "hello", {"actor_id": "x", "capacity": "lots"})),
        ("hello capacity null", "control", frames(schema, "hello", {"actor_id": "x", "capacity": None})),
        ("status with a 'kind' key", "control", frames(schema, "status", {**st, "kind": "boom"})),
        ("status with a bytes value", "control", frames(schema, "status", {**st, "note": b"\x00\xff"})),
        ("status nested 990 deep", "control", frames(schema, "status", {**st, "deep": deep(990)})),
        ("status version inf", "control", frames(schema, "status", {**st, "version": float("inf")})),
        ("subscribe have 'x'", "weights", frames(schema, "subscribe", {"actor_id": "x", "have": "x"})),
        ("subscribe have null", "weights", frames(schema, "subscribe", {"actor_id": "x", "have": None})),
        (
            "episode array shape [2**32, 2**32]",
            "episodes",
            frames(schema, "episode", {}, [{"name": "token_ids", "dtype": "int32", "shape": [2**32, 2**32]}], [b""]),
        ),
    ]


def episode_frames(
    schema: int,
    actor_id: str,
    eid: str,
    version: int = 0,
    token: int = 5,
    decision: dict | None = None,
    reward: float = 1.0,
    mask_value: int = 1,
    n: int = 6,
    weights_digests: dict | None = None,
) -> list:
    """A one-trajectory episode in the wire layout (unchanged since schema 1), every token id
    ``token``, the last half of the tokens generated (loss mask ``mask_value``)."""
    ids = np.full(n, token, "<i4")
    mask = np.array([0] * (n // 2) + [mask_value] * (n - n // 2), "u1")
    logp = np.where(mask > 0, -0.5, 0.0).astype("<f4")
    cols = {
        "id": [f"{eid}/t0"],
        "policy_version": [version],
        "reward": [reward],
        "scores": [{"reward": reward}],
        "sample_type": ["policy"],
        "group_id": [f"{eid}/g"],
        "task_id": ["t"],
        "is_replay": [False],
        "advantage": [None],
        "text": ["x"],
        "metadata": [{}],
        "length": [n],
        "has_recorded_logprobs": [False],
        "has_exp_mask": [False],
    }
    body = {
        "episode": {
            "id": eid,
            "actor_id": actor_id,
            "task": None,
            "decision": decision or {},
            "metrics": {},
            "created_at": time.time(),
            **({"weights_digests": weights_digests} if weights_digests is not None else {}),
        },
        "n": 1,
        "trajectories": cols,
    }
    specs = [
        {"name": k, "dtype": d, "shape": [n]}
        for k, d in (("token_ids", "int32"), ("loss_mask", "uint8"), ("behavior_logprobs", "float32"))
    ]
    return frames(schema, "episode", body, specs, [ids.tobytes(), mask.tobytes(), logp.tobytes()])


def small_disk(directory: Path, size: str = "48k") -> list[str]:
    """A command prefix that runs a process with ``directory`` on a tmpfs of ``size`` in a mount
    namespace of its own (``unshare``: no privileges needed where user namespaces are enabled), so
    that its writes there fail with a real ENOSPC while the rest of the run directory is normal."""
    script = 'mkdir -p "$1" && mount -t tmpfs -o size="$2" tmpfs "$1" && shift 2 && exec "$@"'
    return ["unshare", "--user", "--map-root-user", "--mount", "--", "sh", "-c", script, "sh", str(directory), size]


def connect(kind: int, address: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


class ScriptedActor:
    """A peer speaking the wire by hand: says hello, pushes episodes, reads acknowledgements."""

    def __init__(self, addresses: dict, schema: int, actor_id: str = "scripted", capacity: int = 4):
        self.schema, self.actor_id = schema, actor_id
        self.control = connect(zmq.DEALER, addresses["control"])
        self.push = connect(zmq.PUSH, addresses["episodes"])
        self.acked: set[str] = set()
        self.rejected: dict[str, str] = {}
        self.control.send_multipart(frames(schema, "hello", {"actor_id": actor_id, "capacity": capacity}))

    def send(self, msg: list) -> None:
        self.push.send_multipart(msg)

    def read_acks(self, timeout_s: float = 0.2) -> None:
        deadline = time.time() + timeout_s
        while self.control.poll(max(0, int((deadline - time.time()) * 1000))):
            header = msgpack.unpackb(self.control.recv_multipart()[0], raw=False)
            if header.get("kind") == "ack":
                self.acked.update(header["body"].get("ids", []))
                self.rejected.update({r["id"]: r["reason"] for r in header["body"].get("rejected", [])})

    def close(self) -> None:
        self.control.close(0)
        self.push.close(0)


# --- a live run -----------------------------------------------------------------------------------


class LiveRun:
    """``asyncrl learn`` (and actors) as real processes on loopback, writing ``run_root/name``;
    ``stop`` ends every process it started. ``root`` picks the checkout (bench: before/after);
    ``learner_prefix`` wraps the learner's command (e.g. in ``unshare``)."""

    def __init__(
        self, run_root: Path, name: str, overrides: list[str], root: Path = ROOT, learner_prefix: list[str] = ()
    ):
        self.root, self.dir, self.procs = root, Path(run_root) / name, []
        self.logs = Path(run_root)
        self.overrides = [*overrides, f"run_root={run_root}", f"name={name}"]
        self.learner = self.start("learn", [], "learner", prefix=learner_prefix)
        self.addresses = self._addresses()

    def start(self, command: str, args: list[str], log: str, prefix: list[str] = ()) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(self.root), env.get("PYTHONPATH", "")])
        out = open(self.logs / f"{self.dir.name}-{log}.log", "w")
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "asyncrl", command, *self.overrides, *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=self.root,
            start_new_session=True,
        )  # its own group: ``stop`` kills all of it
        self.procs.append(proc)
        return proc

    def actor(self, actor_id: str = "actor-0", index: int = 0, extra: list[str] = ()) -> subprocess.Popen:
        return self.start(
            "serve",
            [*extra, "--connect", self.addresses["control"], "--actor-id", actor_id, "--index", str(index)],
            actor_id,
        )

    def _addresses(self, timeout: float = 300) -> dict:
        path = self.dir / "addresses.json"
        deadline = time.time() + timeout
        while time.time() < deadline:
            if path.exists():
                try:
                    return json.loads(path.read_text())
                except json.JSONDecodeError:
                    pass
            if self.learner.poll() is not None:
                raise RuntimeError(f"the learner exited ({self.learner.returncode}): {self.log_tail()}")
            time.sleep(0.1)
        raise TimeoutError(f"no {path} within {timeout} s")

    def log_tail(self, name: str = "learner", lines: int = 1) -> str:
        text = (self.logs / f"{self.dir.name}-{name}.log").read_text(errors="replace").strip()
        return " | ".join(text.splitlines()[-lines:])

    def _jsonl(self, name: str) -> list[dict]:
        path = self.dir / name
        if not path.exists():
            return []
        out = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a torn last line of a live file
        return out

    def metrics(self) -> list[dict]:
        return self._jsonl("metrics.jsonl")

    def events(self, kind: str | None = None) -> list[dict]:
        return [e for e in self._jsonl("events.jsonl") if kind is None or e.get("kind") == kind]

    def version(self) -> int:
        m = self.metrics()
        return m[-1]["version"] if m else 0

    def wait(self, condition, timeout: float, poll_s: float = 0.1) -> float | None:
        """Seconds until ``condition()`` holds (None: not within ``timeout``, or the learner died)."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if condition():
                return time.time() - t0
            if self.learner.poll() is not None:
                return None
            time.sleep(poll_s)
        return None

    def wait_version(self, at_least: int, timeout: float) -> float | None:
        return self.wait(lambda: self.version() >= at_least, timeout)

    def died(self, within: float) -> bool:
        try:
            self.learner.wait(timeout=within)
            return True
        except subprocess.TimeoutExpired:
            return False

    def rss_mb(self) -> float:
        with open(f"/proc/{self.learner.pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM every process, wait up to ``timeout`` s, then kill each whole process group."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # whatever is left of it (e.g. under an unshare prefix)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
