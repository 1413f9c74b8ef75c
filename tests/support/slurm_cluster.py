"""A real SLURM cluster for tests: Debian's slurm-wlm (slurmctld + slurmd) and munge, started as
root from a private directory (their own key, socket, ports, state and logs; nothing in /etc is
touched) and stopped with every process they started, also when a test fails.

One node on this machine's loopback by default. Given namespace hosts (``asyncrl/testing/netns.py``), a cluster
across them: slurmctld on host 0 and one slurmd on each other host, node ``n<i>`` at host ``i``'s
address, each with its own spool, pid file and log (``%n`` in slurm.conf); munge's socket is a file
that every host sees. Commands (``run``) then run on host 0, the controller's."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "scontrol")


def missing() -> str | None:
    """Why a cluster cannot start here (None: it can)."""
    if os.geteuid() != 0:
        return "SLURM's daemons run as root here; this is not root"
    gone = [b for b in BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    return f"not installed: {', '.join(gone)} (make slurm: apt-get install slurm-wlm munge)" if gone else None


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: Path, cpus: int | None = None, hosts=None):
        self.root = root
        self.hosts = hosts
        self.node = socket.gethostname().split(".")[0]
        self.cpus = cpus or os.cpu_count() or 1
        self.procs: list[subprocess.Popen] = []
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        # (name, address, namespace host) of each slurmd; the controller's host and address
        if hosts is None:
            self.nodes = [(self.node, "127.0.0.1", None)]
            self.ctl = (self.node, "127.0.0.1", None)
        else:
            self.nodes = [(f"n{i}", hosts.ips[i], i) for i in range(1, len(hosts.ips))]
            self.ctl = (self.node, hosts.ips[0], 0)  # (slurmctld runs only where its name is the host's)

    def start(self, timeout_s: float = 60.0) -> "SlurmCluster":
        r = self.root
        for d in ("state", "spool"):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn(
            [
                _bin("munged"),
                "-F",
                "-f",
                f"--key-file={key}",
                f"--socket={r / 'munge.socket'}",
                f"--pid-file={r / 'munged.pid'}",
                f"--log-file={r / 'munged.log'}",
                f"--seed-file={r / 'munged.seed'}",
            ],
            "munged.out",
        )
        self._wait(lambda: (r / "munge.socket").exists(), "munged's socket", timeout_s)
        spool = r / "spool" / "%n"
        for name, _, _ in self.nodes:
            (r / "spool" / name).mkdir(parents=True, exist_ok=True)
        ctl_name, ctl_addr, ctl_host = self.ctl
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=asyncrltest",
                    f"SlurmctldHost={ctl_name}({ctl_addr})",
                    f"SlurmctldPort={_port()}",
                    f"SlurmdPort={_port()}",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={r / 'munge.socket'}",
                    "CredType=cred/munge",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={spool}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
                    f"SlurmctldLogFile={r / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'slurmd-%n.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "JobCompType=jobcomp/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    # (on one machine, only the loopback address; across namespace hosts srun, which tells a step
                    # daemon the address to call back, listens on every interface of its own host: lo and eth0)
                    *(["CommunicationParameters=NoInAddrAny"] if self.hosts is None else []),
                    "KillWait=60",
                    *[
                        f"NodeName={name} NodeAddr={addr} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
                        for name, addr, _ in self.nodes
                    ],
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        self._spawn([_bin("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld.out", ctl_host)
        for name, _, host in self.nodes:
            self._spawn([_bin("slurmd"), "-D", "-f", str(self.conf), "-N", name], f"slurmd-{name}.out", host)

        def all_idle() -> bool:
            states = self.run("sinfo", "-h", "-N", "-o", "%T").stdout.split()
            return len(states) == len(self.nodes) and all(s == "idle" for s in states)

        self._wait(all_idle, f"{len(self.nodes)} idle node(s)", timeout_s)
        return self

    def argv(self, argv: list[str], host: int | None) -> list[str]:
        return argv if host is None or self.hosts is None else self.hosts.enter(host, argv)

    def _spawn(self, argv: list[str], out: str, host: int | None = None) -> None:
        with open(self.root / out, "ab") as f:
            self.procs.append(
                subprocess.Popen(
                    self.argv(argv, host), stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
                )
            )

    def _wait(self, cond, what: str, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if cond():
                return
            dead = [" ".join(p.args[:7]) for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited while waiting for {what}: {self.logs()}")
            time.sleep(0.3)
        raise RuntimeError(f"no {what} within {timeout_s:g} s: {self.logs()}")

    def logs(self) -> str:
        return " | ".join(
            f"{p.name}: {p.read_text()[-600:]}"
            for p in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log"))
            if p.is_file()
        )

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A SLURM command, on the controller's host."""
        return subprocess.run(
            self.argv([_bin(argv[0]), *argv[1:]], self.ctl[2]),
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
        )

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def job_state(self, job: str) -> str:
        out = self.run("scontrol", "show", "job", job).stdout
        for part in out.split():
            if part.startswith("JobState="):
                return part.split("=", 1)[1]
        return "GONE"

    def wait_gone(self, job: str, timeout_s: float) -> str:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            state = self.job_state(job)
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"):
                return state
            time.sleep(1.0)
        raise TimeoutError(f"job {job} still {self.job_state(job)} after {timeout_s:g} s")

    def stop(self) -> None:
        """Cancel every job, stop the daemons (SIGTERM, then SIGKILL), end any step daemon left."""
        try:
            for job in self.jobs():
                self.run("scancel", job, timeout=30)
        except Exception:  # noqa: BLE001 - stopping anyway
            pass
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 20
        while time.time() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.2)
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for pid in stepds(self.root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def stepds(root: Path) -> list[int]:
    """slurmstepd processes of the cluster in ``root`` (they outlive slurmd by design)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            env = (d / "environ").read_bytes() if b"slurmstepd" in cmd else b""
        except OSError:
            continue
        if b"slurmstepd" in cmd and str(root).encode() in env:
            out.append(int(d.name))
    return out
