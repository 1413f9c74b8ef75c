"""Agent functions for ``env.type=agent`` tests (tests/unit/envs/test_agent_env.py), named by import path."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import zlib

import httpx

_LOG_LOCK = threading.Lock()  # agents run on many threads at once: one whole line at a time


def _log(record: dict) -> None:
    """Append what the agent saw to $ASYNCRL_TEST_AGENT_LOG (the test compares it with the trained rows)."""
    path = os.environ.get("ASYNCRL_TEST_AGENT_LOG")
    if path:
        with _LOG_LOCK, open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def two_calls(task, client, model):
    """Two chat calls in one conversation: the answer, then a follow-up on it. Reward: the first answer is right."""
    messages = [dict(m) for m in task.prompt]
    first = client.chat.completions.create(model=model, messages=messages)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "again"})
    second = client.chat.completions.create(model=model, messages=messages)
    _log(
        {
            "task": task.id,
            "calls": [
                {
                    "prompt": first.model_extra["prompt_token_ids"],
                    "completion": first.choices[0].model_extra["token_ids"],
                    "text": first.choices[0].message.content,
                },
                {
                    "prompt": second.model_extra["prompt_token_ids"],
                    "completion": second.choices[0].model_extra["token_ids"],
                    "text": second.choices[0].message.content,
                },
            ],
        }
    )
    return {"reward": float((first.choices[0].message.content or "").strip() == str(task.answer)), "calls": 2.0}


async def two_calls_async(task, client, model):
    """``two_calls`` with the async client; the second call starts a new conversation (no shared prefix)."""
    a = await client.chat.completions.create(model=model, messages=[dict(m) for m in task.prompt])
    b = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "1+1="}])
    _log(
        {
            "task": task.id,
            "separate": [
                a.model_extra["prompt_token_ids"] + a.choices[0].model_extra["token_ids"],
                b.model_extra["prompt_token_ids"] + b.choices[0].model_extra["token_ids"],
            ],
        }
    )
    return float((a.choices[0].message.content or "").strip() == str(task.answer))


def text_completion(task, base_url, api_key, model):
    """The plain completions route through httpx (no openai client)."""
    r = httpx.post(
        f"{base_url}/completions",
        json={"model": model, "prompt": "12+34=", "max_tokens": 4},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=60,
    )
    r.raise_for_status()
    return 1.0 if r.json()["choices"][0]["text"] else 0.0


def raises(task, client, model):
    client.chat.completions.create(model=model, messages=[dict(m) for m in task.prompt])
    raise RuntimeError("the agent broke on purpose")


RELEASE_HUNG = threading.Event()  # set by the test once it has seen the rollouts fail


def hangs(task, client, model):
    """Calls, then never returns while the test watches (its thread is the agent pool's, which the
    interpreter joins at exit: released by the test, or after an hour)."""
    client.chat.completions.create(model=model, messages=[dict(m) for m in task.prompt])
    RELEASE_HUNG.wait(3600)


async def hangs_async(task, client, model):
    await asyncio.sleep(3600)


def wrong_model(task, client, model):
    client.chat.completions.create(model="gpt-4o", messages=[dict(m) for m in task.prompt])
    return 1.0


def never_calls(task, client, model):
    return 1.0


def returns_text(task, client, model):
    client.chat.completions.create(model=model, messages=[dict(m) for m in task.prompt])
    return "great"


def two_calls_or_fails(task, client, model):
    """``two_calls``, but the agent fails on about a quarter of the tasks (the run goes on)."""
    if sum(map(ord, task.id)) % 4 == 0:
        raise ValueError("this task's agent fails")
    return two_calls(task, client, model)


async def openenv_add(task, client, model):
    """Plays the OpenEnv environment served at $ASYNCRL_TEST_OPENENV_URL (tests/support/openenv_env.py):
    reset (seeded by the task), ask the policy, step with its answer; the environment's reward."""
    from openenv.core.generic_client import GenericEnvClient

    async with GenericEnvClient(base_url=os.environ["ASYNCRL_TEST_OPENENV_URL"]) as env:
        suffix = task.id.rsplit(":", 1)[-1]
        seed = int(suffix) if suffix.isdigit() else zlib.crc32(task.id.encode())
        obs = (await env.reset(seed=seed)).observation
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": obs["question"]}]
        )
        result = await env.step({"answer": reply.choices[0].message.content or ""})
        return {"reward": float(result.reward or 0.0), "openenv/steps": 1.0}


async def three_separate_calls(task, client, model):
    """Three chat calls that extend nothing (three rows of one rollout). Reward: how many of the three
    completions have an even length, so that rollouts of one task differ."""
    texts = []
    for k in range(3):
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"{k}+{task.id}"}]
        )
        texts.append(reply.choices[0].message.content or "")
    return {"reward": sum(len(t) % 2 == 0 for t in texts) / 3.0, "calls": 3.0}


async def one_call(task, client, model):
    """One chat call (for many sessions at once)."""
    reply = await client.chat.completions.create(model=model, messages=[dict(m) for m in task.prompt])
    return float(bool(reply.choices[0].model_extra["token_ids"]))


def every_reply_calls_add(text):
    """A tool parser for a random model: every completion is a call of ``add`` (its text the argument)."""
    return None, [{"name": "add", "arguments": {"text": text}}]


def _client_record(task, client, reply) -> dict:
    return {
        "task": task.id,
        "http_client": id(client._client),
        "base_url": str(client.base_url),
        "ids": reply.choices[0].model_extra["token_ids"],
    }


def says_its_client(task, client, model):
    """One chat call; logs which HTTP client (connection pool) the rollout was lent."""
    reply = client.chat.completions.create(model=model, messages=[dict(m) for m in task.prompt])
    _log(_client_record(task, client, reply))
    return 1.0


async def says_its_client_async(task, client, model):
    """``says_its_client`` with the async client."""
    reply = await client.chat.completions.create(model=model, messages=[dict(m) for m in task.prompt])
    _log(_client_record(task, client, reply))
    return 1.0


ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def tool_loop(task, client, model):
    """The usual tool loop: call with the tool, run every tool call the reply makes, answer with its
    result, until a reply makes none (three calls at most). Logs each call's ids and the reply's text."""
    messages = [dict(m) for m in task.prompt]
    calls = []
    for _ in range(3):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[ADD_TOOL])
        message = reply.choices[0].message
        calls.append(
            {"prompt": reply.model_extra["prompt_token_ids"], "completion": reply.choices[0].model_extra["token_ids"]}
        )
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(int(args["a"]) + int(args["b"]))})
    _log({"task": task.id, "calls": calls})
    return {"reward": float(str(task.answer) in (messages[-1].get("content") or "")), "calls": float(len(calls))}
