"""``env.type=verifiers``: a ``verifiers`` (v1, ``import verifiers.v1 as vf``) environment, as it is.

``env.kwargs``: ``taskset`` (an import path ``pkg.module:TasksetClass``, or the id of an installed
verifiers environment package, as ``vf-eval`` takes it), ``config`` (its ``TasksetConfig`` fields),
``size`` (most tasks read from an endless taskset; default 10,000), plus the agent endpoint's
``model``/``request_timeout_s``/``tool_parser`` (:mod:`asyncrl.envs.agent`).

- **Tasks** (``tasks.type=verifiers``, set with this environment): the taskset's tasks, the prompt
  being ``system_prompt`` + ``prompt`` as chat messages. Held out as any finite source
  (``tasks.holdout_fraction``, ``tasks.holdout_seed``).
- **Rollouts** run through the actor's OpenAI-compatible endpoint, with asyncrl's exact token
  bookkeeping: a chat loop with the ``openai`` client that offers the tools of the task's toolsets
  (``Task.toolsets``, methods marked ``@vf.tool``) and runs every tool call the model makes in the
  bubblewrap sandbox (:mod:`asyncrl.sandbox.tools`: never in the actor's process), until a
  reply without tool calls or ``env.max_turns`` model calls. Multi-turn tool use is one trajectory
  (each call extends the last). A toolset that asks for another runtime than verifiers'
  ``subprocess`` (docker, e2b, modal, ...) or an external server is refused at start, in one line;
  so is a taskset with tools where bubblewrap does not work.
- **Reward**: the task's rubric. A ``vf.Trace`` of the conversation is scored by ``Task.score``
  (its ``@vf.reward`` functions, weighted, and ``@vf.metric`` ones); the reward is ``trace.reward``
  and every reward and metric is kept as a named score ``vf/<name>``.

What is not run: verifiers' harness programs (``bash``, ``null``, coding agents) and its
interception server. They run in a ``uv`` script environment that verifiers bootstraps by
downloading ``uv``; asyncrl drives the model calls itself instead. Rewards that need a runtime (a
sandbox box) are skipped by ``Task.score`` without one, which verifiers logs.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
from typing import Any

from ..config import ConfigError
from ..plugins import resolve_import
from ..sandbox.tools import ToolSandbox, check_toolsets
from ..types import Task
from .agent import DEFAULT_MODEL_NAME, AgentEnv

DEFAULT_SIZE = 10_000


def require_verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError(
            "env.type=verifiers needs the verifiers package (v1 API, verifiers>=0.4): pip install 'asyncrl[envs]'"
        ) from None
    return vf


def load_taskset(spec: str, config: dict | None):
    """The verifiers Taskset named by ``spec`` (import path or installed id) with ``config``."""
    vf = require_verifiers()
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import taskset_class

    if not spec:
        raise ConfigError(
            "env.type=verifiers (or tasks.type=verifiers) needs its taskset: env.kwargs.taskset="
            "'pkg.module:TasksetClass' or an installed verifiers environment id (tasks.kwargs.taskset "
            "is the same key; e.g. examples/verifiers.yaml)"
        )
    if ":" in spec:
        cls = resolve_import(spec, "env.kwargs.taskset")
    else:
        try:
            cls = taskset_class(spec)
        except Exception as e:  # noqa: BLE001 - verifiers raises several kinds for an unknown id
            raise ConfigError(
                f"env.kwargs.taskset: verifiers could not load the environment {spec!r}: {type(e).__name__}: {e}"
            ) from None
    if not (isinstance(cls, type) and issubclass(cls, vf.Taskset)):
        raise ConfigError(f"env.kwargs.taskset {spec!r} is not a verifiers Taskset class (vf.Taskset)")
    config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    try:
        cfg = config_cls(**(config or {}))
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError: say which fields
        raise ConfigError(
            f"env.kwargs.config for {spec}: {config_cls.__name__} refused it: {e}".splitlines()[0]
        ) from None
    return cls(cfg)


def _messages(vtask) -> list[dict[str, str]]:
    data = vtask.data
    out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    prompt = data.prompt
    if prompt is None:
        raise ConfigError(f"verifiers task {data.idx}: no prompt (a task that the user opens is not supported)")
    if isinstance(prompt, str):
        return out + [{"role": "user", "content": prompt}]
    for m in prompt:
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        content = d.get("content")
        if not isinstance(content, str):
            raise ConfigError(f"verifiers task {data.idx}: only text messages are supported, got {str(content)[:80]}")
        out.append({"role": d["role"], "content": content})
    return out


def verifiers_source(tasks_cfg) -> list[Task]:
    """``tasks.type=verifiers``: the tasks of the taskset ``tasks.kwargs`` names."""
    return verifiers_tasks(tasks_cfg.kwargs)


def verifiers_tasks(kwargs: dict) -> list[Task]:
    """asyncrl Tasks from the taskset ``kwargs`` names (``taskset``, ``config``, ``size``)."""
    taskset = load_taskset(kwargs.get("taskset", ""), kwargs.get("config"))
    size = int(kwargs.get("size", DEFAULT_SIZE))
    out = []
    for vtask in taskset.take(size) if not taskset.bounded else taskset:
        idx = vtask.data.idx
        out.append(
            Task(
                id=f"vf:{vtask.data.id or idx}",
                prompt=_messages(vtask),
                answer=None,
                metadata={"vf_idx": idx, "vf_key": vtask.key},
            )
        )
        if len(out) >= size:
            break
    if not out:
        raise ConfigError(f"env.kwargs.taskset {kwargs.get('taskset')}: the taskset has no tasks")
    return out


def _tool_spec(name: str, fn) -> dict:
    types = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
    props, required = {}, []
    for pname, p in inspect.signature(fn).parameters.items():
        props[pname] = {"type": types.get(p.annotation, "string")}
        if p.default is inspect.Parameter.empty:
            required.append(pname)
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": inspect.getdoc(fn) or "",
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


class VerifiersEnv(AgentEnv):
    """``env.type=verifiers`` (module doc)."""

    def __init__(
        self,
        reward: str = "",
        max_turns: int = 1,
        taskset: str = "",
        config: dict | None = None,
        size: int = DEFAULT_SIZE,
        model: str = DEFAULT_MODEL_NAME,
        request_timeout_s: float = 120.0,
        tool_parser: str = "hermes",
        **_: Any,
    ):
        require_verifiers()
        self.taskset = load_taskset(taskset, config)
        self.size = int(size)
        self._tasks: dict[int, Any] | None = None
        self._sandboxes: dict[tuple, ToolSandbox] = {}  # (task class, its config) -> the worker of its tools
        self._check_tools(taskset)
        self._set_agent(self._episode, f"verifiers {taskset}")
        self._setup(model, request_timeout_s, tool_parser, max_turns)

    def vtask(self, task: Task):
        if self._tasks is None:
            source = self.taskset if self.taskset.bounded else self.taskset.take(self.size)
            self._tasks = {t.data.idx: t for t in source}
        idx = (task.metadata or {}).get("vf_idx")
        if idx not in self._tasks:
            raise ValueError(
                f"task {task.id} is not a task of this taskset (no vf_idx {idx!r}); env.type=verifiers "
                f"needs tasks.type=verifiers"
            )
        return self._tasks[idx]

    def _check_tools(self, spec: str) -> None:
        """Refuse at start, in one line, a toolset that cannot run in the sandbox (its runtime, an
        external server, or no bubblewrap here): the first task's toolsets stand for the taskset's."""
        first = next(iter(self.taskset if self.taskset.bounded else self.taskset.take(1)), None)
        if first is None:
            return
        toolsets = type(first).toolsets(first.config)
        check_toolsets(toolsets, f"env.kwargs.taskset {spec}")
        if toolsets:
            self._sandbox(first)  # (no bubblewrap here: ConfigError now, not at the first tool call)

    def _sandbox(self, vtask) -> ToolSandbox:
        key = (type(vtask), vtask.config.model_dump_json())
        box = self._sandboxes.get(key)
        if box is None:
            box = self._sandboxes[key] = ToolSandbox(type(vtask), vtask.config)
            atexit.register(box.close)
        return box

    def tools(self, vtask) -> tuple[list[dict], Any]:
        """The tool specs offered to the model (from the toolsets' signatures) and the sandbox that
        runs the calls (None without tools)."""
        from verifiers.v1.utils.decorators import discover_decorated

        specs = []
        toolsets = type(vtask).toolsets(vtask.config)
        check_toolsets(toolsets, f"verifiers task {type(vtask).__name__}")
        for toolset in toolsets:
            for fn in discover_decorated(toolset, "tool"):
                specs.append(_tool_spec(getattr(fn, "tool_name", None) or fn.__name__, fn))
        return specs, (self._sandbox(vtask) if specs else None)

    async def _episode(self, task: Task, client, model: str) -> dict[str, float]:
        vtask = self.vtask(task)
        tools, sandbox = self.tools(vtask)
        messages: list[dict[str, Any]] = [dict(m) for m in task.prompt]
        extra = {"tools": tools} if tools else {}
        for _ in range(self.max_calls):
            reply = (await client.chat.completions.create(model=model, messages=messages, **extra)).choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:  # in the sandbox, off the event loop (it waits for the worker)
                content = await asyncio.to_thread(sandbox.call, call.function.name, call.function.arguments or "")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
        return await self.score(vtask, messages)

    async def score(self, vtask, messages: list[dict]) -> dict[str, float]:
        """The task's rubric on the conversation: ``reward`` and ``vf/<name>`` per reward and metric."""
        vf = require_verifiers()
        from pydantic import TypeAdapter
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        adapter = TypeAdapter(vf.Message)
        n_prompt = len(_messages(vtask))  # messages past the prompt's that the model wrote were sampled
        nodes = [
            MessageNode(
                message=adapter.validate_python(_vf_message(m)),
                parent=i - 1 if i else None,
                sampled=m["role"] == "assistant" and i >= n_prompt,
            )
            for i, m in enumerate(messages)
        ]
        trace = Trace(
            task=TraceTask(type=type(vtask).__name__, data=vtask.data, key=vtask.key),
            agent=AgentInfo(config=vf.AgentConfig()),
            nodes=nodes,
        )
        await vtask.score(trace)
        scores = {"reward": float(trace.reward)}
        scores.update({f"vf/{k}": float(r.score) for k, r in trace.rewards.items() if r is not None})
        scores.update({f"vf/{k}": float(v) for k, v in trace.metrics.items() if v is not None})
        return scores


def _vf_message(m: dict) -> dict:
    """An OpenAI chat message as verifiers' types take it (tool calls flat: id, name, arguments)."""
    out = {k: v for k, v in m.items() if k in ("role", "content", "tool_call_id")}
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c.get("id", ""), "name": c["function"]["name"], "arguments": c["function"].get("arguments", "{}")}
            for c in m["tool_calls"]
        ]
    return out
