"""Past one machine, on hosts made of network namespaces (``asyncrl/testing/netns.py``): each host has its own
interface and address, and the processes on different hosts meet only over the veths.

- A learner group across two hosts: the tests' step worker as rank 0 on one host and rank 1 on
  another (gloo over the veths; the group's store on the first host's address, with its secret and
  CURVE) gives a DDP and an FSDP2 step equal to one process's within 1e-5, and every socket of it
  listens on a host's own address.
- ``asyncrl learn`` as a group across two hosts (DDP), with an actor on a third: it trains, rank 1
  says it is ready and stops with rank 0, and ``ss`` on every host shows the run's listening
  sockets on that host's own address only.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from asyncrl.testing import netns
from asyncrl.wire.sockets import make_curve_keys
from tests.conftest import ROOT, read_jsonl, subprocess_env
from tests.support.dist_step_worker import assert_matches, one_step

pytestmark = pytest.mark.slow

WORKER = ROOT / "tests" / "support" / "dist_step_worker.py"
STEP_CASES = ["token-mean", "shared_prefix", "micro_seq-mean-token-sum", "skip_rows"]


@pytest.fixture
def hosts():
    why = netns.available()
    if why:
        pytest.fail(why)
    with netns.Hosts(3) as h:
        yield h


def _group_env(hosts, rank: int, port: int, secret: str, curve: Path) -> dict:
    return {
        **subprocess_env(),
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": hosts.ips[0],
        "MASTER_PORT": str(port),
        "ASYNCRL_STORE_SECRET": secret,
        "OMP_NUM_THREADS": "1",
        "DIST_WORKER_CURVE": str(curve),
    }


def _own_addresses_only(hosts, host: int, seen: list) -> None:
    """Every listening TCP socket on ``host`` is on its own address (none on every interface)."""
    for addr, proc in hosts.listening(host):
        seen.append((host, addr, proc))
        assert addr.rsplit(":", 1)[0] == hosts.ips[host], f"host {host} listens on {addr} ({proc})"


def _wait(procs: dict, logs: Path, cond=lambda: False, timeout: float = 300, during=None) -> None:
    """Until ``cond()`` or every process has exited; a process that fails fails the test with the logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if during:
            during()
        for name, p in procs.items():
            if p.poll() not in (None, 0):
                raise AssertionError(f"{name} exited {p.returncode}:\n" + _tails(logs))
        if cond() or all(p.poll() is not None for p in procs.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s:\n" + _tails(logs))


def _tails(logs: Path) -> str:
    return "\n".join(f"--- {q.name}:\n{q.read_text()[-2000:]}" for q in sorted(logs.glob("*.log")))


def test_a_learner_group_across_two_hosts_steps_as_one_process(hosts, tmp_path, tiny_overrides):
    keys = make_curve_keys(str(tmp_path / "keys"), ["rank1"])
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    logs.mkdir()
    secret, port = secrets.token_hex(16), 29611
    env = {"DIST_WORKER_CASES": ",".join(STEP_CASES)}
    procs = {
        f"rank{r}": hosts.run(
            r,
            [sys.executable, str(WORKER), str(out), *tiny_overrides],
            logs / f"rank{r}.log",
            env={**_group_env(hosts, r, port, secret, Path(keys[bundle])), **env},
            cwd=ROOT,
        )
        for r, bundle in ((0, "server"), (1, "actor-rank1"))
    }
    seen: list = []
    _wait(procs, logs, during=lambda: [_own_addresses_only(hosts, h, seen) for h in (0, 1)])
    assert all(p.returncode == 0 for p in procs.values()), _tails(logs)
    assert any(h == 0 and addr == f"{hosts.ips[0]}:{port}" for h, addr, _ in seen), seen  # the store, seen
    assert any(h == 1 for h, _, _ in seen), f"no socket of rank 1 (gloo) was seen listening: {seen}"
    for case in STEP_CASES:
        ref, _ = one_step(tiny_overrides, "none", case)
        for mode in ("ddp", "fsdp2"):
            assert_matches(load_file(out / f"{mode}_{case}.safetensors"), ref, f"{mode} {case} across hosts")


def test_a_learner_group_across_hosts_trains_with_an_actor_on_a_third(hosts, tmp_path, tiny_overrides):
    from tests.conftest import SMALL_RUN

    keys = make_curve_keys(str(tmp_path / "keys"), ["rank1", "0"])
    logs = tmp_path / "logs"
    logs.mkdir()
    run = tmp_path / "runs" / "group"
    total = 6
    common = [
        "-c",
        "configs/quickstart.yaml",
        *tiny_overrides,
        *SMALL_RUN,
        f"run_root={tmp_path / 'runs'}",
        "name=group",
        f"train.total_steps={total}",
        "train.distributed=ddp",
    ]
    secret, port = secrets.token_hex(16), 29612
    cli = [sys.executable, "-m", "asyncrl"]
    procs = {
        "rank0": hosts.run(
            0,
            [*cli, "learn", *common, f"wire.host={hosts.ips[0]}", f"wire.curve_dir={keys['server']}"],
            logs / "rank0.log",
            env=_group_env(hosts, 0, port, secret, Path(keys["server"])),
            cwd=ROOT,
        ),
        "rank1": hosts.run(
            1,
            [*cli, "learn", *common, f"wire.curve_dir={keys['actor-rank1']}"],
            logs / "rank1.log",
            env=_group_env(hosts, 1, port, secret, Path(keys["actor-rank1"])),
            cwd=ROOT,
        ),
    }
    try:
        _wait(procs, logs, cond=lambda: (run / "addresses.json").exists())
        control = json.loads((run / "addresses.json").read_text())["control"]
        assert control.startswith(f"tcp://{hosts.ips[0]}:"), control
        procs["actor"] = hosts.run(
            2,
            [
                *cli,
                "serve",
                *common,
                "--connect",
                control,
                "--actor-id",
                "actor-0",
                f"wire.curve_dir={keys['actor-0']}",
            ],
            logs / "actor.log",
            env=subprocess_env(),
            cwd=ROOT,
        )
        seen: list = []
        _wait(
            {k: procs[k] for k in ("rank0", "rank1")},
            logs,
            timeout=400,
            during=lambda: [_own_addresses_only(hosts, h, seen) for h in (0, 1, 2)],
        )
        assert procs["rank0"].returncode == 0 and procs["rank1"].returncode == 0, _tails(logs)
    finally:
        hosts.kill(None)
    rank1 = (logs / "rank1.log").read_text()
    assert "ready (ddp, 2 ranks)" in rank1 and f"stopping after {total} step(s)" in rank1, rank1[-2000:]
    assert "2 learner processes (ddp)" in (logs / "rank0.log").read_text()
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, total + 1))
    assert all(m["grad_norm"] > 0 for m in metrics)
    episodes = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "episode"]
    assert episodes and {e["actor_id"] for e in episodes} == {"actor-0"}
    assert max(e["policy_version"] for e in episodes) >= 1  # the actor on host 2 loaded the group's weights
    listening = {(h, addr.rsplit(":", 1)[0]) for h, addr, _ in seen}
    assert (0, hosts.ips[0]) in listening and (1, hosts.ips[1]) in listening, seen
