"""``asyncrl run``: start the learner and N actors as processes, show progress, stop cleanly.

The learner binds its sockets and writes ``addresses.json`` into the run dir; actors are then started
with its control address. Actor output goes to ``<run>/actor-<i>.log``. Ctrl-C (or SIGTERM) stops
every process; after ``total_steps`` the learner tells the actors to stop and all exit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from .config import Config


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", *args]


def wait_for_addresses(path: Path, learner: subprocess.Popen, timeout: float = 600) -> dict:
    """The learner's addresses.json once written; fails early if the learner exits first."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                pass
        if learner.poll() is not None:
            raise RuntimeError(f"the learner exited with code {learner.returncode} before binding its sockets")
        time.sleep(0.2)
    raise TimeoutError(f"no {path} after {timeout:.0f}s")


def launch(cfg: Config, config_path: str | None, overrides: list[str], ui: bool = False) -> int:
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    addr_file = run_dir / "addresses.json"
    addr_file.unlink(missing_ok=True)
    base = (["--config", config_path] if config_path else []) + [x for o in overrides for x in ("-o", o)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops everything like Ctrl-C
    learner = subprocess.Popen(_cli("learn", *base), env=env)
    procs.append(learner)
    try:
        addrs = wait_for_addresses(addr_file, learner)
        for i in range(cfg.actor.num):
            log = open(run_dir / f"actor-{i}.log", "a")
            procs.append(subprocess.Popen(_cli("serve", *base, "--connect", addrs["control"],
                                               "--actor-id", f"actor-{i}", "--index", str(i)),
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
        if ui:
            port = _free_port()
            args = ["ui", "--run", str(run_dir), "--connect", addrs["events"], "--port", str(port)]
            if cfg.wire.curve_dir:
                args += ["--curve-dir", cfg.wire.curve_dir]
            procs.append(subprocess.Popen(_cli(*args), env=env))
            print(f"[asyncrl] UI at http://127.0.0.1:{port}/ (starting; it stops with the run, then reopen it "
                  f"with: asyncrl ui --run {run_dir})", flush=True)
        print(f"[asyncrl] learner at {addrs['control']}, {cfg.actor.num} actor(s); logs in {run_dir}", flush=True)
        while learner.poll() is None:
            for i, p in enumerate(procs[1:1 + cfg.actor.num]):
                if p.poll() not in (None, 0):
                    print(f"[asyncrl] actor-{i} exited with code {p.returncode}; see "
                          f"{run_dir / f'actor-{i}.log'}", flush=True)
                    raise RuntimeError("an actor failed")
            time.sleep(0.5)
        code = learner.returncode
    except KeyboardInterrupt:
        print("\n[asyncrl] stopping (Ctrl-C)...", flush=True)
        code = 130
    except RuntimeError as e:
        print(f"[asyncrl] {e}", flush=True)
        code = 1
    finally:
        _stop_all(procs)
    return code


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_all(procs: list[subprocess.Popen], grace: float = 15.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
