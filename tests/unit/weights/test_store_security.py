"""The rendezvous stores asyncrl serves (the ``nccl`` weight-sync group's, and the learner group's
under ``asyncrl run --learner-procs``) bind only their host, answer only requests that carry their
secret, hold a bounded amount, and never wait twice for a member that did not come (issue 25, 1).
The attacks are the ones a process on the same host can make: a bare ``TCPStore`` client, our own
client without the secret, 300 x 1 MiB sets, and an admitted peer that registers and never comes."""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from asyncrl.weights.collective import CollectivePublisher
from asyncrl.weights.rendezvous import StoreClient, StoreError, StoreServer
from tests.conftest import ROOT, kill_tree, subprocess_env
from tests.support.collective_peer import expected
from tests.unit.weights.test_sync_collective import Peer, _until


def _listening(port: int) -> list[str]:
    """The local addresses ``ss`` shows listening on ``port``."""
    out = subprocess.run(["ss", "-Htln"], capture_output=True, text=True, check=True).stdout
    return [f[3] for f in (line.split() for line in out.splitlines()) if len(f) > 3 and f[3].endswith(f":{port}")]


def _cfg(timeout_s: float = 10.0):
    return SimpleNamespace(backend="gloo", timeout_s=timeout_s, group_host="127.0.0.1", group_port=0)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_weight_sync_store_binds_only_its_host_and_answers_only_its_secret():
    pub = CollectivePublisher(_cfg())
    try:
        port = pub.server.port
        assert _listening(port) == [f"127.0.0.1:{port}"], _listening(port)  # not *:PORT

        # a bare TCPStore client (the attack of issue 25) cannot even talk to it
        with pytest.raises(Exception):  # noqa: B017 (whatever torch raises: the point is that it cannot talk)
            dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=3))
        # our own client without the secret: refused, nothing kept
        stranger = StoreClient("127.0.0.1", port, "not-the-secret", timeout_s=10)
        with pytest.raises(StoreError, match="secret"):
            stranger.add("reg", 1)
        with pytest.raises(StoreError, match="secret"):
            stranger.set("reg/1", "evil")
        before = _rss_mb()
        for _ in range(300):
            with pytest.raises(StoreError):
                stranger.set(f"junk/{_}", b"x" * ((1 << 20) - 100))  # 1 MiB less a little
        assert pub.server.table.total == 0 and not pub.server.table.data
        assert _rss_mb() - before < 100, (before, _rss_mb())  # not 300 MB held
        assert pub.server.table.refused >= 302
        stranger.close()
        pub.poll()
        assert pub._pending == [] and pub.epoch == 0  # no registration came through
    finally:
        pub.close()


def test_store_bounds_what_it_holds_even_for_its_members():
    server = StoreServer("127.0.0.1", 0, max_keys=8, max_value_bytes=1024, max_total_bytes=4096)
    member = StoreClient("127.0.0.1", server.port, server.secret, timeout_s=10)
    try:
        member.set("a", b"1" * 1000)
        with pytest.raises(StoreError, match="1024"):
            member.set("b", b"1" * 1100)
        for k in range(3):
            member.set(f"k{k}", b"2" * 1000)
        with pytest.raises(StoreError, match="4096 bytes"):
            member.set("k3", b"2" * 1000)
        for k in range(3):
            member.delete_key(f"k{k}")
        for k in range(7):
            member.set(f"s{k}", b"3")
        with pytest.raises(StoreError, match="8 keys"):
            member.set("s7", b"3")
        assert len(server.table.data) == 8 and server.table.total <= 4096
        assert member.get("a") == b"1" * 1000  # what it holds is intact
        # 41.1: a full store stopped the learner (an uncaught StoreError on its next announcement); the
        # serving process's own writes are never refused
        local = server.local(5)
        local.set("latest", "7")
        assert local.add("bell/1", 1) == 1 and server.table.data["latest"] == b"7"
        with pytest.raises(StoreError, match="8 keys"):  # (members still are)
            member.set("s8", b"3")
        # a message past the size bound is dropped by ZeroMQ before it is read: nothing held
        big = StoreClient("127.0.0.1", server.port, server.secret, timeout_s=3)
        with pytest.raises(StoreError):
            big.set("huge", b"x" * (4 << 20))
        assert "huge" not in server.table.data
        big.close()
    finally:
        member.close()
        server.close()


@pytest.mark.slow
def test_a_member_that_never_comes_is_not_waited_for_again():
    """An admitted peer that holds the secret and lies (registers, never joins the group): the next
    group formation fails once, within the timeout, and that member is never waited for again; the
    real actor goes on receiving versions."""
    pub = CollectivePublisher(_cfg(timeout_s=5.0))
    peer = None
    liar = StoreClient("127.0.0.1", pub.server.port, pub.server.secret, timeout_s=10)
    try:
        pub.frames(expected(1), 1)
        peer = Peer(pub, 4)
        _until(lambda: len(pub.members) == 1 and 1 in peer.versions(), "the real actor at v1", pub)
        n = liar.add("reg", 1)
        liar.set(f"reg/{n}", "liar-token")
        t0 = time.monotonic()
        pub.poll()  # forms a group with the liar: it times out once
        assert pub.pg is None and "liar-token" in pub.never_came, (pub.last_error, pub.never_came)
        assert time.monotonic() - t0 < 30
        n = liar.add("reg", 1)  # registering again does not bring it back
        liar.set(f"reg/{n}", "liar-token")
        _until(lambda: pub.pg is not None and len(pub.members) == 1, "the real actor back alone", pub)
        assert "liar-token" not in pub.members
        for v in (2, 3, 4):
            pub.frames(expected(v), v)
        assert peer.proc.wait(timeout=120) == 0, peer.lines
        assert peer.versions()[-1] == 4 and not any(x.startswith("bad") for x in peer.lines), peer.lines
        assert pub.pg is not None and "liar-token" not in pub.members
    finally:
        liar.close()
        if peer is not None:
            kill_tree(peer.proc)
        pub.close()


def test_learner_group_store_binds_only_master_addr():
    """``asyncrl run --learner-procs`` groups meet at rank 0's store: bound to MASTER_ADDR alone and
    answering only ASYNCRL_STORE_SECRET (a one-rank group shows the bind)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        subprocess_env(),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ASYNCRL_STORE_SECRET="s3cret",
    )
    code = (
        "import subprocess, sys\n"
        "from asyncrl.learner.training import distributed as d\n"
        "print(d.init_from_env(30))\n"
        f"print(subprocess.run(['ss', '-Htln'], capture_output=True, text=True).stdout)\n"
        "from asyncrl.weights.rendezvous import StoreClient, StoreError\n"
        f"c = StoreClient('127.0.0.1', {port}, 'wrong', timeout_s=10)\n"
        "try:\n    c.set('x', 'y'); print('ACCEPTED')\nexcept StoreError as e:\n    print('REFUSED', e)\n"
        "c.close(); d.leave_group()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(0, 1)" in out.stdout
    listening = [line.split()[3] for line in out.stdout.splitlines() if re.search(rf":{port}\s", line)]
    assert listening == [f"127.0.0.1:{port}"], out.stdout
    assert "REFUSED" in out.stdout and "ACCEPTED" not in out.stdout
