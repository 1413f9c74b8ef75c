"""Two verifiers (v1) environments for tests/unit/envs/test_bring_envs.py: single-turn addition, and addition
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


class ProbeTools(vf.Toolset[vf.ToolsetConfig]):
    """Tools a hostile model would call: what the tool process can see and reach (tests of the sandbox)."""

    @vf.tool
    def whoami(self) -> str:
        """The tool process's uid and pid."""
        import os

        return f"{os.getuid()} {os.getpid()}"

    @vf.tool
    def read(self, path: str) -> str:
        """A file's text."""
        with open(path) as f:
            return f.read()

    @vf.tool
    def dial(self, port: int) -> str:
        """Open a TCP connection to 127.0.0.1:port and send a few bytes."""
        import socket

        with socket.create_connection(("127.0.0.1", int(port)), timeout=2) as s:
            s.sendall(b"pwned")
        return "sent"

    @vf.tool
    def nap(self, seconds: float) -> str:
        """Sleep."""
        import time

        time.sleep(float(seconds))
        return "awake"


class ProbeTask(AddTask):
    @classmethod
    def toolsets(cls, config):
        return [ProbeTools(vf.ToolsetConfig())]


class ProbeTaskset(vf.Taskset[ProbeTask, AddConfig]):
    def load(self):
        for i in range(4):
            yield ProbeTask(AddData(prompt=f"{i}+1=", answer=str(i + 1)), self.config.task)


class DockerTask(AddTask):
    @classmethod
    def toolsets(cls, config):
        from verifiers.v1.runtimes import DockerConfig

        return [CalcTools(vf.ToolsetConfig(runtime=DockerConfig(image="python:3.11")))]


class DockerTaskset(vf.Taskset[DockerTask, AddConfig]):
    def load(self):
        yield DockerTask(AddData(prompt="1+1=", answer="2"), self.config.task)


class ServerTask(AddTask):
    @classmethod
    def toolsets(cls, config):
        return [CalcTools(vf.ToolsetConfig(url="http://127.0.0.1:9/mcp"))]


class ServerTaskset(vf.Taskset[ServerTask, AddConfig]):
    def load(self):
        yield ServerTask(AddData(prompt="1+1=", answer="2"), self.config.task)
