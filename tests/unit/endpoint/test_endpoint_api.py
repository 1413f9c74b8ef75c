"""The rollout endpoint on its ASGI server (asyncrl.endpoint: .core, .server, .responses):
streaming and the Responses API with exact token ids and log-probs, sessions kept apart, a thousand
sessions at once, limits under load, and a rollout of several rows counted once in its group. Real
uvicorn on loopback, the real ``openai`` client, the real HF engine."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from asyncrl.config import AdvantageConfig, SamplingConfig, load_config
from asyncrl.endpoint.core import Endpoint
from asyncrl.envs.base import make_env
from asyncrl.learner.training.batch_stats import batch_metrics
from asyncrl.objectives.advantages import trajectory_advantages
from asyncrl.rollout.workflow import RolloutContext, get_workflow
from asyncrl.types import Episode, Task, Trajectory
from tests.support.agents import every_reply_calls_add

openai = pytest.importorskip("openai", reason="the envs extra (pip install -e '.[envs]') is not installed")


def _client(session) -> openai.OpenAI:
    return openai.OpenAI(base_url=session.base_url, api_key=session.token, max_retries=0, timeout=60)


def _tail(seg, n):
    return seg.ids[-n:], seg.logprobs[-n:], seg.mask[-n:]


def test_chat_and_completions_stream_exact_tokens(serving):
    ep = serving()
    s = ep.open(budget=None)
    client = _client(s)
    chunks = list(
        client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "12+34="}],
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]
    lps = [
        x.logprob
        for c in chunks
        for ch in c.choices
        if ch.logprobs and ch.logprobs.content
        for x in ch.logprobs.content
    ]
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert ids and len(lps) == len(ids) and len(finish) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)  # usage at the end
    (seg,) = s.segments
    got_ids, got_lps, mask = _tail(seg, len(ids))
    assert got_ids == ids and mask == [1] * len(ids)
    assert np.array_equal(np.float32(got_lps), np.float32(lps))  # the engine's behaviour log-probs, exactly
    prompt = chunks[0].model_extra["prompt_token_ids"]
    assert seg.ids == prompt + ids and seg.texts == [text]

    # the same through a plain (non-streamed) call gives the same shape of answer
    plain = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "1+1="}], logprobs=True
    )
    ids2 = plain.choices[0].model_extra["token_ids"]
    assert [x.logprob for x in plain.choices[0].logprobs.content] == pytest.approx(
        s.segments[1].logprobs[-len(ids2) :], abs=0
    )

    # completions, streamed
    t = s.segments
    chunks = list(client.completions.create(model="policy", prompt="7+8=", stream=True, logprobs=1))
    ids = [i for c in chunks for ch in c.choices for i in (ch.model_extra.get("token_ids") or [])]
    lps = [lp for c in chunks for ch in c.choices if ch.logprobs for lp in ch.logprobs.token_logprobs]
    assert ids and len(t) == 3 and t[2].ids[-len(ids) :] == ids
    assert np.array_equal(np.float32(t[2].logprobs[-len(ids) :]), np.float32(lps))
    assert "".join(ch.text for c in chunks for ch in c.choices) == t[2].texts[-1]


def test_responses_api_round_trips_continue_one_trajectory(serving):
    """Responses calls, plain and streamed, with previous_response_id and with the whole history sent
    back (function calls and their outputs, as the Agents SDK does): one trajectory of exact ids."""
    ep = serving(parser=every_reply_calls_add)
    s = ep.open(budget=None)
    client = _client(s)
    tools = [
        {
            "type": "function",
            "name": "add",
            "description": "adds",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        }
    ]
    first = client.responses.create(
        model="policy", input="12+34=", instructions="be brief", tools=tools, include=["message.output_text.logprobs"]
    )
    assert first.status in ("completed", "incomplete") and first.output[-1].type == "function_call"
    call = first.output[-1]
    assert call.name == "add" and json.loads(call.arguments)["text"] is not None
    out1 = first.model_extra["output_token_ids"]
    (seg,) = s.segments
    assert seg.ids == first.model_extra["prompt_token_ids"] + out1
    # the history sent back, as the Agents SDK does: the function call item and its output
    history = [
        {"role": "user", "content": "12+34="},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "46"},
    ]
    second = client.responses.create(model="policy", input=history, instructions="be brief", tools=tools)
    assert len(s.segments) == 1, "the second call did not continue the first one's tokens"
    p1, prompt2 = first.model_extra["prompt_token_ids"], second.model_extra["prompt_token_ids"]
    assert prompt2[: len(p1) + len(out1)] == p1 + out1 and s.segments[0].ids[: len(prompt2)] == prompt2
    # previous_response_id instead of the history, streamed
    events = list(
        client.responses.create(
            model="policy",
            previous_response_id=second.id,
            instructions="be brief",
            tools=tools,
            input=[{"type": "function_call_output", "call_id": second.output[-1].call_id, "output": "1"}],
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert len(s.segments) == 1 and s.segments[0].calls == 3
    ids3 = done.model_extra["output_token_ids"]
    assert s.segments[0].ids == done.model_extra["prompt_token_ids"] + ids3
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == done.output[-1].arguments
    # the generated tokens are the only ones trained on
    mask = s.segments[0].mask
    assert sum(mask) == len(out1) + len(second.model_extra["output_token_ids"]) + len(ids3)


def test_responses_text_and_logprobs(serving):
    ep = serving(parser=None)
    s = ep.open(budget=None)
    r = _client(s).responses.create(
        model="policy",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "3+4="}]}],
        include=["message.output_text.logprobs"],
        max_output_tokens=4,
    )
    ids = r.model_extra["output_token_ids"]
    part = r.output[0].content[0]
    assert r.output[0].type == "message" and part.text == r.output_text == s.segments[0].texts[0]
    assert len(ids) <= 4 and [x.logprob for x in part.logprobs] == s.segments[0].logprobs[-len(ids) :]
    assert r.usage.output_tokens == len(ids) and r.usage.input_tokens == len(r.model_extra["prompt_token_ids"])
    if len(ids) == 4 and ids[-1] not in ep.eos_ids:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_bad_responses_requests_are_openai_errors(serving):
    ep = serving()
    s = ep.open(budget=None)
    url = f"{s.base_url}/responses"
    cases = [
        ({"model": "policy", "input": []}, 400, "invalid_input"),
        ({"model": "policy", "input": [{"type": "image", "url": "x"}]}, 400, "invalid_input"),
        ({"model": "policy", "input": "hi", "tools": [{"type": "web_search"}]}, 400, "invalid_tools"),
        ({"model": "policy", "input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_not_found"),
        ({"model": "other", "input": "hi"}, 404, "model_not_found"),
    ]
    for body, status, code in cases:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == status and r.json()["error"]["code"] == code, (body, r.text)
    assert httpx.put(url, json={}, timeout=30).status_code == 405
    assert not s.segments


def test_a_session_cannot_reach_another(serving):
    """A rollout holding its URL cannot read or write another's: not its responses, not its tokens."""
    ep = serving()
    a, b = ep.open(budget=None), ep.open(budget=None)
    rb = _client(b).responses.create(model="policy", input="5+5=")
    b_ids = list(b.segments[0].ids)
    client_a = _client(a)
    with pytest.raises(openai.NotFoundError, match="previous_response_not_found"):
        client_a.responses.create(model="policy", input="more", previous_response_id=rb.id)
    # A sends B's whole conversation: a new trajectory of A's, B's untouched
    client_a.responses.create(
        model="policy",
        input=[
            {"role": "user", "content": "5+5="},
            {"role": "assistant", "content": rb.output_text},
            {"role": "user", "content": "again"},
        ],
    )
    assert b.segments[0].ids == b_ids and len(b.segments) == 1 and len(a.segments) == 1
    # the session's secret is the path: another token (or B's as the API key on A's URL) reaches A only
    r = httpx.post(
        f"{a.base_url}/chat/completions",
        headers={"Authorization": f"Bearer {b.token}"},
        timeout=30,
        json={"model": "policy", "messages": [{"role": "user", "content": "1+1="}]},
    )
    assert r.status_code == 200 and len(a.segments) == 2 and len(b.segments) == 1
    forged = a.base_url.replace(a.token, a.token[:-2] + ("AA" if not a.token.endswith("AA") else "BB"))
    assert (
        httpx.post(
            f"{forged}/chat/completions",
            json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
            timeout=30,
        ).json()["error"]["code"]
        == "episode_ended"
    )
    b.close()
    with pytest.raises(openai.BadRequestError, match="episode_ended"):
        _client(b).responses.create(model="policy", input="5+5=")


def test_a_thousand_sessions_on_one_actor(random_engine, tok):
    """1,000 rollouts (250 tasks x 4) each with a session and a connection at once: all answered."""
    cfg = load_config(
        None,
        [
            "env.type=agent",
            "env.agent=tests.support.agents:one_call",
            "sampling.n=4",
            "sampling.max_new_tokens=2",
            "env.call_timeout_s=600",
        ],
    )
    env = make_env(cfg.env)
    tasks = [Task(id=f"t{i}", prompt=[{"role": "user", "content": f"{i % 90}+1="}], answer="") for i in range(250)]
    episodes = get_workflow("grpo", cfg).rollout(tasks, RolloutContext(random_engine, tok, env, cfg, "a0", 1))
    failures = [f for ep in episodes for f in ep.decision.get("failures", [])]
    assert failures == [] and env.failures == 0
    rows = [t for ep in episodes for t in ep.trajectories]
    assert len(rows) == 1000 and all(t.reward == 1.0 and t.num_generated >= 1 for t in rows)
    assert env._endpoint.sessions == {}  # every session closed once its rollout ended


def test_slow_clients_do_not_stall_the_others(serving):
    """Connections that dribble a header or never read their answer hold nothing but themselves."""
    ep = serving(max_new_tokens=4)
    s = ep.open(budget=None)
    path = s.base_url.split(str(ep.port), 1)[1]
    slow = []
    for _ in range(20):  # slow-loris: half a request line
        c = socket.create_connection(("127.0.0.1", ep.port), timeout=10)
        c.sendall(f"POST {path}/chat/com".encode())
        slow.append(c)
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "1+1="}], "stream": True}).encode()
    for _ in range(20):  # whole requests whose answers are never read
        c = socket.create_connection(("127.0.0.1", ep.port), timeout=10)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        c.sendall(
            f"POST {path}/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        slow.append(c)
    try:
        client = _client(s)
        t0 = time.monotonic()
        for _ in range(5):
            assert client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "2+2="}]
            ).choices
        assert time.monotonic() - t0 < 60
    finally:
        for c in slow:
            c.close()


# ---- one rollout, one sample ------------------------------------------------------------------


def _row(reward: float, group: str, rollout: str = "") -> Trajectory:
    return Trajectory(
        token_ids=np.array([1, 2, 3]),
        loss_mask=np.array([0, 1, 1]),
        behavior_logprobs=np.zeros(3),
        policy_version=0,
        reward=reward,
        group_id=group,
        rollout_id=rollout,
    )


@pytest.mark.parametrize(
    "estimator, expected",
    [
        # rollouts' rewards [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3)
        ("grpo", {"r1": (2 / 3) / (np.sqrt(1 / 3) + 1e-6), "r2": (-1 / 3) / (np.sqrt(1 / 3) + 1e-6)}),
        ("rloo", {"r1": 1.0, "r2": -0.5}),  # R_i minus the mean of the others
    ],
)
def test_group_baseline_counts_a_rollout_once(estimator, expected):
    """A rollout of three unmerged calls (three rows) and two rollouts of one row, by hand: the rows
    as samples would give rewards [1, 1, 1, 0, 0] (GRPO: 0.73 and -1.10)."""
    rows = [
        _row(1.0, "g", "r1"),
        _row(1.0, "g", "r1"),
        _row(1.0, "g", "r1"),
        _row(0.0, "g", "r2"),
        _row(0.0, "g", "r3"),
        _row(0.5, "h"),
        _row(0.5, "h"),
    ]  # another group, rows without a rollout id: each its own sample
    adv = trajectory_advantages(rows, AdvantageConfig(estimator=estimator)).double().numpy()
    assert adv[:3] == pytest.approx([expected["r1"]] * 3, rel=1e-6)
    assert adv[3:5] == pytest.approx([expected["r2"]] * 2, rel=1e-6)
    assert adv[5:] == pytest.approx([0.0, 0.0])
    # the same rollout id in another group is another rollout
    other = trajectory_advantages([_row(1.0, "x", "r1"), _row(0.0, "y", "r1")], AdvantageConfig(estimator=estimator))
    assert other.tolist() == [0.0, 0.0]


def test_agent_rollouts_of_three_rows_are_one_sample_each(random_engine, tok):
    """Through the agent environment: each rollout's three calls become three rows with one rollout
    id; their advantage is the one computed over rollouts (by hand from the rollouts' rewards)."""
    cfg = load_config(
        None,
        [
            "env.type=agent",
            "env.agent=tests.support.agents:three_separate_calls",
            "sampling.n=4",
            "sampling.temperature=3.0",
            "sampling.max_new_tokens=5",
            "env.max_turns=3",
        ],
    )
    tasks = [Task(id=f"t{i}", prompt=[{"role": "user", "content": "x"}], answer="") for i in range(3)]
    episodes = get_workflow("grpo", cfg).rollout(
        tasks, RolloutContext(random_engine, tok, make_env(cfg.env), cfg, "a0", 1)
    )
    rows = [t for ep in episodes for t in ep.trajectories]
    assert len(rows) == 36
    by_rollout: dict[str, list[int]] = {}
    for i, t in enumerate(rows):
        by_rollout.setdefault(t.rollout_id, []).append(i)
    assert len(by_rollout) == 12 and all(len(ix) == 3 for ix in by_rollout.values()) and "" not in by_rollout
    adv = trajectory_advantages(rows, cfg.train.advantage).double()
    expected = torch.zeros(len(rows), dtype=torch.float64)
    for ep in episodes:
        rollouts = {t.rollout_id: t.reward for t in ep.trajectories}
        r = torch.tensor(list(rollouts.values()), dtype=torch.float64)
        a = torch.zeros_like(r) if bool((r == r[0]).all()) else (r - r.mean()) / (r.std() + 1e-6)
        for rid, value in zip(rollouts, a):
            for i in by_rollout[rid]:
                expected[i] = value
    assert torch.allclose(adv, expected, atol=1e-6)
    assert any(v != 0 for v in expected.tolist()), "every group had equal rewards: the check proved nothing"
    stats = batch_metrics([Episode(trajectories=rows, actor_id="a")])
    assert stats["groups/count"] == 3.0  # three groups of four rollouts


def test_agent_batches_share_the_continuous_engine(tok):
    """actor.weight_update=inflight: two batches of agents, each on its own rollout thread, on one
    endpoint and one continuous engine whose steps this thread runs: their calls share decode steps
    and every rollout is answered."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.engine.hf import HFEngine

    torch.manual_seed(0)
    engine = HFEngine(
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(tok),
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=256,
                tie_word_embeddings=True,
                pad_token_id=0,
                bos_token_id=2,
                eos_token_id=3,
            )
        ),
        tok,
    )
    engine.start_continuous()
    cfg = load_config(
        None,
        [
            "env.type=agent",
            "env.agent=tests.support.agents:three_separate_calls",
            "sampling.n=2",
            "sampling.temperature=3.0",
            "sampling.max_new_tokens=6",
            "env.max_turns=3",
        ],
    )
    env = make_env(cfg.env)
    results: dict[int, list] = {}

    def batch(k):
        tasks = [Task(id=f"b{k}t{i}", prompt=[{"role": "user", "content": "x"}], answer="") for i in range(3)]
        results[k] = get_workflow("grpo", cfg).rollout(tasks, RolloutContext(engine, tok, env, cfg, "a0", k))

    threads = [threading.Thread(target=batch, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while engine.batcher.num_pending() < 12 and time.monotonic() < deadline:  # both batches' first calls queued
        time.sleep(0.01)
    widest = 0
    try:
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            if engine.step():
                widest = max(widest, len(engine._live))
            else:
                engine.batcher.wait_for_work(0.005)
    finally:
        engine.stop_continuous("test over")
    for t in threads:
        t.join(10)
    assert sorted(results) == [0, 1] and widest == 12  # both batches' six rollouts in one decode step
    for eps in results.values():
        assert [f for ep in eps for f in ep.decision.get("failures", [])] == []
        assert sum(len(ep.trajectories) for ep in eps) == 18  # 3 tasks x 2 rollouts x 3 calls


@pytest.mark.parametrize("agent", ["says_its_client", "says_its_client_async"])
def test_each_running_rollout_is_lent_a_client_of_its_own(random_engine, tok, tmp_path, monkeypatch, agent):
    """One ``openai`` client shared by every rollout made each call cost 7.6 ms (threads) or 23 ms
    (async) at 64 rollouts, its connection pool matching every request against every connection; now
    each running rollout has a client (and connection pool) of its own, lent again to later rollouts."""
    log = tmp_path / "agent.jsonl"
    monkeypatch.setenv("ASYNCRL_TEST_AGENT_LOG", str(log))
    cfg = load_config(
        None,
        ["env.type=agent", f"env.agent=tests.support.agents:{agent}", "sampling.n=4", "sampling.max_new_tokens=4"],
    )
    env, wf = make_env(cfg.env), get_workflow("grpo", cfg)
    tasks = [Task(id=f"t{i}", prompt=[{"role": "user", "content": f"{i}+1="}], answer=str(i + 1)) for i in range(3)]
    rounds = []
    for k in range(2):
        episodes = wf.rollout(tasks, RolloutContext(random_engine, tok, env, cfg, "a0", k + 1))
        assert all(not ep.decision for ep in episodes)
        rounds.append([json.loads(line) for line in log.read_text().splitlines()])
        log.unlink()
    first, second = rounds
    assert len(first) == len(second) == 12
    assert len({r["base_url"] for r in first}) == 12  # each rollout its own session ...
    clients = {r["http_client"] for r in first}
    assert len(clients) == 12  # ... and its own HTTP client: 12 rollouts ran at once
    assert {r["http_client"] for r in second} == clients  # the second batch was lent the same ones


def test_a_batch_waits_for_agents_yet_to_call(random_engine, tok, monkeypatch):
    """With a fixed 20 ms linger, a batch went with the first calls when the others' arrival paused
    (their clients share the process), and the rest waited a whole generation more. The linger now
    grows with the share of agents yet to call and with what a batch costs the engine."""
    import asyncrl.endpoint.core as endpoint_mod

    ep = Endpoint(tok, "policy", SamplingConfig(max_new_tokens=2), random_engine.eos_ids, None, request_timeout_s=60)
    try:
        assert ep.linger(1, 4) == endpoint_mod.LINGER_S  # no batch generated yet: the base linger
        ep.generate_s = 0.8  # a batch costs 0.8 s: wait up to 0.2 s, by the share still to call
        assert ep.linger(1, 4) == pytest.approx(0.15) and ep.linger(3, 4) == pytest.approx(0.05)
        assert ep.linger(4, 4) == ep.linger(63, 64) == endpoint_mod.LINGER_S
        body = {"model": "policy", "messages": [{"role": "user", "content": "1+1="}]}
        s = ep.open(None)
        ep.submit(s, body, "chat")
        t0 = time.monotonic()
        assert len(ep.wait_batch(4, timeout=30)) == 1  # the lone call goes after its linger, not before
        assert time.monotonic() - t0 >= 0.14
        # a second call that comes long after the first (here: once the batch is known to be waiting)
        monkeypatch.setattr(endpoint_mod, "LINGER_MAX_S", 30.0)
        ep.generate_s = 40.0  # linger(1, 4) = 22.5 s, linger(2, 4) = 15 s
        ep.submit(s, body, "chat")
        got = []
        waiter = threading.Thread(target=lambda: got.append(ep.wait_batch(3, timeout=60)))
        waiter.start()
        deadline = time.monotonic() + 30
        while not ep._waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        ep.submit(s, body, "chat")
        ep.submit(s, body, "chat")  # the third of three: the batch goes at once
        waiter.join(60)
        assert [len(b) for b in got] == [3]
    finally:
        ep.close()


def test_a_call_not_answered_in_time_gets_408(random_engine, tok, monkeypatch):
    """Every call's deadline is kept on one timer of the server's loop (a timer per call cost the
    server more than the rest of a call): calls nobody generates are answered 408 after their own
    timeout, later calls are still served, and a kept-alive connection left idle is closed."""
    import asyncrl.endpoint.core as endpoint_mod

    monkeypatch.setattr(endpoint_mod, "READ_TIMEOUT_S", 1.0)
    ep = Endpoint(tok, "policy", SamplingConfig(max_new_tokens=2), random_engine.eos_ids, None, request_timeout_s=1.0)
    stop = threading.Event()
    try:
        s = ep.open(None)
        url = f"{s.base_url}/chat/completions"
        body = {"model": "policy", "messages": [{"role": "user", "content": "1+1="}]}
        answers = []

        def call():
            t0 = time.monotonic()
            r = httpx.post(url, json=body, timeout=30)
            answers.append((r.status_code, r.json()["error"]["code"], time.monotonic() - t0))

        first = [threading.Thread(target=call) for _ in range(3)]
        for t in first:
            t.start()
        deadline = time.monotonic() + 30
        while len(ep.pending) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        late = threading.Thread(target=call)  # queued after the first three: a later deadline
        late.start()
        for t in [*first, late]:
            t.join(60)
        assert [a[:2] for a in answers] == [(408, "timeout")] * 4
        assert all(a[2] >= 0.95 for a in answers)  # none before its own timeout
        ep.pending.clear()  # (nobody generates them: the rollout would drop them)

        def serve():
            while not stop.is_set():
                calls = ep.wait_batch(1, timeout=0.05)
                if calls:
                    ep.serve(random_engine, calls, seed=0)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        c = socket.create_connection(("127.0.0.1", ep.port), timeout=30)
        data = json.dumps(body).encode()
        path = url.split(str(ep.port), 1)[1]
        c.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        got = b""
        while b"\r\n\r\n" not in got:
            got += c.recv(65536)
        assert got.startswith(b"HTTP/1.1 200")
        while chunk := c.recv(65536):  # the answer, then the server closes the idle kept-alive connection
            got += chunk
        assert b'"token_ids"' in got
        c.close()
        assert not ep.app.deadlines.queue or all(f.done() for _, f in ep.app.deadlines.queue)
    finally:
        stop.set()
        ep.close()
