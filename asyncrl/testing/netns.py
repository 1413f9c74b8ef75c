"""A test cluster of hosts made of Linux network namespaces (as root), for the tests that cross real
interfaces: ``n`` hosts, each a namespace with its own loopback and one interface ``eth0`` with its
own address in the benchmarking range 198.18.0.0/15 (never routed to the machine's interfaces),
all joined by veth pairs to a bridge in a namespace of its own (the switch), so that any host,
the first one too, can be cut off and brought back.

    with Hosts(3) as hosts:
        p = hosts.run(0, ["python", "-m", "asyncrl", "learn", ...], log)   # a process on host 0
        hosts.cut(1); hosts.restore(1)                                      # host 1's link down / up
        hosts.kill(2)                                                       # every process on host 2
        hosts.listening(0)                                                  # host 0's listening TCP sockets

Leaving the ``with`` block (also on an exception, and at interpreter exit if it never gets there)
kills every process in the namespaces, waits for them to be gone and deletes the namespaces, and
with them the veths and the bridge. A run killed before it gets there (a time limit) leaves them:
entering ``Hosts`` first sweeps the namespaces whose test process is gone (:func:`sweep_stale`). The namespaces share the machine's filesystem, users and
processes: only the network is each host's own.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "198.18.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (make test installs it)"
    return None


_OURS = re.compile(r"^arl[0-9a-f]{6}(?:p(\d+))?(?:S|H\d+)$")


def sweep_stale() -> list[str]:
    """Delete the namespaces a killed test run left (a run killed at its time limit never reaches its
    ``finally``): those whose creating process is gone, and those of the older unnamed format that hold
    no process. Their processes are killed first. Returns the names deleted."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    gone = []
    for line in listed:
        name = line.split(" ", 1)[0].strip()
        m = _OURS.match(name)
        if not m:
            continue
        pids = [int(p) for p in _ip("netns", "pids", name, check=False).stdout.split() if p.isdigit()]
        if m.group(1) is not None:
            try:
                os.kill(int(m.group(1)), 0)
                continue  # its test process is alive: not ours to touch
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        elif pids:
            continue
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while pids and time.monotonic() < deadline:
            pids = [int(p) for p in _ip("netns", "pids", name, check=False).stdout.split() if p.isdigit()]
            time.sleep(0.1)
        if _ip("netns", "delete", name, check=False).returncode == 0:
            gone.append(name)
    return gone


class Hosts:
    """``n`` namespace hosts on one bridge; ``ips[i]`` is host ``i``'s address, ``names[i]`` its
    namespace."""

    def __init__(self, n: int):
        tag = secrets.token_hex(3)
        owner = f"arl{tag}p{os.getpid()}"  # (the test process's pid: a later run sweeps what a killed one left)
        self.switch = f"{owner}S"
        self.names = [f"{owner}H{i}" for i in range(n)]
        self.ports = [f"v{tag}P{i}" for i in range(n)]  # the switch's end of each host's veth pair
        self.ips = [f"{SUBNET}.{10 + i}" for i in range(n)]
        self.made: list[str] = []

    def __enter__(self) -> "Hosts":
        sweep_stale()
        atexit.register(self.close)
        try:
            for ns in (self.switch, *self.names):
                _ip("netns", "add", ns)
                self.made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for ns, port, addr in zip(self.names, self.ports, self.ips):
                _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- processes ----------------------------------------------------------------------------------
    def argv(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` as run on ``host``."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def enter(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` in ``host``'s network namespace only (``nsenter``): ``ip netns exec`` also mounts a
        sysfs of the namespace's own, which has no cgroup tree (slurmd needs the machine's)."""
        return ["nsenter", f"--net=/run/netns/{self.names[host]}", "--", *argv]

    def run(self, host: int, argv: list[str], log: Path, env: dict | None = None, cwd=None) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in a session of its own, its output appended to ``log``."""
        with open(log, "ab") as f:
            return subprocess.Popen(
                self.argv(host, argv),
                cwd=cwd,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def call(self, host: int, argv: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to its end (output captured as text)."""
        return subprocess.run(self.argv(host, argv), capture_output=True, text=True, timeout=timeout, **kw)

    def pids(self, host: int | None = None) -> list[int]:
        """The processes on ``host`` (every host and the switch with None)."""
        names = self.made if host is None else [self.names[host]]
        out = []
        for ns in names:
            out += [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
        return out

    def kill(self, host: int | None = None, timeout: float = 60) -> None:
        """SIGKILL every process on ``host`` (every host with None) and wait until they are gone."""
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids(host)
            if not pids or time.monotonic() > deadline:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    # -- links --------------------------------------------------------------------------------------
    def cut(self, host: int) -> None:
        """Take ``host``'s link down at the switch (its packets go nowhere; its sockets stay open)."""
        _ip("-n", self.switch, "link", "set", self.ports[host], "down")

    def restore(self, host: int) -> None:
        _ip("-n", self.switch, "link", "set", self.ports[host], "up")

    def listening(self, host: int) -> list[tuple[str, str]]:
        """``(local address:port, process)`` of every listening TCP socket on ``host``."""
        out = subprocess.run(
            ["ip", "netns", "exec", self.names[host], "ss", "-tlnpH"], capture_output=True, text=True, check=True
        ).stdout
        rows = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 4:
                rows.append((parts[3], " ".join(parts[5:])))
        return rows

    def close(self) -> None:
        """Kill every process in the namespaces, wait for them to go, delete the namespaces (their
        veths and the bridge go with them). Idempotent."""
        if not self.made:
            return
        self.kill(None)
        for ns in self.made:
            _ip("netns", "del", ns, check=False)
        self.made = []
