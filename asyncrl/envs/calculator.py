"""A built-in multi-turn environment: arithmetic with a calculator tool the model calls across turns.

The assistant may call the calculator by replying ``calc:EXPR`` (``tool_prefix`` + an expression);
the environment answers with a user turn holding the value (or ``error``), and the conversation goes
on. The first reply that is not a tool call, or any reply once ``max_calls`` calls are spent, is the
final answer, scored by the reward function (``env.reward``). A conversation that ends on a tool call
(``env.max_turns`` reached) scores 0. Only assistant turns are generated, so only they carry
``loss_mask = 1`` (and ``exp_mask = 1`` when replayed); tool results are environment tokens.

    <|user|>12+34=<|end|><|assistant|>calc:12+34<|end|><|user|>46<|end|><|assistant|>46<|end|>

With ``tool_prefix: ""`` every reply before the budget is spent is a calculator call: each episode
then has exactly ``max_calls + 1`` assistant turns (useful to exercise multi-turn training with any
model). Expressions are evaluated by the safe evaluator (``asyncrl.sandbox.arith``), never ``eval``.
"""

from __future__ import annotations

from typing import Any

from ..sandbox.arith import ArithLimits, evaluate_expression
from ..types import Task

DEFAULT_PREFIX = "calc:"


class CalculatorEnv:
    def __init__(
        self,
        reward: str = "arithmetic",
        max_turns: int = 3,
        tool_prefix: str = DEFAULT_PREFIX,
        max_calls: int = 1,
        **_: Any,
    ):
        from .base import get_reward_fn  # base imports this module lazily (ENVS): no cycle

        if not isinstance(tool_prefix, str):
            raise ValueError(f"env.kwargs.tool_prefix must be a string, got {tool_prefix!r}")
        if int(max_calls) < 0:
            raise ValueError(f"env.kwargs.max_calls must be >= 0, got {max_calls!r}")
        self.reward_fn = get_reward_fn(reward)
        self.prefix = tool_prefix
        self.max_calls = int(max_calls)
        self.limits = ArithLimits(max_chars=64, max_operators=4, max_bits=64)

    def reset(self, task: Task) -> list[dict[str, str]]:
        return [dict(m) for m in task.prompt]

    def _calls(self, history: list[dict[str, str]]) -> int:
        """Tool calls made so far: assistant turns that were answered by the environment."""
        return sum(1 for a, b in zip(history, history[1:]) if a["role"] == "assistant" and b["role"] == "user")

    def is_call(self, response: str, calls_so_far: int) -> bool:
        return calls_so_far < self.max_calls and response.startswith(self.prefix)

    def tool_result(self, response: str) -> str:
        res = evaluate_expression(response[len(self.prefix) :].strip(), self.limits)
        return str(res.value) if res.ok else "error"

    def step(self, task: Task, history: list[dict[str, str]], response: str):
        from .base import StepResult

        if self.is_call(response, self._calls(history)):
            return StepResult(messages=[{"role": "user", "content": self.tool_result(response)}], done=False)
        return StepResult(done=True)

    def evaluate(self, task: Task, history: list[dict[str, str]]) -> dict[str, float]:
        from .base import scores_from

        calls = self._calls(history)
        last = next((m["content"] for m in reversed(history) if m["role"] == "assistant"), "")
        ended_on_call = bool(history) and history[-1]["role"] == "assistant" and self.is_call(last, calls)
        scores = {"reward": 0.0} if ended_on_call else scores_from(self.reward_fn(task, last))
        scores["tool_calls"] = float(calls + (1 if ended_on_call else 0))
        return scores


def calculator_warmstart_example(rng) -> tuple[list[dict[str, str]], str]:
    """Warm-start data for the embedded model (format ``calculator``): half the examples teach the
    call (``12+34=`` -> ``calc:12+34``), half the answer after the tool result."""
    from ..config import TasksConfig
    from .arithmetic import make_problem

    task = make_problem(rng, TasksConfig())
    q = task.prompt[0]["content"]
    call = DEFAULT_PREFIX + q.rstrip("=")
    if rng.random() < 0.5:
        return [dict(m) for m in task.prompt], call
    return [*task.prompt, {"role": "assistant", "content": call}, {"role": "user", "content": str(task.answer)}], str(
        task.answer
    )
