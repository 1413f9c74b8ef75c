"""What runs inside a Ray worker for the Ray scheduler: :class:`ProcSupervisor`, a thin Ray actor
that starts one asyncrl command (``learn``, ``serve``, ``relay``) as a child process on its node,
reports on it and stops it. Imported on every node (asyncrl is installed there); nothing here
imports Ray at module level.

- The child gets ``ASYNCRL_PARENT_PID`` (:mod:`asyncrl.lifecycle`): it dies with its supervisor,
  so a lost worker or a killed Ray actor never leaves an asyncrl process behind.
- Its config travels as text (the driver's resolved config): no shared filesystem is assumed.
  Files it needs (an actor's CURVE bundle) travel the same way, into a private temp directory.
- Its output goes to a log file on its node; :meth:`read_log` hands new bytes to whoever asks,
  and a ``sink`` (rank 0's supervisor) collects every process's log under the run directory.
- An actor whose command fails (exit code not 0) takes its supervisor down with it, so that Ray
  restarts both (``launch.ray.max_restarts``); exit code 0 (the learner said stop) is final.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..lifecycle import child_env
from .local import free_port


def relay_name(prefix: str, node_id: str) -> str:
    return f"{prefix}-{node_id[:16]}"


class ProcSupervisor:
    """One asyncrl command on this node. ``spec``: ``name``, ``args`` (after ``asyncrl``), ``config``
    (YAML text), ``env`` (extra variables), ``cwd``, ``files`` ({relative path: bytes} written into
    a private directory, named by ``{files}`` in args), ``restart_on_failure``, ``start``,
    ``sink`` (the actor name of the supervisor that collects logs) and ``relay`` (the name prefix of
    the per-node relays: wait for this node's, which the driver creates, and pass its address as ``{relay}``)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.name = spec["name"]
        self.dir = Path(tempfile.mkdtemp(prefix=f"asyncrl-{self.name}-"))
        self.log_path = self.dir / "output.log"
        self.proc: subprocess.Popen | None = None
        self.forwarded = 0
        self._sink = None  # (the log collector's handle, looked up by name)
        self._stop = threading.Event()
        self.error: str | None = None
        if spec.get("start", True) and spec.get("relay"):  # (returns at once: the driver asks where it is)
            threading.Thread(target=self._start_after_relay, daemon=True, name="asyncrl-relay-wait").start()
        elif spec.get("start", True):
            self.start()

    # -- where and what ---------------------------------------------------------------------------
    def node(self) -> dict:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "child": self.proc.pid if self.proc else None,
        }

    def free_port(self) -> int:
        return free_port()

    def set_spec(self, spec: dict) -> None:
        """(A supervisor made with ``start: False``) what to start, once the driver knows it."""
        self.spec, self.name = spec, spec["name"]

    def start(self, extra_env: dict | None = None) -> int:
        spec = self.spec
        config = self.dir / "config.yaml"
        config.write_text(spec["config"])
        files = self.dir / "files"
        for rel, data in (spec.get("files") or {}).items():
            path = files / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            if rel.endswith("_secret"):
                os.chmod(path, 0o600)
        subs = {"files": str(files), "relay": self._relay_address() if spec.get("relay") else ""}
        args = [a.format(**subs) for a in spec["args"]]
        env = child_env({**os.environ, **(spec.get("env") or {}), **(extra_env or {}), "PYTHONUNBUFFERED": "1"})
        cwd = spec.get("cwd") if spec.get("cwd") and Path(spec["cwd"]).is_dir() else None
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "asyncrl", args[0], "--config", str(config), *args[1:]],
                env=env,
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        threading.Thread(target=self._watch, daemon=True, name="asyncrl-supervise").start()
        return self.proc.pid

    def _start_after_relay(self) -> None:
        try:
            self.start()
        except Exception as e:  # noqa: BLE001 - said by poll(): the driver ends the run with it
            self.error = f"{type(e).__name__}: {e}"

    def _relay_address(self) -> str:
        """This node's relay (created by the driver when it sees an actor here), its 127.0.0.1 address."""
        import ray

        name = relay_name(self.spec["relay"], ray.get_runtime_context().get_node_id())
        deadline = time.monotonic() + float(self.spec.get("relay_timeout_s", 180.0))
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                relay = ray.get_actor(name)
                break
            except ValueError:  # not created yet
                time.sleep(0.2)
        else:
            raise RuntimeError(f"no weights relay {name} on this node")
        line = ray.get(relay.wait_line.remote("relay listening on ", 120.0), timeout=180)
        if not line:
            raise RuntimeError(f"the weights relay {name} did not start: {ray.get(relay.tail.remote())}")
        return line.split("relay listening on ", 1)[1].strip()

    def _watch(self) -> None:
        while not self._stop.is_set():
            done = self.proc.poll() is not None
            self._forward(wait=done)
            if done:
                if self.proc.returncode != 0 and self.spec.get("restart_on_failure") and not self._stop.is_set():
                    print(
                        f"[asyncrl] {self.name} exited with code {self.proc.returncode}; its supervisor ends "
                        f"so that Ray restarts it",
                        flush=True,
                    )
                    os._exit(1)
                return
            time.sleep(1.0)

    def _forward(self, wait: bool = False) -> None:
        """New output to ``<run>/logs/<name>.log``: through the sink (rank 0's supervisor), or here (rank 0).
        ``wait``: until the sink has it (the last output of a process that failed: its error)."""
        data = self.read_log(self.forwarded)
        if not data:
            return
        self.forwarded += len(data)
        sink = self.spec.get("sink")
        try:
            if sink is None:
                self.append_log(self.name, data)
            else:
                import ray

                if self._sink is None:
                    self._sink = ray.get_actor(sink)
                ref = self._sink.append_log.remote(self.name, data)
                if wait:
                    ray.get(ref, timeout=10)
        except Exception:  # noqa: BLE001 - the sink is gone (the learner's node): the driver says so
            pass

    # -- state ------------------------------------------------------------------------------------
    def poll(self) -> int | str | None:
        """The child's exit code, None while it runs (or waits for its relay), or the text of a start-up failure."""
        if self.error:
            return self.error
        return None if self.proc is None else self.proc.poll()

    def read_log(self, offset: int = 0, limit: int = 1 << 20) -> bytes:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read(limit)
        except FileNotFoundError:
            return b""

    def tail(self, n: int = 4000) -> str:
        data = self.read_log(0, 1 << 24)
        return data[-n:].decode("utf-8", "replace")

    def wait_line(self, prefix: str, timeout_s: float) -> str | None:
        """The first output line starting with ``prefix`` (None when the child exits or time runs out)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.read_log(0, 1 << 20).decode("utf-8", "replace").splitlines():
                if line.startswith(prefix):
                    return line
            if self.poll() is not None:
                return None
            time.sleep(0.1)
        return None

    def read_file(self, path: str) -> bytes | None:
        try:
            return Path(path).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            return None

    def make_keys(self, out_dir: str, names: list[str]) -> dict[str, dict[str, bytes]]:
        """CURVE bundles for ``names`` in ``out_dir`` on this node (the learner's); returns each
        actor bundle's files. The server's secret key never leaves this process's node."""
        from ..wire.sockets import make_curve_keys

        bundles = make_curve_keys(out_dir, names)
        bundles.pop("server")
        return {
            name: {f"{name}/{p.name}": p.read_bytes() for p in Path(path).iterdir() if p.is_file()}
            for name, path in bundles.items()
        }

    def append_log(self, name: str, data: bytes) -> None:
        """(The sink, rank 0's supervisor) append another process's output to ``<run>/logs/<name>.log``."""
        logs = Path(self.spec["run_dir"]) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{name}.log", "ab") as f:
            f.write(data)

    # -- stopping ---------------------------------------------------------------------------------
    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the child (an orderly stop: the learner checkpoints), SIGKILL after ``grace_s``."""
        self._stop.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._forward()
        return self.poll()

    def last_error_line(self, name: str) -> str:
        """(Rank 0's supervisor, which holds the logs) the last line of ``<run>/logs/<name>.log`` that
        says something: a failed process's error."""
        from .local import last_error_line

        return last_error_line(Path(self.spec["run_dir"]) / "logs" / f"{name}.log")

    def write_stop_reason(self, line: str) -> None:
        """(Rank 0's supervisor, on the learner's node) why the driver stops the run, for the learner's
        summary: ``<run>/stop_reason.txt`` (:func:`asyncrl.schedulers.local.failed` writes it on one machine)."""
        from ..rundir import layout

        (Path(self.spec["run_dir"]) / layout.STOP_REASON).write_text(line + "\n")

    def cleanup(self) -> None:
        """Remove this supervisor's private directory (its config, keys and output)."""
        shutil.rmtree(self.dir, ignore_errors=True)
