"""A tool-using agent trained as it is: a calculator offered through OpenAI tool calls.

The agent is ordinary ``openai`` client code (``env.type=agent``; docs/guide/your-tasks.md, "Bring your own
environment"). It offers a ``calculator`` tool, runs the model's tool call, sends the result back as
a ``tool`` message and takes the model's next reply as the answer. asyncrl trains on the exact
tokens the model sampled in both calls, as one trajectory (the tool result is masked out).

    .venv/bin/asyncrl run -c examples/calc_agent.yaml        (from the repository's root)

The embedded model emits tool calls as ``calc:EXPR`` (the ``calculator`` warm-start format, added to
the quick start's in ``examples/calc_agent.yaml``); :func:`parse_calc` is the endpoint's tool parser
for that form (``env.kwargs.tool_parser``), as ``hermes`` is for Qwen's ``<tool_call>`` JSON. Its
chat template shows a ``tool`` message to the model as a user turn.
"""

from __future__ import annotations

import json

from asyncrl.envs.arithmetic import arithmetic_reward
from asyncrl.sandbox.arith import ArithLimits, evaluate_expression

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+, -, *).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
LIMITS = ArithLimits(max_chars=64, max_operators=4, max_bits=64)


def parse_calc(text: str):
    """``calc:EXPR`` -> a ``calculator`` tool call; anything else is the reply's content."""
    if text.startswith("calc:"):
        return None, [{"name": "calculator", "arguments": {"expression": text[len("calc:") :].strip()}}]
    return text, []


def calculator(expression: str) -> str:
    result = evaluate_expression(str(expression), LIMITS)  # never eval(): the safe evaluator
    return str(result.value) if result.ok else "error"


def solve(task, client, model):
    """One episode: ask, run at most one calculator call, ask again; the reward is the arithmetic one
    on the final answer, with the tool calls as a named score."""
    messages = [dict(m) for m in task.prompt]
    calls = 0
    for _ in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR]).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls or calls:
            break
        for call in reply.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calculator(args.get("expression", ""))}
            )
            calls += 1
    answer = "" if reply.tool_calls else (reply.content or "")
    return {"reward": arithmetic_reward(task, answer), "tool_calls": float(calls)}
