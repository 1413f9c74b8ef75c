"""Helpers of the Ray tests (``tests/e2e/test_ray.py``, ``tests/e2e/test_ray_hosts.py``): the
``asyncrl run`` driver as a process with its output collected, process and socket listings, the
run's records, and Ray's environment (token authentication) as a fixture."""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncrl.analysis.jsonl import quiet_records
from tests.conftest import ROOT, subprocess_env

DEADLINE_S = 300


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _listening(pids: set[int]) -> list[tuple[str, int]]:
    """(local address, pid) of every TCP listening socket owned by ``pids`` (``ss -tlnp``)."""
    out = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                found.append((parts[3], pid))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Driver:
    """``asyncrl run --scheduler ray`` as a process of its own, its output collected."""

    def __init__(self, args: list[str], env: dict, prefix: list[str] | None = None):
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "asyncrl", "run", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, condition, what: str, timeout: float = DEADLINE_S) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if condition():
                return
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"asyncrl run exited ({self.proc.returncode}) waiting for {what}:\n{self.text[-4000:]}"
                )
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}:\n{self.text[-4000:]}")

    def check_stopped_output(self) -> None:
        """(After a Ctrl-C) issue 42.5: the driver says how to resume, as a local run does, and Ray's
        restart warning (a core_worker.cc error line on every run) is gone."""
        deadline = time.time() + 30  # (the reader thread takes the last lines)
        while time.time() < deadline and "--resume" not in self.text:
            time.sleep(0.2)
        hint = self.text.split("Resume with (the same cluster):\n", 1)[-1].splitlines()[0]
        # (written as the run was started: here `python -m asyncrl`, 64.4)
        assert re.match(r"  (asyncrl|\S+ -m asyncrl|\S*/asyncrl) run ", hint) and hint.endswith(" --resume"), self.text[
            -2000:
        ]
        assert "core_worker.cc" not in self.text

    def actor_nodes(self, by: str = "id") -> dict[str, str]:
        """actor id -> the node id prefix (``by="ip"``: the node's address) it (last) started on, from
        the driver's lines."""
        out = {}
        for line in self.lines:
            m = re.search(r"(actor-\d+) (?:started|restarted) on node (\S+) \(.*id (\w+)\)", line)
            if m:
                out[m.group(1)] = m.group(3) if by == "id" else m.group(2)
        return out


def _events(run: Path, kind: str) -> list[dict]:
    return [r for r in quiet_records(run / "events.jsonl") if r.get("kind") == kind]


def _metrics(run: Path) -> list[dict]:
    return quiet_records(run / "metrics.jsonl")


@pytest.fixture
def ray_env(monkeypatch):
    """Ray pinned to loopback with token authentication, for this process (the cluster) and the driver."""
    env = {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_DISABLE_USAGE_STATS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return {**subprocess_env(), **env}
