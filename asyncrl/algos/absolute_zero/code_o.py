"""Python output prediction (Absolute Zero ``code_o``): the proposer writes a function ``f`` and
an input, a sandboxed subprocess runs ``print(repr(f(input)))`` to get the gold output (twice: it
must be deterministic), and the solver predicts that output.

Proposer output format (AZR's)::

    ```python
    def f(xs):
        return sorted(xs)[::-1]
    ```
    ```input
    [3, 1, 2]
    ```

The input block holds the call's arguments as Python literals (``1, 'a'`` for two arguments).
A proposal whose program prints nothing (``raise SystemExit(0)``, a replaced ``print``) is not a
task: there is no value to predict.

Scores: ``completion`` 1 if the predicted value is exactly the printed one: both are read as Python
literals and compared with their types, recursively (``True`` is not ``1``, ``1.0`` is not ``1``,
``[True, 2.0]`` is not ``[1, 2]``; dict and set order does not matter), or, when the gold output is
not a literal, compared as text; ``safety`` 1 if the prediction is a well-formed Python literal
(the answer stays in the allowed language), 0 otherwise.
"""

from __future__ import annotations

import ast
import re
from concurrent.futures import ThreadPoolExecutor

from ...sandbox.python import SandboxLimits, run_python
from ...types import Task
from .domains import Domain, Message, Proposal, Scored, last_reply, register_domain, seed_text

PROPOSER_TEMPLATE = (
    "Write a new deterministic Python function f and an input for it, different from the example. "
    "Use only the standard modules math, itertools, functools, collections, heapq, bisect, string, re. "
    "Answer with a ```python``` block defining f and an ```input``` block with the call's arguments."
    "\n\nExample:\n{example}"
)
SOLVER_TEMPLATE = (
    "Predict the exact value printed by this program. Reply with the value only, "
    "as a Python literal.\n```python\n{code}\nprint(repr(f({args})))\n```"
)
_BLOCK = re.compile(r"```(python|input)[^\n]*\n(.*?)```", re.DOTALL)
_FENCE = re.compile(r"^```[a-z]*\n?|```$")

SEED_PROGRAMS = (
    ("def f(xs):\n    return sorted(xs)[::-1]", "[3, 1, 2]"),
    ("def f(s):\n    return s.count('a') + len(s)", "'banana'"),
    ("def f(n):\n    total = 0\n    for i in range(n):\n        total += i * i\n    return total", "5"),
    ("def f(a, b):\n    return {k: a.count(k) for k in b}", "'mississippi', 'sip'"),
)


def format_example(code: str, args: str) -> str:
    return f"```python\n{code}\n```\n```input\n{args}\n```"


def seed_tasks() -> list[Task]:
    """Built-in seed prompts (``tasks.type: asyncrl.algos.absolute_zero.code_o:seed_tasks``)."""
    return [
        Task(id=f"code_o_seed:{i}", prompt=[{"role": "user", "content": format_example(c, a)}])
        for i, (c, a) in enumerate(SEED_PROGRAMS)
    ]


def parse_program(text: str) -> tuple[str, str, str | None]:
    """``(code, args, reason)`` from a proposer reply; ``reason`` is None when the shape is right:
    both blocks present, the code defines a top-level ``f``, the input parses as literals."""
    blocks = {kind: body.strip() for kind, body in _BLOCK.findall(text or "")}
    code, args = blocks.get("python", ""), blocks.get("input", "")
    if not code or not args:
        return code, args, "no ```python``` and ```input``` blocks in the proposal"
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return code, args, f"code does not parse: {getattr(e, 'msg', None) or type(e).__name__}"
    if not any(isinstance(n, ast.FunctionDef) and n.name == "f" for n in tree.body):
        return code, args, "the code defines no top-level function f"
    if literal_args(args) is None:
        return code, args, f"the input is not a list of Python literals: {args[:80]!r}"
    return code, args, None


def literal_args(args: str) -> tuple | None:
    try:
        value = ast.literal_eval(f"({args},)")
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
    return value if isinstance(value, tuple) else None


def same_output(prediction: str, gold: str) -> tuple[bool, bool]:
    """``(well_formed, correct)``: the prediction parses as a literal; it is exactly the gold
    output, types included (``typed_literal``)."""
    pred = _FENCE.sub("", prediction.strip()).strip()
    try:
        value = ast.literal_eval(pred)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return False, pred == gold.strip()
    try:
        expected = ast.literal_eval(gold)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return True, pred == gold.strip()
    try:
        return True, typed_literal(value) == typed_literal(expected)
    except RecursionError:
        return True, False


def typed_literal(value):
    """``value`` (a Python literal) as a hashable structure that keeps every type: equal for two
    values only when they have the same types all the way down (``True`` != ``1`` != ``1.0``).
    Lists and tuples keep their order; dicts and sets compare as mappings and sets."""
    kind = type(value).__name__
    if isinstance(value, (list, tuple)):
        return kind, tuple(typed_literal(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return kind, frozenset(typed_literal(v) for v in value)
    if isinstance(value, dict):
        return kind, frozenset((typed_literal(k), typed_literal(v)) for k, v in value.items())
    return kind, value


class CodeOutputDomain(Domain):
    name = "code_o"

    def __init__(self, limits: SandboxLimits, workers: int = 2, max_steps: int = 1):
        super().__init__(max_steps)
        self.limits = limits
        self.workers = workers

    def proposer_prompt(self, seed: Task) -> list[Message]:
        return [{"role": "user", "content": PROPOSER_TEMPLATE.format(example=seed_text(seed))}]

    def parse(self, text: str, seed: Task, qid: str) -> Proposal:
        code, args, reason = parse_program(text)
        if reason:
            return Proposal(text, None, reason)
        args_value = literal_args(args)
        run = run_python(f"{code}\nprint(repr(f(*{args_value!r})))", self.limits)
        if not run.ok:
            return Proposal(text, None, f"sandbox: {run.reason}")
        if not run.output.strip():
            return Proposal(text, None, "the program printed nothing: no output to predict")
        task = Task(
            id=qid,
            prompt=[{"role": "user", "content": SOLVER_TEMPLATE.format(code=code, args=args)}],
            answer=run.output,
            metadata={"code": code, "input": args, "seed_task_id": seed.id},
        )
        return Proposal(text, task, gold=run.output)

    def parse_many(self, items: list[tuple[str, Task, str]]) -> list[Proposal]:
        if self.workers <= 1 or len(items) <= 1:
            return super().parse_many(items)
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            return list(pool.map(lambda it: self.parse(*it), items))

    def score(self, task: Task, history: list[Message]) -> Scored:
        well_formed, correct = same_output(last_reply(history), str(task.answer))
        return Scored({"safety": float(well_formed), "completion": float(correct)})


@register_domain("code_o")
def _code_o(algo) -> Domain:
    return CodeOutputDomain(algo.sandbox, algo.sandbox_workers, algo.max_steps)
