"""``asyncrl run``: start the learner and N actors as processes, show progress, stop cleanly.

The learner binds its sockets and writes ``addresses.json`` into the run dir; actors are then started
with its control address. Actor output goes to ``<run>/actor-<i>.log``. After ``total_steps`` the
learner tells the actors to stop and all exit.

Stopping (the same whatever state the launch is in):
- SIGINT (Ctrl-C) and SIGTERM are handled explicitly, so they work even when the launcher started
  with SIGINT ignored (every background job of a non-interactive shell inherits that). The first
  one sends SIGTERM to every child (an orderly stop: the learner gives up the step in progress and
  checkpoints the last one it completed) and waits up to ``STOP_GRACE_S``, or as long as the learner
  says it needs (``<run>/stopping.json``: a real model's checkpoint can take longer), then kills what
  is left; a second one kills the children at once.
- The children die with the launcher even when it cannot clean up (SIGKILL, OOM kill): see
  ``asyncrl.lifecycle``.
- There is no start-up deadline: building the embedded model on first use can take many minutes.
  The launcher waits as long as the learner is alive and says every ``WAIT_REPORT_S`` that it is.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..config import Config
from ..lifecycle import child_env
from ..rundir import layout
from . import fork

STOP_GRACE_S = 30.0
WAIT_REPORT_S = 60.0
UI_TOKEN_ENV = "ASYNCRL_UI_TOKEN"  # `asyncrl run --ui` hands the UI the token it prints


class LearnerExited(RuntimeError):
    """The learner ended before it bound its sockets."""


class StopRequested(Exception):
    """A stop signal arrived while waiting (raised by :class:`StopSignals.check`)."""


class StopSignals:
    """Counts SIGINT/SIGTERM without raising inside arbitrary code: loops poll :meth:`check`."""

    def __init__(self) -> None:
        self.count = 0
        self.signum: int | None = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.count += 1
        self.signum = self.signum or signum
        if self.count == 2:
            print("\n[asyncrl] second stop signal: killing the children now", flush=True)

    def check(self) -> None:
        if self.count:
            raise StopRequested

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum or signal.SIGINT)


def wait_for_addresses(
    path: Path,
    learner: subprocess.Popen,
    timeout: float | None = None,
    stop: StopSignals | None = None,
    report_s: float | None = None,
) -> dict:
    """The learner's addresses.json once written. Waits as long as the learner lives (or
    ``timeout`` seconds when given); raises LearnerExited if it ends first, StopRequested on a
    stop signal. Every ``report_s`` seconds it prints that the learner is still starting."""
    t0 = last_report = time.time()
    while timeout is None or time.time() - t0 < timeout:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                pass  # being written
        if learner.poll() is not None:
            raise LearnerExited(f"the learner exited with code {learner.returncode} before binding its sockets")
        if stop is not None:
            stop.check()
        if report_s and time.time() - last_report >= report_s:
            last_report = time.time()
            print(
                f"[asyncrl] the learner (pid {learner.pid}) is still starting after {last_report - t0:.0f} s "
                f"(loading or building the model); waiting",
                flush=True,
            )
        time.sleep(0.2)
    raise TimeoutError(f"no {path} after {timeout:.0f}s")


def launch(
    cfg: Config,
    config_path: str | None,
    overrides: list[str],
    ui: bool = False,
    learner_procs: int = 1,
    place_actor=None,
) -> int:
    """Learner and actors as child processes; ``place_actor(i, argv, env) -> (argv, env)`` may wrap
    an actor's command (the SLURM scheduler runs it on another node with ``srun``)."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    addr_file = layout.addresses(run_dir)
    addr_file.unlink(missing_ok=True)
    base = (["--config", config_path] if config_path else []) + [x for o in overrides for x in ("-o", o)]
    env = child_env()
    env["PYTHONUNBUFFERED"] = "1"
    stop = StopSignals()
    stop.install()
    procs: list[subprocess.Popen] = []
    training_over = False
    forking = cfg.launch.start == "fork"
    try:
        if forking:
            fork.preload()
        learner, *ranks = start_learner_group(["learn", *base], learner_procs, env, run_dir, forking)
        procs += [learner, *ranks]
        addrs = wait_for_addresses(addr_file, learner, stop=stop, report_s=WAIT_REPORT_S)
        actors = [_start_actor(run_dir, base, addrs, i, env, place_actor, forking) for i in range(cfg.actor.num)]
        procs += actors
        ui_proc = _start_ui(cfg, run_dir, addrs, env, forking) if ui else None
        procs += [ui_proc] if ui_proc is not None else []
        print(f"[asyncrl] learner at {addrs['control']}, {cfg.actor.num} actor(s); logs in {run_dir}", flush=True)
        code = _supervise(learner, actors, run_dir, stop, ranks)
        if ui_proc is not None:  # the dashboard outlives the training until the user stops it
            stop_all([learner, *actors], stop)
            training_over = True
            _serve_until_stopped(ui_proc, code, stop)
    except StopRequested:
        code = stop.exit_code
    except LearnerExited as e:
        print(f"[asyncrl] {e}", flush=True)
        code = 1
    finally:
        if stop.count and training_over:
            print(f"\n[asyncrl] stopping the UI ({signal.Signals(stop.signum).name})", flush=True)
        elif stop.count:
            print(
                f"\n[asyncrl] stopping ({signal.Signals(stop.signum).name}); waiting for the learner to give up "
                f"its step in progress and checkpoint the last one it completed ({STOP_GRACE_S:g} s, or as long as "
                f"it asks for; stop again to kill now)",
                flush=True,
            )
        stop_all(procs, stop, patience=lambda: learner_needs(run_dir, procs[0] if procs else None))
        if stop.count and not training_over and not os.environ.get("SLURM_JOB_ID"):  # (SLURM: resubmit)
            _how_to_resume(run_dir)
    return code


def _how_to_resume(run_dir: Path) -> None:
    """After a stop signal: the checkpoint the run would resume from, and the command that does (on
    stderr: stdout's last line stays the JSON summary)."""
    ckpt = layout.latest_checkpoint(run_dir)
    if ckpt is None:
        print(f"[asyncrl] no checkpoint in {run_dir}: a resume would start from step 0", file=sys.stderr, flush=True)
        return
    print(
        f"[asyncrl] stopped; checkpoint at step {layout.checkpoint_step(ckpt)} in {ckpt}. Resume with:\n"
        f"  {resume_command()}",
        file=sys.stderr,
        flush=True,
    )


def invoked_as() -> str:
    """``asyncrl`` as this process was started, to paste back into the same shell: ``asyncrl`` when that
    is what the PATH finds, else the script's path (``.venv/bin/asyncrl`` from the project's root), and
    ``<python> -m asyncrl`` for ``python -m asyncrl``."""

    def short(path: str) -> str:
        rel = os.path.relpath(path)
        return shlex.quote(path if rel.startswith("..") else rel)

    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "asyncrl"
    if os.path.basename(argv0) == "__main__.py":
        return f"{short(sys.executable)} -m asyncrl"
    found = shutil.which("asyncrl")
    if os.path.basename(argv0) == "asyncrl" and (
        os.sep not in argv0 or (found and os.path.realpath(found) == os.path.realpath(argv0))
    ):
        return "asyncrl"
    return short(argv0)


def this_command(drop=lambda arg: False) -> str:
    """This ``asyncrl`` command line as it was typed (:func:`invoked_as`), quoted for a shell, without
    the arguments ``drop`` picks."""
    return invoked_as() + " " + " ".join(shlex.quote(a) for a in sys.argv[1:] if not drop(a))


def resume_command() -> str:
    """This ``asyncrl`` command line with ``--resume`` (and no other resume switch; without ``--overwrite``,
    which would delete what it resumes and which argparse refuses beside ``--resume``)."""
    return this_command(lambda a: a in ("--resume", "--overwrite") or a.startswith("checkpoint.resume=")) + " --resume"


def start_learner_group(
    args: list[str], n: int, env: dict, run_dir: Path, forking: bool = False
) -> list[subprocess.Popen]:
    """``n`` learner processes of one group (``asyncrl.learner.training.ranks``), as ``torchrun`` would start
    them on this machine: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT (a free loopback port), and
    ASYNCRL_STORE_SECRET, with which rank 0 serves the group's rendezvous store (bound to loopback
    alone, answering only that secret: ``asyncrl.learner.training.distributed``).
    Rank 0 prints to this terminal; rank i > 0 to ``<run>/learner-rank<i>.log``. One process: no
    group variables at all. ``args``: the command after ``asyncrl``; ``forking``: see
    :mod:`asyncrl.schedulers.fork`."""
    if n < 1:
        raise ValueError(f"--learner-procs {n}: expected at least 1 learner process")
    if n == 1:
        return [fork.start(args, env, fork=forking)]
    group = {
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "ASYNCRL_STORE_SECRET": secrets.token_hex(16),
    }
    procs = []
    for rank in range(n):
        rank_env = {**env, **group, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        if rank == 0:
            procs.append(fork.start(args, rank_env, fork=forking))
            continue
        with open(layout.learner_rank_log(run_dir, rank), "a") as log:
            procs.append(fork.start(args, rank_env, log, fork=forking))
    return procs


def _start_actor(
    run_dir: Path, base: list[str], addrs: dict, i: int, env: dict, place=None, forking: bool = False
) -> subprocess.Popen:
    args = ["serve", *base, "--connect", addrs["control"], "--actor-id", f"actor-{i}", "--index", str(i)]
    with open(layout.actor_log(run_dir, i), "a") as log:  # the child keeps its own descriptor
        if place is None:
            return fork.start(args, env, log, fork=forking)
        argv, env = place(i, fork.command(args), env)  # (on another node: a command, never a fork)
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _start_ui(cfg: Config, run_dir: Path, addrs: dict, env: dict, forking: bool = False) -> subprocess.Popen:
    port = free_port()
    args = ["ui", "--run", str(run_dir), "--connect", addrs["events"], "--port", str(port)]
    if cfg.wire.curve_dir:
        args += ["--curve-dir", cfg.wire.curve_dir]
    token = secrets.token_urlsafe(24)  # the UI's login on loopback (app/token_gate.py), in its environment
    proc = fork.start(args, {**env, UI_TOKEN_ENV: token}, fork=forking)
    proc.url = f"http://127.0.0.1:{port}/?token={token}"
    print(f"[asyncrl] UI starting on 127.0.0.1:{port}; its URL follows once it accepts connections", flush=True)

    def announce() -> None:  # the URL when it works (the app takes tens of seconds to start), not before
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                time.sleep(0.25)
                continue
            print(f"[asyncrl] UI at {proc.url} (it keeps serving after the training ends, until Ctrl-C)", flush=True)
            return

    threading.Thread(target=announce, name="asyncrl-ui-ready", daemon=True).start()
    return proc


def _serve_until_stopped(ui: subprocess.Popen, code: int, stop: StopSignals) -> None:
    """After the training ended (exit ``code``): keep the UI up until a stop signal (or until the UI
    process itself exits)."""
    ended = "finished" if code == 0 else f"ended with exit code {code}"
    print(
        f"[asyncrl] training {ended}; the UI is still serving at {ui.url} - press Ctrl-C (or send "
        f"SIGTERM to pid {os.getpid()}) to stop it",
        flush=True,
    )
    while ui.poll() is None and not stop.count:
        time.sleep(0.2)
    if ui.returncode not in (None, 0):
        print(f"[asyncrl] the UI exited with code {ui.returncode}", flush=True)


def _supervise(
    learner: subprocess.Popen,
    actors: list[subprocess.Popen],
    run_dir: Path,
    stop: StopSignals,
    ranks: list[subprocess.Popen] = (),
) -> int:
    """Wait for the learner to finish; an actor or a learner rank that fails ends the run (exit
    code 1)."""
    while learner.poll() is None:
        stop.check()
        for i, p in enumerate(ranks, start=1):
            if p.poll() not in (None, 0):
                return failed(run_dir, f"learner rank {i}", p.returncode, layout.learner_rank_log(run_dir, i))
        for i, p in enumerate(actors):
            if p.poll() not in (None, 0):
                return failed(run_dir, f"actor-{i}", p.returncode, layout.actor_log(run_dir, i))
        time.sleep(0.2)
    return learner.returncode


def failed(run_dir: Path, who: str, code: int, log: Path) -> int:
    """A component of the run failed: one console line naming it and its error (its log's last
    line), which the learner, stopped next, also gives as its stop reason (summary, exit code 1).
    Returns 1."""
    line = f"{who} failed (exit code {code}): {last_error_line(log)}; its log: {log}"
    print(f"[asyncrl] {line}", flush=True)
    try:
        (run_dir / layout.STOP_REASON).write_text(line + "\n")
    except OSError:
        pass
    return 1


def last_error_line(log: Path, limit: int = 400) -> str:
    """The last line of ``log`` that says something (not a traceback's frame or caret line)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 65536))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return "(no log)"
    for line in reversed(lines):
        text = line.strip()
        if text and not text.startswith(("File ", "^", "~", "Traceback")) and not set(text) <= set("^~ "):
            return text[:limit]
    return "(its log is empty)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MAX_PATIENCE_S = 900.0  # the longest a learner may ask to be waited for (stopping.json)


def learner_needs(run_dir: Path, learner: subprocess.Popen | None) -> float | None:
    """Until when (unix time) the live ``learner`` says it needs to stop (``<run>/stopping.json``, written
    when it is asked to stop and again before its checkpoint), at most MAX_PATIENCE_S from now; None when
    it said nothing or is gone."""
    if learner is None or learner.poll() is not None:
        return None
    try:
        said = json.loads((run_dir / layout.STOPPING).read_text())
        until = float(said["until"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return min(until, time.time() + MAX_PATIENCE_S) if said.get("pid") == learner.pid else None


def stop_all(
    procs: list[subprocess.Popen], stop: StopSignals | None = None, grace: float = STOP_GRACE_S, patience=None
) -> None:
    """SIGTERM every live process, wait up to ``grace`` seconds (less if a second stop signal comes), or
    until the later time ``patience()`` gives (the learner writing its checkpoint; said once), then
    SIGKILL what is left. Never raises."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline, told = time.time() + grace, False
    while any(p.poll() is None for p in procs):
        if stop is not None and stop.count >= 2:
            break
        later = patience() if patience is not None else None
        if later is not None and later > deadline:
            if not told:
                print(
                    f"[asyncrl] the learner asks for up to {later - time.time():.0f} s to save its work (stop "
                    f"again to kill it now)",
                    flush=True,
                )
                told = True
            deadline = later
        if time.time() >= deadline:
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
