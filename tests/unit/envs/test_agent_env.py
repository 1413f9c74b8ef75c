"""env.type=agent: agent code over the actor's OpenAI-compatible endpoint (asyncrl.endpoint.core),
with the real HF engine, real loopback HTTP and the real ``openai`` client."""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
import time

import httpx
import pytest

from asyncrl.config import ConfigError, SamplingConfig, load_config
from asyncrl.endpoint.core import Endpoint, parse_hermes
from asyncrl.envs.base import make_env
from asyncrl.prompts import render_tokens
from asyncrl.rollout.workflow import RolloutContext, get_workflow
from asyncrl.types import Task
from tests.conftest import read_jsonl, run_cli, subprocess_env

openai = pytest.importorskip("openai", reason="the envs extra (pip install -e '.[envs]') is not installed")


def _tasks(k: int) -> list[Task]:
    return [Task(id=f"t{i}", prompt=[{"role": "user", "content": f"{i}+1="}], answer=str(i + 1)) for i in range(k)]


def _rollout(random_engine, tok, agent: str, *extra: str, tasks=None, n: int = 4):
    cfg = load_config(
        None,
        [
            "env.type=agent",
            f"env.agent={agent}",
            "env.max_turns=4",
            f"sampling.n={n}",
            "sampling.temperature=3.0",
            "sampling.max_new_tokens=8",
            *extra,
        ],
    )
    env = make_env(cfg.env)
    episodes = get_workflow("grpo", cfg).rollout(
        tasks or _tasks(3), RolloutContext(random_engine, tok, env, cfg, "a0", 1)
    )
    return episodes, env


def test_two_chat_calls_train_one_row_of_the_sampled_ids(random_engine, tok, tmp_path, monkeypatch):
    log = tmp_path / "agent.jsonl"
    monkeypatch.setenv("ASYNCRL_TEST_AGENT_LOG", str(log))
    episodes, _ = _rollout(random_engine, tok, "tests.support.agents:two_calls", tasks=_tasks(4))
    rows = [t for ep in episodes for t in ep.trajectories]
    records = read_jsonl(log)
    assert len(rows) == len(records) == 16 and all(not ep.decision for ep in episodes)
    by_ids = {tuple(t.token_ids.tolist()): t for t in rows}
    rebuilt = 0
    for rec in records:
        first, second = rec["calls"]
        # the second call continues the first one's exact ids: prompt + sampled completion (+ EOS) + new turn
        assert (
            second["prompt"][: len(first["prompt"]) + len(first["completion"])] == first["prompt"] + first["completion"]
        )
        row = by_ids[tuple(second["prompt"] + second["completion"])]  # one row: the whole conversation
        mask = row.loss_mask.tolist()
        p1, c1, p2 = len(first["prompt"]), len(first["completion"]), len(second["prompt"])
        assert mask == [0] * p1 + [1] * c1 + [0] * (p2 - p1 - c1) + [1] * len(second["completion"])
        assert row.metadata["turns"] == 2 and row.scores["calls"] == 2.0
        # what re-rendering the transcript would have trained on instead
        text_ids = tok(first["text"], add_special_tokens=False)["input_ids"]
        if text_ids != [t for t in first["completion"] if t != 3]:  # e.g. a special token sampled mid-reply
            rebuilt += 1
            transcript = [
                {"role": "user", "content": row.text and rec["task"] and f"{int(rec['task'][1:])}+1="},
                {"role": "assistant", "content": first["text"]},
                {"role": "user", "content": "again"},
            ]
            assert render_tokens(tok, transcript) != second["prompt"]
    assert rebuilt >= 1, "no completion whose text re-encodes differently: the check above proved nothing"
    # behaviour log-probs are the engine's, on generated tokens only
    for t in rows:
        lp = t.behavior_logprobs[t.loss_mask.astype(bool)]
        assert (lp < 0).all() and (t.behavior_logprobs[~t.loss_mask.astype(bool)] == 0).all()


def test_calls_that_share_no_prefix_are_separate_rows(random_engine, tok, tmp_path, monkeypatch):
    log = tmp_path / "agent.jsonl"
    monkeypatch.setenv("ASYNCRL_TEST_AGENT_LOG", str(log))
    episodes, _ = _rollout(random_engine, tok, "tests.support.agents:two_calls_async", n=2)
    rows = {tuple(t.token_ids.tolist()): t for ep in episodes for t in ep.trajectories}
    records = read_jsonl(log)
    assert len(rows) == 2 * len(records) == 12
    for rec in records:
        for ids in rec["separate"]:
            assert tuple(ids) in rows
    assert {t.group_id for t in rows.values()} == {ep.id for ep in episodes}  # both rows in the task's group


def test_text_completions_route(random_engine, tok):
    episodes, _ = _rollout(random_engine, tok, "tests.support.agents:text_completion", n=2)
    rows = [t for ep in episodes for t in ep.trajectories]
    assert len(rows) == 6
    prompt = tok("12+34=", add_special_tokens=True)["input_ids"]
    for t in rows:
        assert t.token_ids.tolist()[: len(prompt)] == prompt and t.loss_mask[len(prompt) :].all()


@pytest.mark.parametrize(
    "agent, reason",
    [
        ("raises", "raised RuntimeError: the agent broke on purpose"),
        ("hangs", "no result after"),
        ("hangs_async", "no result after"),
        ("wrong_model", "model_not_found"),
        ("never_calls", "made no call to the endpoint"),
        ("returns_text", "returned 'great'"),
    ],
)
def test_a_failing_agent_is_a_recorded_failure(random_engine, tok, agent, reason):
    from tests.support import agents

    agents.RELEASE_HUNG.clear()
    try:
        episodes, env = _rollout(
            random_engine, tok, f"tests.support.agents:{agent}", "env.call_timeout_s=3", n=2, tasks=_tasks(2)
        )
    finally:
        agents.RELEASE_HUNG.set()  # (a hung agent thread would hold the interpreter's exit)
    for ep in episodes:
        assert ep.trajectories == [] and ep.metrics["env/failures"] == 2.0
        assert all(reason in f for f in ep.decision["failures"]), ep.decision["failures"]
    assert env.failures == 4
    # the endpoint still serves the next rollouts
    ok, _ = _rollout(random_engine, tok, "tests.support.agents:two_calls", n=1, tasks=_tasks(1))
    assert len(ok[0].trajectories) == 1


_HUNG_AGENT_PROCESS = """
import sys
from asyncrl.config import load_config
from asyncrl.engine.hf import HFEngine
from asyncrl.envs.base import make_env
from asyncrl.models.loading import load_policy
from asyncrl.rollout.workflow import RolloutContext, get_workflow
from asyncrl.types import Task

cfg = load_config(None, ["env.type=agent", "env.agent=tests.support.agents:hangs", "env.call_timeout_s=2",
                         "sampling.n=2", "sampling.max_new_tokens=4"])
model, tok, _ = load_policy(cfg.model, seed=0, prompt_format=cfg.tasks.prompt_format)
tasks = [Task(id="t0", prompt=[{"role": "user", "content": "1+1="}], answer="2")]
episodes = get_workflow("grpo", cfg).rollout(tasks, RolloutContext(HFEngine(model, tok), tok, make_env(cfg.env),
                                                                   cfg, "a0", 1))
print("failures", episodes[0].metrics["env/failures"], flush=True)
"""


def test_a_hung_agent_does_not_hold_the_process_exit():
    """A plain agent function that never returns runs on a thread the interpreter does not join at
    exit (a ThreadPoolExecutor's were: an actor with a hung agent never exited)."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _HUNG_AGENT_PROCESS],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=300)  # the agents sleep for an hour
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0 and "failures 2.0" in out, out[-2000:]


def test_agent_config_errors_are_one_line():
    with pytest.raises(ConfigError, match="needs env.agent"):
        load_config(None, ["env.type=agent"])
    with pytest.raises(ConfigError, match="env.agent is set"):
        load_config(None, ["env.agent=tests.support.agents:two_calls"])
    cfg = load_config(None, ["env.type=agent", "env.agent=tests.support.agents:nope"])
    with pytest.raises(ConfigError, match="nope"):
        make_env(cfg.env)


def _serving(endpoint, engine, stop):
    while not stop.is_set():
        calls = endpoint.wait_batch(1, timeout=0.1)
        if calls:
            endpoint.serve(engine, calls, seed=0)


def test_endpoint_answers_bad_requests_with_openai_errors(random_engine, tok):
    ep = Endpoint(
        tok, "policy", SamplingConfig(max_new_tokens=4), random_engine.eos_ids, parse_hermes, request_timeout_s=30
    )
    stop = threading.Event()
    server = threading.Thread(target=_serving, args=(ep, random_engine, stop), daemon=True)
    server.start()
    try:
        s = ep.open(budget=2)
        url = f"{s.base_url}/chat/completions"
        ok = {"model": "policy", "messages": [{"role": "user", "content": "1+1="}]}

        def post(body, **kw):
            r = httpx.post(url, content=body if isinstance(body, bytes) else json.dumps(body), timeout=30, **kw)
            return r.status_code, r.json()

        cases = [
            (b"{not json", 400, "invalid_json"),
            ({"model": "gpt-4o", "messages": ok["messages"]}, 404, "model_not_found"),
            ({"model": "policy"}, 400, "invalid_messages"),
            ({**ok, "n": 0}, 400, "invalid_n"),
            (
                {"model": "policy", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                400,
                "invalid_content",
            ),
        ]
        for body, status, code in cases:
            got = post(body)
            assert got[0] == status and got[1]["error"]["code"] == code, (body, got)
        status, out = post({**ok, "n": 3, "max_tokens": 2})
        assert status == 200 and len(out["choices"]) == 3 and all(len(c["token_ids"]) <= 2 for c in out["choices"])
        assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])
        assert httpx.get(f"{s.base_url}/models").json()["data"][0]["id"] == "policy"
        assert post(ok)[0] == 200
        assert post(ok)[1]["error"]["code"] == "call_budget_spent"  # budget 2: the third valid call
        s.close()
        assert post(ok)[1]["error"]["code"] == "episode_ended"  # a call after the episode ends
        assert httpx.get(f"http://127.0.0.1:{ep.port}/v1/models").status_code == 404
        assert ep.server.server_address[0] == "127.0.0.1"
    finally:
        stop.set()
        server.join(5)
        ep.close()


def test_hermes_tool_calls_are_parsed():
    content, calls = parse_hermes('let me add <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert content == "let me add" and calls == [{"name": "add", "arguments": {"a": 1}}]
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


@pytest.mark.slow
def test_agent_run_over_learner_and_actor(tmp_path, tiny_overrides):
    """`asyncrl run` with an agent over learner and actor processes: the trained rows are the agent's
    conversations; failing agents are recorded with their reason and the run finishes. (The trained
    ids equal the endpoint's record: test_two_chat_calls_train_one_row_of_the_sampled_ids, same code.)"""
    log = tmp_path / "agent.jsonl"
    env = subprocess_env()
    env["ASYNCRL_TEST_AGENT_LOG"] = str(log)
    res = run_cli(
        "run",
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=agent",
        "train.total_steps=3",
        "env.type=agent",
        "env.agent=tests.support.agents:two_calls_or_fails",
        "env.max_turns=2",
        "sampling.n=4",
        "sampling.max_new_tokens=6",
        "actor.tasks_per_batch=4",
        "train.batch_tasks=4",
        "eval.size=8",
        "log.progress=false",
        "checkpoint.every=0",
        timeout=400,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    run = tmp_path / "agent"
    assert [m["version"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    recorded = {"\n".join(c["text"] or "" for c in rec["calls"]) for rec in read_jsonl(log)}
    events = read_jsonl(run / "events.jsonl")
    episodes = [e for e in events if e["kind"] == "episode"]
    rows = [t for e in episodes for t in e["trajectories"]]
    assert rows and all(t["text"] in recorded and t["scores"]["calls"] == 2.0 for t in rows)
    failures = [f for e in episodes for f in (e.get("decision") or {}).get("failures", [])]
    failed_tasks = {e["task_id"] for e in episodes if sum(map(ord, e["task_id"])) % 4 == 0}
    assert failed_tasks and len(failures) == 4 * len(failed_tasks)
    assert all("raised ValueError: this task's agent fails" in f for f in failures), failures[:3]
    evals = [e for e in events if e["kind"] == "eval"]  # the held-out evaluation runs the agent on the learner
    assert [e["step"] for e in evals] == [0, 3] and all(e["size"] == 8 for e in evals)


def test_calc_agent_example_parses_and_loads():
    from examples.calc_agent import calculator, parse_calc

    assert parse_calc("calc:12+34") == (None, [{"name": "calculator", "arguments": {"expression": "12+34"}}])
    assert parse_calc("46") == ("46", [])
    assert calculator("12+34") == "46" and calculator("__import__('os')") == "error"
    cfg = load_config("examples/calc_agent.yaml", [])
    env = make_env(cfg.env)
    assert (
        env.fn.__name__ == "solve" and env.parser is parse_calc and "calculator" in cfg.model.embedded.warmstart_formats
    )


def test_many_agents_connect_at_once(random_engine, tok):
    """150 rollouts open their connections together (a held-out evaluation does): none is refused."""
    episodes, env = _rollout(
        random_engine, tok, "tests.support.agents:text_completion", "sampling.max_new_tokens=2", tasks=_tasks(50), n=3
    )
    assert [f for ep in episodes for f in ep.decision.get("failures", [])] == []
    assert sum(len(ep.trajectories) for ep in episodes) == 150 and env.failures == 0


def _raw(port: int, data: bytes, read: bool = True) -> bytes:
    """Send raw bytes to the endpoint and read its answer until it closes (or 10 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(data)
        if not read:
            return b""
        out = b""
        try:
            while chunk := c.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and b"Content-Length: 0" in out:
                    break
                head, _, body = out.partition(b"\r\n\r\n")
                length = re.search(rb"Content-Length: (\d+)", head)
                if length and len(body) >= int(length.group(1)):
                    break
        except (socket.timeout, ConnectionResetError):
            pass
        return out


def test_endpoint_limits_headers_connections_and_idle_readers(random_engine, tok, monkeypatch, capfd):
    """41.6: ``Content-Length: -1`` read 300 MiB past the 8 MiB limit, ``abc`` was a 500, idle and
    slow-loris connections held a thread each for ever, and every reset connection printed a
    traceback. Now: a valid, bounded Content-Length (400/411/413), a cap on connections (503 past
    it), a read timeout, and one line per reset connection (the first three, then every 100th)."""
    import asyncrl.endpoint.core as endpoint_mod

    monkeypatch.setattr(endpoint_mod, "MAX_CONNECTIONS", 8)
    monkeypatch.setattr(endpoint_mod, "READ_TIMEOUT_S", 1.0)
    ep = Endpoint(
        tok, "policy", SamplingConfig(max_new_tokens=4), random_engine.eos_ids, parse_hermes, request_timeout_s=30
    )
    try:
        s = ep.open(budget=None)
        path = s.base_url.split(str(ep.port), 1)[1] + "/chat/completions"
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode()
        for length, status in ((b"-1", b"400"), (b"abc", b"400"), (b"99999999999", b"413")):
            got = _raw(ep.port, head + b"Content-Length: " + length + b"\r\n\r\n" + b"x" * 1000)
            assert got.startswith(b"HTTP/1.1 " + status), got[:200]
        assert _raw(ep.port, head + b"\r\n{}").startswith(b"HTTP/1.1 411")
        # idle connections: closed after the read timeout, so they never pile up
        idle = [socket.create_connection(("127.0.0.1", ep.port), timeout=10) for _ in range(8)]
        extra = socket.create_connection(("127.0.0.1", ep.port), timeout=10)
        assert extra.recv(200).startswith(b"HTTP/1.1 503")  # the ninth, while eight are open
        extra.close()
        for c in idle:
            assert c.recv(10) == b""  # closed by the server (timeout 1 s; recv waits up to 10 s)
            c.close()
        capfd.readouterr()
        for _ in range(50):  # connections reset by their client in the middle of a request
            c = socket.create_connection(("127.0.0.1", ep.port), timeout=10)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.sendall(head + b"Content-Length: 100\r\n\r\nabc")
            c.close()  # RST
        deadline = time.time() + 20
        while time.time() < deadline and ep.server._dropped < 50:
            time.sleep(0.05)
        out = capfd.readouterr()
        assert ep.server._dropped >= 50 and "Traceback" not in out.out + out.err
        assert len([x for x in (out.out + out.err).splitlines() if x.startswith("[endpoint]")]) <= 4
        ok = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "1+1="}]}).encode()
        stop = threading.Event()
        server = threading.Thread(target=_serving, args=(ep, random_engine, stop), daemon=True)
        server.start()
        try:  # and a good request is still served
            assert httpx.post(f"{s.base_url}/chat/completions", content=ok, timeout=30).status_code == 200
        finally:
            stop.set()
            server.join(5)
    finally:
        ep.close()
