"""The transport of the clients lent to agent rollouts (asyncrl.endpoint.client): the real
``openai`` clients (sync and async) over it against the real endpoint (uvicorn, HF engine), streamed
and whole answers, connections the server closed while idle, and peers that fail (a closed
connection, silence, a refused port), each reported as httpx reports them."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from asyncrl.endpoint.client import AsyncLoopbackTransport, LoopbackTransport

openai = pytest.importorskip("openai", reason="the envs extra (pip install -e '.[envs]') is not installed")

MESSAGES = [{"role": "user", "content": "1+1="}]


@pytest.fixture
def endpoint(serving, monkeypatch):
    import asyncrl.endpoint.core as endpoint_mod

    monkeypatch.setattr(endpoint_mod, "READ_TIMEOUT_S", 1.0)  # idle connections closed after 1 s
    return serving(max_new_tokens=6)


def _wait_closed_by_server(sock_ready, what: str) -> None:
    deadline = time.monotonic() + 30
    while not sock_ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sock_ready(), f"the server did not close the idle {what} within 30 s"


def test_sync_client_whole_and_streamed_answers_and_a_connection_closed_while_idle(endpoint):
    transport = LoopbackTransport()
    client = openai.OpenAI(
        base_url="http://127.0.0.1/v1",
        api_key="-",
        max_retries=0,
        timeout=60,
        http_client=httpx.Client(transport=transport, trust_env=False),
    )
    s = endpoint.open(None)
    c = client.with_options(base_url=s.base_url, api_key=s.token)
    whole = c.chat.completions.create(model="policy", messages=MESSAGES)
    seg = s.segments[0]
    assert whole.choices[0].model_extra["token_ids"] == seg.ids[len(whole.model_extra["prompt_token_ids"]) :]
    stream = c.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "2+2="}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)  # chunked transfer encoding, read as it comes
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == s.segments[1].texts[0] and chunks[-1].usage.completion_tokens == sum(s.segments[1].mask)
    origin = ("127.0.0.1", endpoint.port)
    assert len(transport.idle[origin]) == 1  # one kept-alive connection served both calls
    sock = transport.idle[origin][0]
    from asyncrl.endpoint.client import _stale

    _wait_closed_by_server(lambda: _stale(sock), "connection")
    again = c.chat.completions.create(model="policy", messages=MESSAGES)  # on a new connection
    assert again.choices[0].model_extra["token_ids"] and len(transport.idle[origin]) == 1
    assert transport.idle[origin][0] is not sock
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=MESSAGES)  # an error answer, as from any server
    s.close()
    client.close()
    assert not transport.idle


def test_async_client_over_the_transport(endpoint):
    async def main():
        transport = AsyncLoopbackTransport()
        client = openai.AsyncOpenAI(
            base_url="http://127.0.0.1/v1",
            api_key="-",
            max_retries=0,
            timeout=60,
            http_client=httpx.AsyncClient(transport=transport, trust_env=False),
        )
        sessions = [endpoint.open(None) for _ in range(8)]
        clients = [client.with_options(base_url=s.base_url, api_key=s.token) for s in sessions]
        replies = await asyncio.gather(*[c.chat.completions.create(model="policy", messages=MESSAGES) for c in clients])
        for s, r in zip(sessions, replies):
            assert r.choices[0].model_extra["token_ids"] == s.segments[0].ids[len(r.model_extra["prompt_token_ids"]) :]
        stream = await clients[0].chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "3="}], stream=True
        )
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert text == sessions[0].segments[1].texts[0]
        origin = ("127.0.0.1", endpoint.port)
        conns = list(transport.idle[origin])
        assert 1 <= len(conns) <= 8
        deadline = time.monotonic() + 30  # (the loop must run to see the server's close)
        while not all(r.at_eof() for r, _ in conns) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert all(r.at_eof() for r, _ in conns), "the server did not close the idle connections within 30 s"
        again = await clients[1].chat.completions.create(model="policy", messages=MESSAGES)
        assert again.choices[0].model_extra["token_ids"]
        await client.close()
        for s in sessions:
            s.close()

    asyncio.run(main())


def _peer(behaviour: str):
    """A real TCP peer that accepts one connection and then closes it at once, or reads and stays silent."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    held = []

    def run():
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        if behaviour == "close":
            conn.close()
        else:
            conn.recv(65536)
            held.append(conn)

    threading.Thread(target=run, daemon=True).start()
    return srv, held


def test_failing_peers_are_httpx_errors():
    client = httpx.Client(transport=LoopbackTransport(), trust_env=False)
    srv, _ = _peer("close")
    with pytest.raises(httpx.RemoteProtocolError, match="without answering"):
        client.post(f"http://127.0.0.1:{srv.getsockname()[1]}/v1/x", json={})
    srv.close()
    srv, held = _peer("silent")
    with pytest.raises(httpx.ReadTimeout):
        client.post(f"http://127.0.0.1:{srv.getsockname()[1]}/v1/x", json={}, timeout=0.5)
    srv.close()
    for c in held:
        c.close()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    with pytest.raises(httpx.ConnectError):
        client.get(f"http://127.0.0.1:{port}/v1/models")
    with pytest.raises(httpx.UnsupportedProtocol):
        client.get("https://127.0.0.1:1/v1/models")
    client.close()
