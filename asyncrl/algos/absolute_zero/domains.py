"""Self-play domains: what the proposer is asked, how its output becomes a solver task, and how a
solver response is scored.

A :class:`Domain` is also the solver's :class:`asyncrl.envs.Environment` (reset / step /
evaluate), so the workflow runs the solver through the ordinary multi-turn conversation loop.
Scores always include ``safety`` and ``completion`` (the seeds' two learnability dimensions; each
domain documents what they mean for it); the workflow adds ``format`` and the combined ``reward``.

Domains are chosen by ``algo.domain`` from a registry: ``arithmetic`` (built in, for the tiny
model), ``code_o`` (:mod:`.code_o`, Python output prediction in a sandbox) and ``harm``
(:mod:`.harm`, an LLM judge over an OpenAI-compatible endpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ...envs.base import StepResult
from ...registry import Registry
from ...sandbox.arith import ArithLimits, evaluate_expression, parse_int_reply
from ...types import Task

Message = dict[str, str]
PROPOSE_PREFIX = "propose:"


@dataclass
class Proposal:
    """One proposer output, parsed: ``task`` is the solver task, or None with a ``reason``."""

    text: str
    task: Task | None
    reason: str | None = None
    gold: str = ""  # the reference answer, for the decision record

    @property
    def valid(self) -> bool:
        return self.task is not None


@dataclass
class Scored:
    scores: dict[str, float]
    reason: str | None = None  # why scoring failed, if it did (e.g. the judge timed out)


class Domain:
    """Base class: single-turn solver conversations unless a domain overrides ``step``."""

    name = "domain"

    def __init__(self, max_steps: int = 1):
        self.max_steps = max_steps

    # -- proposer -------------------------------------------------------------------------------
    def proposer_prompt(self, seed: Task) -> list[Message]:
        raise NotImplementedError

    def parse(self, text: str, seed: Task, qid: str) -> Proposal:
        raise NotImplementedError

    def parse_many(self, items: list[tuple[str, Task, str]]) -> list[Proposal]:
        """``parse`` for each (text, seed, question id); domains with slow checks parallelise."""
        return [self.parse(*item) for item in items]

    # -- solver environment ---------------------------------------------------------------------
    def reset(self, task: Task) -> list[Message]:
        return [dict(m) for m in task.prompt]

    def step(self, task: Task, history: list[Message], response: str) -> StepResult:
        return StepResult(done=True)

    def score(self, task: Task, history: list[Message]) -> Scored:
        raise NotImplementedError

    def score_many(self, items: list[tuple[Task, list[Message]]]) -> list[Scored]:
        return [self.score(t, h) for t, h in items]

    def evaluate(self, task: Task, history: list[Message]) -> dict[str, float]:
        scores = dict(self.score(task, history).scores)
        scores.setdefault("reward", scores.get("completion", 0.0))
        return scores


def last_reply(history: list[Message]) -> str:
    return next((m["content"] for m in reversed(history) if m["role"] == "assistant"), "")


def seed_text(seed: Task) -> str:
    """The text of a seed task's last user message."""
    return next((m["content"] for m in reversed(seed.prompt) if m.get("role") == "user"), "")


DomainFactory = Callable[[Any], Domain]  # algo config -> Domain
DOMAINS: Registry[DomainFactory] = Registry("domain")


def register_domain(name: str):
    return DOMAINS.register(name)


def make_domain(algo_cfg) -> Domain:
    if algo_cfg.domain not in DOMAINS:
        raise ValueError(f"algo.domain: unknown domain {algo_cfg.domain!r}; available: {', '.join(sorted(DOMAINS))}")
    return DOMAINS[algo_cfg.domain](algo_cfg)


class ArithmeticDomain(Domain):
    """Integer arithmetic self-play for the embedded model.

    Proposer: ``propose:12+34`` -> an expression such as ``37+45``; the safe evaluator
    (:mod:`asyncrl.sandbox.arith`) checks it and computes the answer; the solver sees ``37+45=``,
    the format the tiny model was warm-started on. The reference design's dimensions (docs/algorithms/absolute_zero.md) map to:

    - ``completion``: 1 if the reply is exactly the right integer (the task is done), else 0;
    - ``safety``: 1 if the reply is a well-formed bare integer, 0 for anything else (text, several
      numbers, an empty reply): the solver stayed inside the allowed answer language, this domain's
      analogue of not taking a harmful action.

    With ``max_steps > 1`` a malformed reply gets one more user turn asking for a number.
    """

    name = "arithmetic"
    RETRY_MESSAGE = "number?"

    def __init__(self, limits: ArithLimits, max_steps: int = 1):
        super().__init__(max_steps)
        self.limits = limits

    def proposer_prompt(self, seed: Task) -> list[Message]:
        return [{"role": "user", "content": PROPOSE_PREFIX + seed_text(seed).rstrip("=")}]

    def parse(self, text: str, seed: Task, qid: str) -> Proposal:
        res = evaluate_expression(text, self.limits)
        if not res.ok:
            return Proposal(text, None, res.reason)
        task = Task(
            id=qid,
            prompt=[{"role": "user", "content": f"{res.expression}="}],
            answer=res.value,
            metadata={"expression": res.expression, "seed_task_id": seed.id},
        )
        return Proposal(text, task, gold=str(res.value))

    def step(self, task: Task, history: list[Message], response: str) -> StepResult:
        if parse_int_reply(response) is None:
            return StepResult(messages=[{"role": "user", "content": self.RETRY_MESSAGE}], done=False)
        return StepResult(done=True)

    def score(self, task: Task, history: list[Message]) -> Scored:
        value = parse_int_reply(last_reply(history))
        well_formed = value is not None
        return Scored({"safety": float(well_formed), "completion": float(well_formed and value == task.answer)})


@register_domain("arithmetic")
def _arithmetic(algo) -> Domain:
    return ArithmeticDomain(algo.arithmetic, algo.max_steps)
