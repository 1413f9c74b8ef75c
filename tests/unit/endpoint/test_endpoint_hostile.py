"""Issue 63.3-63.7: the rollout endpoint against hostile clients. Request heads are capped in size and
header count (431, closed before more is buffered) and have a deadline of their own (a slow-loris
that sends a header line now and then is closed); a prompt too big to tokenise in good time, or
longer than the model's context, is a 400 that says so while other sessions are served; a deeply
nested body is a 400, not a 500; the clients lent to agents reach the endpoint through a private Unix
socket, whose connections a client filling the TCP port's cannot take. Real uvicorn, real sockets,
the real HF engine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

import asyncrl.endpoint.core as endpoint_mod
from asyncrl.endpoint.client import LoopbackTransport
from asyncrl.envs.agent import _context_tokens
from tests.conftest import ROOT, subprocess_env

BODY = {"model": "policy", "messages": [{"role": "user", "content": "1+1="}]}


def _head(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n".encode() + extra + b"\r\n" + body


def _answer(sock: socket.socket, timeout: float = 30) -> bytes:
    sock.settimeout(timeout)
    out = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return out


def _path(ep, s) -> str:
    return s.base_url.split(str(ep.port), 1)[1] + "/chat/completions"


def test_an_endless_header_line_is_refused_before_it_is_buffered(serving):
    ep = serving()
    s = ep.open(budget=None)
    c = socket.create_connection(("127.0.0.1", ep.port), timeout=30)
    sent = 0
    try:
        c.sendall(f"POST {_path(ep, s)} HTTP/1.1\r\nX-Long: ".encode())
        while sent < 16 << 20:  # a 16 MiB header line, 64 KiB at a time
            c.sendall(b"a" * 65536)
            sent += 65536
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer = _answer(c)
    c.close()
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert sent < 4 << 20, sent  # refused long before the 16 MiB were sent
    # 200 short headers: the count is capped too
    c = socket.create_connection(("127.0.0.1", ep.port), timeout=30)
    data = json.dumps(BODY).encode()
    c.sendall(_head(_path(ep, s), data, b"".join(b"X-%d: 1\r\n" % i for i in range(200))))
    answer = _answer(c)
    c.close()
    assert answer.startswith(b"HTTP/1.1 431") and b"header lines" in answer, answer[:300]
    assert httpx.post(f"{s.base_url}/chat/completions", json=BODY, timeout=60).status_code == 200  # others served


def test_a_slow_loris_head_is_closed_at_its_deadline(serving, monkeypatch):
    """One header line every 0.3 s re-armed the idle timer for ever; the head now has a deadline of
    READ_TIMEOUT_S from its first byte."""
    monkeypatch.setattr(endpoint_mod, "READ_TIMEOUT_S", 2.0)
    ep = serving()
    s = ep.open(budget=None)
    c = socket.create_connection(("127.0.0.1", ep.port), timeout=30)
    c.sendall(f"POST {_path(ep, s)} HTTP/1.1\r\n".encode())
    t0, closed = time.monotonic(), None
    try:
        for i in range(100):  # 30 s of dribbling at most
            c.sendall(b"X-Drip-%d: 1\r\n" % i)
            time.sleep(0.3)
    except (BrokenPipeError, ConnectionResetError):
        closed = time.monotonic() - t0
    c.close()
    assert closed is not None and closed < 15, closed


def test_a_prompt_too_big_is_a_400_and_the_other_sessions_are_served(serving, random_engine):
    ep = serving()
    ep.configure(ep.sampling, random_engine.eos_ids, _context_tokens(random_engine))
    assert ep.context_tokens == 256
    s, other = ep.open(budget=None), ep.open(budget=None)
    url = f"{s.base_url}/responses"
    t0 = time.monotonic()
    r = httpx.post(url, json={"model": "policy", "input": "7" * (7 << 20)}, timeout=120)  # 7 MB, under the body cap
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long", r.text[:300]
    many = {"model": "policy", "messages": [{"role": "user", "content": "1"}] * 200_000}
    r = httpx.post(f"{s.base_url}/chat/completions", json=many, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_items", r.text[:300]
    long = {"model": "policy", "messages": [{"role": "user", "content": "1+" * 200}]}  # 400 tokens: past 256
    r = httpx.post(f"{s.base_url}/chat/completions", json=long, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert "256 tokens" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 60
    assert httpx.post(f"{other.base_url}/chat/completions", json=BODY, timeout=60).status_code == 200


def test_a_deeply_nested_body_is_a_400(serving):
    ep = serving()
    s = ep.open(budget=None)
    for depth in (100, 100_000):
        raw = b'{"model": "policy", "messages": ' + b"[" * depth + b"]" * depth + b"}"
        r = httpx.post(
            f"{s.base_url}/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=60
        )
        assert r.status_code == 400 and r.json()["error"]["code"] in ("too_deep", "invalid_json"), (depth, r.text[:300])


def test_the_agents_unix_socket_is_served_when_the_tcp_port_is_full(serving, monkeypatch):
    """Every TCP connection slot held (as another local user can): a TCP client gets 503, the clients
    lent to agents (the endpoint's private Unix socket) are served."""
    monkeypatch.setattr(endpoint_mod, "MAX_CONNECTIONS", 8)
    ep = serving()
    s = ep.open(budget=None)
    assert os.stat(os.path.dirname(ep.server.uds_path)).st_mode & 0o777 == 0o700
    held = [socket.create_connection(("127.0.0.1", ep.port), timeout=30) for _ in range(8)]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # (the server has taken all eight)
            r = httpx.post(f"{s.base_url}/chat/completions", json=BODY, timeout=30)
            if r.status_code == 503:
                break
            time.sleep(0.1)
        assert r.status_code == 503
        with httpx.Client(transport=LoopbackTransport(uds=ep.server.uds_path), trust_env=False) as client:
            r = client.post(f"{s.base_url}/chat/completions", json=BODY, timeout=60)
        assert r.status_code == 200 and r.json()["choices"], r.text[:300]
    finally:
        for c in held:
            c.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="playing another local user needs root (setuid)")
def test_another_user_cannot_reach_the_agents_unix_socket(serving):
    ep = serving()
    res = subprocess.run(
        [sys.executable, "-m", "tests.support.other_user", "uds", "2", ep.server.uds_path],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["uid"] == 65534 and out["connected"] is False, out
