"""Two verifiers (v1) environments for tests/test_bring_envs.py: single-turn addition, and addition
with a calculator tool the model may call (multi-turn)."""

from __future__ import annotations

import verifiers.v1 as vf


class AddData(vf.TaskData):
    answer: str = ""


class AddTask(vf.Task[AddData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 40


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            a, b = i % 10, (i * 7) % 10
            yield AddTask(AddData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


class CalcTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(int(a) + int(b))


class ToolAddTask(AddTask):
    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))

    @classmethod
    def toolsets(cls, config):
        return [CalcTools(vf.ToolsetConfig())]


class ToolAddTaskset(vf.Taskset[ToolAddTask, AddConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            a, b = i % 10, (i * 3) % 10
            yield ToolAddTask(AddData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


def add_call_parser(text: str):
    """A tool parser for a random test model: every reply that is not a number calls ``add`` (with
    the reply's length and 1), so each episode runs tool turns up to env.max_turns."""
    if text.strip().isdigit():
        return text, []
    return None, [{"name": "add", "arguments": {"a": len(text), "b": 1}}]
