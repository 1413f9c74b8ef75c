"""A verifiers (v1) taskset for ``asyncrl run -c examples/verifiers.yaml``: the quick start's two-digit
additions (``47+69=``), scored by a verifiers rubric instead of asyncrl's arithmetic reward.

- ``SumTaskset``: one reply per task; the reward is 1 for the exact sum, the metric ``digits`` the
  fraction of the sum's digits in place (logged as ``score/vf/digits``).
- ``CalcSumTaskset``: the same tasks with a calculator toolset (``calc_add``) the model may call; every
  call runs in asyncrl's bubblewrap tool sandbox, never in the actor.

Either is named by import path: ``env.kwargs.taskset=examples.verifiers_add:SumTaskset``.
"""

from __future__ import annotations

import random

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def digits(self, trace: vf.Trace) -> float:
        reply, want = trace.last_reply.strip(), self.data.answer
        return sum(a == b for a, b in zip(reply, want)) / len(want)


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 3000
    seed: int = 0


def _sums(config: SumConfig):
    rng = random.Random(config.seed)
    for _ in range(config.num_tasks):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        yield SumData(prompt=f"{a}+{b}=", answer=str(a + b))


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for data in _sums(self.config):
            yield SumTask(data, self.config.task)


class Calculator(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """The sum of two integers."""
        return str(int(a) + int(b))


class CalcSumTask(SumTask):
    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))

    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]


class CalcSumTaskset(vf.Taskset[CalcSumTask, SumConfig]):
    def load(self):
        for data in _sums(self.config):
            yield CalcSumTask(data, self.config.task)
