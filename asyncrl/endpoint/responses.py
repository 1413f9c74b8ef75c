"""OpenAI's Responses API (``POST /v1/responses``) over the endpoint's chat bookkeeping.

A request's ``input`` (a string, or a list of items: messages, ``function_call`` and
``function_call_output``), its ``instructions`` and, with ``previous_response_id``, the conversation
of an earlier response of the same session become chat messages; the call is then an ordinary chat
call (so its tokens continue the conversation it extends, exactly as on ``/chat/completions``). The
answer's ``output`` is a ``message`` item (``output_text``) and a ``function_call`` item per parsed
tool call: the shape the OpenAI Agents SDK sends and reads. Function tools only.

Beside OpenAI's fields a response carries ``prompt_token_ids`` and ``output_token_ids`` (the ids the
engine sampled); ``include: ["message.output_text.logprobs"]`` adds each token's log-prob to the
output text. Streaming (``stream: true``) sends the typed events (``response.created`` ...
``response.completed``) once the completion is generated.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from .server import fresh_id

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _text_of(content: Any, where: str, error) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if (
                isinstance(p, dict)
                and p.get("type") in ("input_text", "output_text", "text")
                and isinstance(p.get("text"), str)
            ):
                parts.append(p["text"])
            else:
                raise error(
                    400,
                    "invalid_content",
                    f"{where}: only text content parts (input_text, output_text) are supported, got {str(p)[:80]}",
                )
        return "".join(parts)
    raise error(400, "invalid_content", f"{where}: content must be a string or a list of text parts")


def chat_messages(body: dict, previous: list[dict] | None, error) -> list[dict]:
    """Chat messages (OpenAI chat format) of a Responses request: ``instructions`` as the system
    message, then the ``previous`` conversation (without its own system message), then ``input``.
    Consecutive ``function_call`` items join the assistant message before them (or make one)."""
    raw = body.get("input")
    if isinstance(raw, str):
        items: list = [{"role": "user", "content": raw}]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise error(400, "invalid_input", "'input' must be a non-empty string or a non-empty list of items")
    out: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise error(400, "invalid_instructions", "'instructions' must be a string")
    if instructions:
        out.append({"role": "system", "content": instructions})
    if previous:  # its instructions are not carried over (OpenAI's rule): this request's, if any
        out += [dict(m) for m in (previous[1:] if previous[0]["role"] == "system" else previous)]
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise error(400, "invalid_input", f"{where}: an item is an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise error(
                    400, "invalid_input", f"{where}: role must be user, assistant, system or developer, got {role!r}"
                )
            out.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _text_of(item.get("content"), where, error),
                }
            )
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
                raise error(400, "invalid_input", f"{where}: a function_call needs a string name and arguments")
            call = {
                "id": str(item.get("call_id") or item.get("id") or ""),
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"},
            }
            if out and out[-1]["role"] == "assistant":  # the same turn as the assistant's text before it
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(item.get("call_id") or ""),
                    "content": output if isinstance(output, str) else _text_of(output, where, error),
                }
            )
        elif kind == "reasoning":
            continue  # never produced here; a client replaying another model's items
        else:
            raise error(
                400,
                "invalid_input",
                f"{where}: item type {kind!r} is not supported (message, function_call, function_call_output)",
            )
    return out


def chat_tools(tools: Any, error) -> list[dict] | None:
    """Responses function tools (``{type: function, name, description, parameters}``) as chat tools."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise error(400, "invalid_tools", "'tools' must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise error(
                400,
                "invalid_tools",
                f"tools[{i}]: only function tools ({{type: function, name, ...}}) are supported, got {str(t)[:80]}",
            )
        fn = {"name": t["name"]}
        for k in ("description", "parameters"):
            if t.get(k) is not None:
                fn[k] = t[k]
        out.append({"type": "function", "function": fn})
    return out


def response_body(
    call, gen, parse_tools: Callable, model: str, body: dict, logprob_items: Callable | None, response_id: str
) -> tuple[dict, dict]:
    """The Responses API answer to ``call`` (one generation ``gen``), and the assistant message it
    adds to the conversation (for ``previous_response_id``)."""
    content, calls = parse_tools(gen.text, call.tools)
    output: list[dict] = []
    ids = gen.token_ids.tolist()
    if content or not calls:
        part: dict[str, Any] = {"type": "output_text", "text": content or "", "annotations": []}
        if logprob_items is not None:
            part["logprobs"] = logprob_items(ids, gen.logprobs.tolist())
        output.append(
            {"type": "message", "id": fresh_id("msg_"), "role": "assistant", "status": "completed", "content": [part]}
        )
    tool_calls = []
    for c in calls:
        call_id = fresh_id("call_")
        args = json.dumps(c["arguments"])
        output.append(
            {
                "type": "function_call",
                "id": fresh_id("fc_"),
                "call_id": call_id,
                "name": c["name"],
                "arguments": args,
                "status": "completed",
            }
        )
        tool_calls.append({"id": call_id, "type": "function", "function": {"name": c["name"], "arguments": args}})
    incomplete = gen.finish_reason == "length"
    usage = {
        "input_tokens": len(call.prompt_ids),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": len(ids),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(call.prompt_ids) + len(ids),
    }
    resp = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": body.get("previous_response_id"),
        "temperature": None,
        "top_p": None,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "usage": usage,
        "prompt_token_ids": list(call.prompt_ids),
        "output_token_ids": ids,
    }
    resp.update(text={"format": {"type": "text"}}, metadata={})  # (OpenAI's field names, not a Trajectory's)
    reply = {"role": "assistant", "content": content}
    if tool_calls:
        reply["tool_calls"] = tool_calls
    return resp, reply


def stream_events(resp: dict) -> list[tuple[str, dict]]:
    """The typed events of a streamed response, from the finished one: created, in_progress, each
    output item added / its text or arguments (one delta) / done, then completed (or incomplete)."""
    events: list[tuple[str, dict]] = []

    def ev(kind: str, **fields) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **fields}))

    opening = {**resp, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    ev("response.created", response=opening)
    ev("response.in_progress", response=opening)
    for k, item in enumerate(resp["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            ev("response.output_item.added", output_index=k, item={**item, "status": "in_progress", "content": []})
            ev(
                "response.content_part.added",
                item_id=item["id"],
                output_index=k,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": []},
            )
            ev(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=k,
                content_index=0,
                delta=part["text"],
                logprobs=part.get("logprobs", []),
            )
            ev(
                "response.output_text.done",
                item_id=item["id"],
                output_index=k,
                content_index=0,
                text=part["text"],
                logprobs=part.get("logprobs", []),
            )
            ev("response.content_part.done", item_id=item["id"], output_index=k, content_index=0, part=part)
        else:
            ev("response.output_item.added", output_index=k, item={**item, "status": "in_progress", "arguments": ""})
            ev("response.function_call_arguments.delta", item_id=item["id"], output_index=k, delta=item["arguments"])
            ev(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=k,
                name=item["name"],
                arguments=item["arguments"],
            )
        ev("response.output_item.done", output_index=k, item=item)
    ev("response.incomplete" if resp["status"] == "incomplete" else "response.completed", response=resp)
    return events
