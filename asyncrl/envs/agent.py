"""``env.type=agent``: any agent code, trained through the actor's OpenAI-compatible endpoint.

``env.agent: pkg.module:fn`` names a function (plain or ``async``) that runs one episode of one task
and returns its reward (a float, or a dict of named scores with ``reward``). It is called with the
keyword arguments it names among:

- ``task``: the :class:`asyncrl.types.Task` (``task.prompt`` messages, ``task.answer``, ``metadata``);
- ``client``: an ``openai.OpenAI`` client (``openai.AsyncOpenAI`` for an async function) whose base URL
  is this rollout's endpoint session (:mod:`asyncrl.endpoint.core`); it connects through the endpoint's
  private Unix socket, which another local user can neither reach nor fill;
- ``base_url``, ``api_key``, ``model``: the same, for code that builds its own client (over TCP on
  loopback: the session's secret in the URL guards it, but another local user can take up its
  connection slots).

Each of the ``sampling.n`` rollouts of a task runs the function once, concurrently with the others;
the endpoint answers their calls in batches from the actor's engine. The trajectories are built from
the recorded calls (exact sampled token ids; calls that continue one conversation merge into one
trajectory, others become their own, all with the episode's reward).

Failures are recorded, not fatal (``env/failures``; the episode's ``decision.failures`` says why): the
function raised (an OpenAI error from the endpoint included: a wrong model name, a call after the
budget), returned something that is not a reward, ran past ``env.call_timeout_s`` (the episode's
budget; each call has ``env.kwargs.request_timeout_s``), or never called the endpoint. More than
``env.max_failure_rate`` of them stops the actor, as for any environment. Calls per episode are
bounded by ``env.max_turns``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import queue
import threading
import time
from typing import Any

from ..config import ConfigError
from ..endpoint.core import Endpoint, EndpointError, Session
from ..endpoint.core import tool_parser as make_tool_parser
from ..plugins import resolve_import
from ..types import Task
from .guard import EnvFailure, ScoresError, stopping, validate_scores

AGENT_ARGS = ("task", "client", "base_url", "api_key", "model")
DEFAULT_MODEL_NAME = "policy"


class AgentEnv:
    """The environment of ``env.type=agent`` (see the module doc). ``env.kwargs``: ``model`` (the name
    agent code must ask for; default ``policy``), ``request_timeout_s`` (one call; default 120),
    ``tool_parser`` (``hermes``, ``none`` or ``pkg.module:fn``)."""

    drives_generation = True

    def __init__(
        self,
        reward: str = "",
        max_turns: int = 1,
        agent: str | None = None,
        model: str = DEFAULT_MODEL_NAME,
        request_timeout_s: float = 120.0,
        tool_parser: str = "hermes",
        **_: Any,
    ):
        if not agent:
            raise ConfigError("env.type=agent needs env.agent: the agent function 'pkg.module:fn'")
        fn = resolve_import(agent, "env.agent")
        if not callable(fn):
            raise ConfigError(f"env.agent {agent!r} is not a function")
        self._set_agent(fn, agent)
        self._setup(model, request_timeout_s, tool_parser, max_turns)

    def _set_agent(self, fn, spec: str) -> None:
        self.spec, self.fn = spec, fn
        params = inspect.signature(self.fn).parameters
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.args = AGENT_ARGS if var_kw else tuple(a for a in AGENT_ARGS if a in params)
        unknown = [
            n
            for n, p in params.items()
            if n not in AGENT_ARGS
            and p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        ]
        if unknown:
            raise ConfigError(
                f"env.agent {spec!r}: parameters {unknown} have no default; the agent is called with "
                f"keyword arguments among {', '.join(AGENT_ARGS)}"
            )
        self.is_async = inspect.iscoroutinefunction(self.fn)
        if "client" in self.args:
            try:
                import openai  # noqa: F401
            except ImportError:
                raise ConfigError(
                    f"env.agent {spec!r} takes a 'client', which needs the openai package: "
                    f"pip install 'asyncrl[envs]' (or take base_url instead)"
                ) from None

    def preflight(self) -> None:
        """The agent function's own check of what it needs outside asyncrl (a server it plays, a key),
        when it has one: ``fn.preflight()``, called before a run starts; what it raises is one line."""
        check = getattr(self.fn, "preflight", None)
        if callable(check):
            try:
                check()
            except Exception as e:  # noqa: BLE001 - any failure of the user's check refuses the run in one line
                raise ConfigError(f"env.agent {self.spec!r}: {e}") from None

    def _setup(self, model: str, request_timeout_s: float, tool_parser: str, max_turns: int) -> None:
        self.model = str(model)
        self.request_timeout_s = float(request_timeout_s)
        self.parser = make_tool_parser(str(tool_parser))
        self.max_calls = int(max_turns)
        self._endpoint: Endpoint | None = None
        self._endpoint_lock = threading.Lock()

    # the Environment protocol: reset gives the opening messages; the agent does the rest
    def reset(self, task: Task) -> list[dict[str, str]]:
        return [dict(m) for m in task.prompt]

    def step(self, task, history, response):
        raise RuntimeError("env.type=agent drives its own generation (drive()); step() is never called")

    def evaluate(self, task, history) -> dict[str, float]:
        raise RuntimeError("env.type=agent scores in the agent function; evaluate() is never called")

    def endpoint(self, tokenizer, engine, sampling) -> Endpoint:
        """The process's endpoint (one server, shared by the rollout threads of ``inflight``)."""
        with self._endpoint_lock:
            if self._endpoint is None or self._endpoint.tokenizer is not tokenizer:
                if self._endpoint is not None:
                    self._endpoint.close()
                self._endpoint = Endpoint(
                    tokenizer, self.model, sampling, engine.eos_ids, self.parser, self.request_timeout_s
                )
            self._endpoint.configure(sampling, engine.eos_ids, _context_tokens(engine))
            return self._endpoint

    def drive(self, engine, tokenizer, convs: list, sampling, seed: int | None, guard) -> list:
        """Run the agent once per conversation in ``convs`` (those not already failed) and fill each
        from its recorded calls: ``token_ids``/``loss_mask``/``logprobs`` (the first trajectory),
        ``extra_rows`` (the others), ``scores`` or ``failure``."""
        endpoint = self.endpoint(tokenizer, engine, sampling)
        live = [c for c in convs if not c.done]
        runs: list[tuple[Any, Session, concurrent.futures.Future, float]] = []
        timeout = guard.timeout_s if guard is not None else None
        for conv in live:
            if guard is not None:
                guard.check_rate()
            try:
                session = endpoint.open(self.max_calls)
            except EndpointError as e:  # too many sessions open at once: this rollout fails, in one line
                conv.failure, conv.done = f"env.agent {self.spec} (task {conv.task.id}): {e}", True
                if guard is not None:
                    guard.record(conv.failure)
                continue
            fut = _RUNNER.start(self, conv.task, session)
            fut.add_done_callback(lambda _: endpoint.wake())  # the loop below recounts the agents still running
            runs.append((conv, session, fut, time.monotonic()))
        batch_seed = seed
        try:
            while True:
                running = [r for r in runs if not r[2].done()]
                if not running:
                    break
                now = time.monotonic()
                budget_end = guard.deadline if guard is not None else None
                for conv, session, fut, t0 in running:
                    over = (timeout is not None and now - t0 > timeout) or (budget_end is not None and now > budget_end)
                    if over or stopping():
                        fut.cancel()
                        session.close()
                        conv.failure = (
                            f"env.agent {self.spec} (task {conv.task.id}): no result after "
                            f"{now - t0:.0f} s (env.call_timeout_s)"
                            if not stopping()
                            else f"env.agent {self.spec} (task {conv.task.id}): abandoned, the process is stopping"
                        )
                running = [r for r in running if r[0].failure is None]
                calls = endpoint.wait_batch(len(running), timeout=0.25)
                if calls:
                    endpoint.serve(engine, calls, batch_seed)
                    batch_seed = None if batch_seed is None else batch_seed + 7919
                if guard is not None and guard.tick is not None:
                    guard.tick()
        finally:
            for _, session, _, _ in runs:
                session.close()
        for conv, session, fut, _ in runs:
            self._finish(conv, session, fut, guard)
        return convs

    def _finish(self, conv, session: Session, fut, guard) -> None:
        what = f"env.agent {self.spec} (task {conv.task.id})"
        if conv.failure is None:
            try:
                value = fut.result()
                scores = validate_scores(value)
                if not session.segments:
                    raise EnvFailure(
                        f"{what}: the agent made no call to the endpoint: nothing to train on"
                        + (f" (its calls were refused: {session.rejected[-1]})" if session.rejected else "")
                    )
            except ScoresError as e:
                conv.failure = f"{what} {e}"
            except EnvFailure as e:
                conv.failure = str(e)
            except Exception as e:  # noqa: BLE001 - the user's agent may raise anything: this rollout fails
                conv.failure = f"{what} raised {type(e).__name__}: {str(e)[:300]}"
            else:
                conv.scores = scores
        if guard is not None:
            guard.record(conv.failure)
        conv.done = True
        if conv.failure is not None or not session.segments:
            return
        first, *rest = session.segments
        conv.token_ids, conv.loss_mask, conv.logprobs = first.ids, first.mask, first.logprobs
        conv.texts, conv.finish_reasons, conv.turns = first.texts, first.finish_reasons, first.calls
        conv.versions = first.versions
        conv.extra_rows = [(s.ids, s.mask, s.logprobs, s.texts, s.finish_reasons, s.calls, s.versions) for s in rest]


class _AgentRunner:
    """One asyncio loop thread per process running the agent functions (async ones as tasks, plain
    ones on its thread pool), each with a client bound to its session."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lock = threading.Lock()
        self.pool = _DaemonThreads(256, "asyncrl-agent")
        self.clients = _ClientPool()

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self.lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self.loop.run_forever, name="asyncrl-agents", daemon=True).start()
            return self.loop

    def start(self, env: AgentEnv, task: Task, session: Session) -> concurrent.futures.Future:
        loop = self._ensure()
        return asyncio.run_coroutine_threadsafe(self._run(env, task, session), loop)

    async def _run(self, env: AgentEnv, task: Task, session: Session) -> Any:
        values: dict[str, Any] = {
            "task": task,
            "base_url": session.base_url,
            "api_key": session.token,
            "model": env.model,
        }
        key = (env.is_async, env.request_timeout_s, session.endpoint.server.uds_path)
        client = self.clients.lease(key) if "client" in env.args else None
        try:
            if client is not None:
                values["client"] = client.with_options(base_url=session.base_url, api_key=session.token)
            kwargs = {k: values[k] for k in env.args}
            if env.is_async:
                return await env.fn(**kwargs)
            result = await asyncio.get_running_loop().run_in_executor(self.pool, lambda: env.fn(**kwargs))
            if inspect.isawaitable(result):
                return await result
            return result
        finally:
            if client is not None:
                await self.clients.give_back(key, client)


class _DaemonThreads(concurrent.futures.Executor):
    """The threads plain agent functions run on: up to ``limit``, made when none is idle, kept for
    the next agents. Daemon threads, unlike a ``ThreadPoolExecutor``'s, which the interpreter joins at
    exit: an agent that never returns (its rollout already failed for it) must not hold the actor's
    exit for ever, as the guard's abandoned calls do not (:mod:`asyncrl.envs.guard`)."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit, self.name = limit, name
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.threads = 0

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((future, fn, args, kwargs))
        if not self.idle.acquire(blocking=False):
            with self.lock:
                if self.threads < self.limit:
                    self.threads += 1
                    threading.Thread(target=self._work, name=f"{self.name}_{self.threads}", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            future, fn, args, kwargs = self.jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - the agent's own exception, for its rollout
                    future.set_exception(e)
            del future, fn, args, kwargs
            self.idle.release()


def _context_tokens(engine) -> int | None:
    """The engine's model context in tokens, where it says (the HF engine's model; vLLM's max_model_len)."""
    for owner, name in (
        (getattr(getattr(engine, "model", None), "config", None), "max_position_embeddings"),
        (engine, "max_model_len"),
    ):
        n = getattr(owner, name, None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


class _ClientPool:
    """``openai`` clients lent to rollouts, one rollout at a time each, so that each rollout has a
    connection pool of its own; they speak HTTP through :mod:`asyncrl.endpoint.client`. One client
    shared by every rollout is far slower: httpcore matches each request against every connection of
    its pool (checking each socket): with 64 rollouts calling at once, ``bench/bench_endpoint.py
    --per-call`` measured 8.2-10.3 ms a call on threads and 30 ms with ``AsyncOpenAI``, against
    3.9-5.3 and 3.6-4.6 ms with a client each. A client is made once (no TLS context: a default client
    loads the CA store, ~40 ms) and lent again after; at most ``keep`` wait."""

    def __init__(self, keep: int = 1024) -> None:
        self.keep = keep
        self.free: dict[tuple, list[Any]] = {}
        self.lock = threading.Lock()

    def lease(self, key: tuple) -> Any:
        with self.lock:
            free = self.free.get(key)
            if free:
                return free.pop()
        import openai

        from ..endpoint.client import AsyncLoopbackTransport, LoopbackTransport

        is_async, timeout, uds = key
        cls, http, transport = (
            (openai.AsyncOpenAI, openai.DefaultAsyncHttpxClient, AsyncLoopbackTransport)
            if is_async
            else (openai.OpenAI, openai.DefaultHttpxClient, LoopbackTransport)
        )
        # trust_env=False: no proxy from the environment for a loopback endpoint; uds: the endpoint's private
        # Unix socket (another user who fills its TCP port's connections takes none of the agents')
        return cls(
            base_url="http://127.0.0.1/v1",
            api_key="-",
            max_retries=0,
            timeout=timeout + 5,
            http_client=http(transport=transport(uds=uds), trust_env=False),
        )

    async def give_back(self, key: tuple, client: Any) -> None:
        with self.lock:
            free = self.free.setdefault(key, [])
            if len(free) < self.keep:
                free.append(client)
                return
        closed = client.close()
        if inspect.isawaitable(closed):
            await closed


_RUNNER = _AgentRunner()
