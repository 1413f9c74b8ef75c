"""``asyncrl run --scheduler slurm``: a SLURM batch job from the same config.

Outside an allocation it writes an sbatch script (``<run_root>/<name>.sbatch``) and submits it
(``--dry-run``: writes it only), printing the job id and where the output goes. The script holds
the resolved config inline (no shared filesystem is assumed for it) and runs ``asyncrl run
--scheduler slurm`` on the allocation's first node, which is the path taken inside an allocation
(``SLURM_JOB_ID`` set, e.g. under ``salloc``) too:

- the learner (``--learner-procs N``: a group on that node) runs there, with the run directory;
- the actors run on the other nodes of the allocation, round-robin, each with ``srun --nodes=1
  --ntasks=1 --nodelist=NODE --overlap`` (on the first node too when the allocation has one node);
- with actors on other nodes the learner binds that node's address (``launch.slurm.bind``: auto,
  an address, or ``iface:NAME``) as a CURVE server; keys are made in the run directory and each
  actor gets only its own bundle, in its environment (``ASYNCRL_ACTOR_BUNDLE``), never the server's
  secret; on one node everything stays on loopback;
- ``scancel`` sends SIGTERM, which is ``asyncrl run``'s Ctrl-C: the learner checkpoints and every
  process ends; a component that dies ends the job with its line (the local launcher's rules).
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from ..config import Config, dump_config
from ..lifecycle import PARENT_ENV
from . import SchedulerError

BUNDLE_ENV = "ASYNCRL_ACTOR_BUNDLE"


def in_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))


def script_text(cfg: Config, overwrite: bool = False, learner_procs: int = 1) -> str:
    """The sbatch script for ``cfg``: #SBATCH lines from ``launch.slurm``, the config inline."""
    sc = cfg.launch.slurm
    run_root = Path(cfg.run_root).resolve()
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=asyncrl-{cfg.name}",
        f"#SBATCH --nodes={sc.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={run_root}/{cfg.name}.slurm-%j.out",
        f"#SBATCH --time={sc.time}",
    ]
    lines += [f"#SBATCH --partition={sc.partition}"] if sc.partition else []
    lines += [f"#SBATCH --account={sc.account}"] if sc.account else []
    lines += [f"#SBATCH --cpus-per-task={sc.cpus_per_node}"] if sc.cpus_per_node else []
    lines += [f"#SBATCH --gpus-per-node={sc.gpus_per_node}"] if sc.gpus_per_node else []
    lines += [f"#SBATCH {a}" for a in sc.sbatch_args]
    frozen = cfg.model_copy(deep=True)
    frozen.run_root = str(run_root)
    frozen.launch.scheduler = "slurm"
    text = dump_config(frozen)
    if "ASYNCRL_CONFIG_END" in text:
        raise SchedulerError("the config contains the text ASYNCRL_CONFIG_END, which ends the script's inline config")
    run = [sc.python or sys.executable, "-m", "asyncrl", "run", "--config", "$CONFIG", "--scheduler", "slurm"]
    run += ["--overwrite"] if overwrite else []
    run += ["--learner-procs", str(learner_procs)] if learner_procs > 1 else []
    return "\n".join(
        lines
        + [
            f"# Made by `asyncrl run --scheduler slurm` for run {cfg.name}; submit again with: sbatch <this file>",
            "set -u",
            f'cd {shlex.quote(os.getcwd())} 2>/dev/null || cd "$HOME"',
            'CONFIG="$(mktemp --suffix=.yaml)"',
            "trap 'rm -f \"$CONFIG\"' EXIT",
            "cat > \"$CONFIG\" <<'ASYNCRL_CONFIG_END'",
            text.rstrip(),
            "ASYNCRL_CONFIG_END",
            # not exec: the EXIT trap removes the config copy. scancel sends SIGTERM to every process of the
            # job, asyncrl run included (its Ctrl-C); the shell only keeps waiting for it
            "trap ':' TERM INT",
            " ".join(shlex.quote(a) if a != "$CONFIG" else '"$CONFIG"' for a in run) + " &",
            "PID=$!",
            "wait $PID",
            "CODE=$?",
            'while kill -0 "$PID" 2>/dev/null; do wait "$PID"; CODE=$?; done  # (a signal ended the first wait)',
            'exit "$CODE"',
            "",
        ]
    )


def submit(cfg: Config, dry_run: bool, overwrite: bool, learner_procs: int) -> int:
    path = Path(cfg.run_root).resolve() / f"{cfg.name}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script_text(cfg, overwrite=overwrite, learner_procs=learner_procs))
    print(f"[asyncrl] wrote {path}", flush=True)
    if dry_run:
        sc = cfg.launch.slurm
        print(
            f"[asyncrl] dry run: nothing submitted. The job asks for {sc.nodes} node(s) for {sc.time}"
            f"{f' on partition {sc.partition}' if sc.partition else ''}. Submit it on a login node with:\n"
            f"  sbatch {path}\n"
            f"its output goes to {Path(cfg.run_root).resolve() / cfg.name}.slurm-<job id>.out and the run to "
            f"{Path(cfg.run_root).resolve() / cfg.name} (on the first node); scancel <job id> stops it cleanly",
            flush=True,
        )
        return 0
    try:
        out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SchedulerError(
            f"sbatch is not on PATH: run this on a SLURM login node, or use --dry-run and submit {path} there"
        ) from None
    except subprocess.TimeoutExpired:
        raise SchedulerError("sbatch did not answer within 60 s (is slurmctld up?)") from None
    if out.returncode != 0:
        raise SchedulerError(f"sbatch refused {path}: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    job = out.stdout.strip().split(";")[0]
    log = Path(cfg.run_root).resolve() / f"{cfg.name}.slurm-{job}.out"
    print(
        f"[asyncrl] submitted job {job}: output in {log} (on the first node), run directory "
        f"{Path(cfg.run_root).resolve() / cfg.name}; stop it with scancel {job}",
        flush=True,
    )
    return 0


def nodes() -> list[str]:
    """The allocation's nodes, the first one (this one, the batch host) first."""
    raw = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or ""
    if not raw:
        return []
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", raw], capture_output=True, text=True, timeout=30)
        names = out.stdout.split() if out.returncode == 0 else [raw]
    except (FileNotFoundError, subprocess.TimeoutExpired):
        names = [raw]
    here = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    return sorted(names, key=lambda n: n != here)


def bind_address(spec: str) -> str:
    """The learner's address for actors on other nodes: ``auto`` (this host's name resolved), an
    address, or ``iface:NAME`` (that interface's IPv4 address)."""
    if spec.startswith("iface:"):
        name = spec.split(":", 1)[1]
        out = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", name], capture_output=True, text=True)
        for part in out.stdout.split():
            if "/" in part and part[0].isdigit():
                return part.split("/")[0]
        raise SchedulerError(
            f"launch.slurm.bind={spec}: interface {name} has no IPv4 address "
            f"({(out.stderr or out.stdout).strip() or 'no such interface'})"
        )
    if spec != "auto":
        return spec
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise SchedulerError(
            f"cannot resolve this node's name ({e}); set launch.slurm.bind to an address or iface:NAME"
        ) from None


def bundle_env(bundle_dir: Path) -> str:
    """An actor's CURVE bundle (its pair and the learner's public key) as one environment value."""
    files = {p.name: base64.b64encode(p.read_bytes()).decode() for p in bundle_dir.iterdir() if p.is_file()}
    if any(name.startswith("server.key_secret") for name in files):
        raise SchedulerError(f"{bundle_dir} holds the learner's secret key; refusing to hand it to an actor")
    return json.dumps(files)


def materialize_bundle(value: str) -> str:
    """(``asyncrl serve``) write the bundle from ``ASYNCRL_ACTOR_BUNDLE`` into a private directory."""
    import atexit
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="asyncrl-keys-"))
    atexit.register(shutil.rmtree, d, True)
    for name, data in json.loads(value).items():
        path = d / Path(name).name
        path.write_bytes(base64.b64decode(data))
        if name.endswith("_secret"):
            os.chmod(path, 0o600)
    return str(d)


def launch(cfg: Config, config_path: str | None, overrides: list[str], ui: bool = False, learner_procs: int = 1) -> int:
    """Inside an allocation: the learner here, the actors on the allocation's nodes."""
    from ..wire.sockets import make_curve_keys
    from .local import launch as local_launch

    if not in_allocation():
        raise SchedulerError(
            "not inside a SLURM allocation (no SLURM_JOB_ID): asyncrl run --scheduler slurm submits "
            "a job when started outside one"
        )
    hosts = nodes()
    others = hosts[1:]
    overrides = list(overrides)
    bundles: dict[int, str] = {}
    if others:  # actors on other nodes: a real interface, CURVE keys made here, one bundle each
        host = bind_address(cfg.launch.slurm.bind)
        keys = Path(cfg.run_dir) / "keys"
        made = make_curve_keys(str(keys), [str(i) for i in range(cfg.actor.num)])
        overrides += [f"wire.host={host}", f"wire.curve_dir={keys}"]
        bundles = {i: bundle_env(Path(made[f"actor-{i}"])) for i in range(cfg.actor.num)}
        print(
            f"[asyncrl] SLURM job {os.environ['SLURM_JOB_ID']}: learner on {hosts[0]} ({host}, CURVE keys), "
            f"{cfg.actor.num} actor(s) on {', '.join(others)}",
            flush=True,
        )
    else:
        print(
            f"[asyncrl] SLURM job {os.environ['SLURM_JOB_ID']}: learner and {cfg.actor.num} actor(s) on "
            f"{hosts[0] if hosts else 'this node'} (loopback)",
            flush=True,
        )

    def place(i: int, argv: list[str], env: dict) -> tuple[list[str], dict]:
        node = others[i % len(others)] if others else (hosts[0] if hosts else None)
        if node is None:
            return argv, env
        env = dict(env)
        env.pop(PARENT_ENV, None)  # (its parent is SLURM's step daemon; srun, our child, ends the step with us)
        if others:
            env[BUNDLE_ENV] = bundles[i]  # (asyncrl serve uses it instead of the learner's keys directory)
        return [
            "srun",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={node}",
            "--overlap",
            "--kill-on-bad-exit=1",
            f"--job-name=actor-{i}",
            *argv,
        ], env

    return local_launch(cfg, config_path, overrides, ui=ui, learner_procs=learner_procs, place_actor=place)
