"""An OpenAI-compatible endpoint over the actor's own engine, with exact token bookkeeping.

Agent code (``env.type=agent``, :mod:`asyncrl.envs.agent`) talks to the policy the way it talks to
any model server: ``POST {base_url}/chat/completions`` (or ``/completions``) with the ``openai``
client. Every rollout gets its own base URL, ``http://127.0.0.1:PORT/s/<secret>/v1``; the server
binds loopback only and the unguessable path is the session's credential.

What it records, per rollout (a :class:`Session`), is what the learner trains on:

- the prompt token ids of every call and the completion token ids the engine sampled, with their
  behaviour log-probs. Completions are never re-tokenised;
- a call whose messages extend an earlier call's messages plus the assistant message that call
  returned (the usual multi-turn loop) continues that call's *token ids*: the new prompt is the old
  ids, the completion's ids, an EOS if the completion did not end on one, and the template's tokens
  for the new messages. So the model is conditioned on what it actually sampled, and the calls merge
  into one trajectory (environment tokens ``loss_mask = 0``, generated tokens ``1``). A call that
  extends nothing starts a new trajectory (a :class:`Segment`).

The server is uvicorn on an event loop thread of its own (:mod:`.server`): HTTP/1.1 with
keep-alive, ``/v1/chat/completions`` and ``/v1/completions`` (``stream: true`` as server-sent events in
OpenAI's chunk format), ``/v1/responses`` (:mod:`.responses`) and ``/v1/models``. Requests are
answered in batches: the rollout's thread (the one that owns the engine) waits until every running
agent is blocked on a call (or a short linger passed) and generates them together. Answers carry the
sampled ids (``token_ids``, ``prompt_token_ids``) and, when asked (``logprobs``), the engine's
log-probs of them.

Sampling: ``max_tokens``/``max_completion_tokens`` (capped at ``sampling.max_new_tokens``), ``stop``
(added to ``sampling.stop``) and ``n`` are honoured; the run's ``sampling.temperature`` and ``top_p``
are always used, because the learner's importance ratios assume them (a request's ``temperature``,
``top_p``, ``seed`` are ignored). ``tools`` are rendered by the chat template (when it takes them)
and tool calls are parsed from the completion by ``tool_parser`` (``hermes``: Qwen/Hermes
``<tool_call>{json}</tool_call>``; ``none``; or ``pkg.module:fn(text) -> (content, [calls])``).

Errors are OpenAI-shaped JSON (``{"error": {"message", "type", "code"}}``), never a crash: malformed
JSON, a missing field, an unknown model name, an unknown or finished session, a call past the
session's call budget, a completion that did not come within ``request_timeout_s``, more than
``MAX_SESSIONS`` sessions open at once.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from ..config import ConfigError, SamplingConfig
from ..engine.base import token_versions
from ..plugins import resolve_import
from ..prompts import delta_tokens, prompt_format, render_tokens
from . import responses
from .server import Server, decode_json, fresh_id, read_body, send_events, send_json

MAX_BODY_BYTES = 8 << 20
MAX_CONNECTIONS = 4096  # open at once; more are answered 503 and closed
READ_TIMEOUT_S = 30.0  # a connection that sends nothing for this long while not answered (idle, slow-loris) is closed
MAX_SESSIONS = 4096  # rollouts open at once on one endpoint; more are refused (the rollout fails, in one line)
MAX_RESPONSES = 64  # Responses API answers a session keeps for previous_response_id
MAX_N = 16
MAX_DEPTH = 32  # a request's JSON nesting
MAX_ITEMS = 20_000  # a request's list items and object keys, all together (messages, content parts, tools)
MIN_PROMPT_CHARS = 1 << 16  # a request's characters before tokenising: at least this, else ...
CHARS_PER_TOKEN = 16  # ... this many per token of the model's context
LINGER_S = 0.02  # a batch goes once no new call arrived for this long (or every agent is waiting) ...
LINGER_MAX_S = 0.2  # ... longer while agents have yet to call and a batch costs the engine much (Endpoint.linger)
ToolParser = Callable[[str], "tuple[str | None, list[dict[str, Any]]]"]


class EndpointError(Exception):
    """An OpenAI-style error answer: HTTP ``status``, ``code`` and a one-line message."""

    def __init__(self, status: int, code: str, message: str, kind: str = "invalid_request_error", close: bool = False):
        super().__init__(message)
        self.status, self.code, self.kind, self.close = status, code, kind, close

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "code": self.code, "param": None}}


# ---- tool calls -------------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Qwen/Hermes tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Returns
    the content before the first call (None when empty) and the calls that parse; a block that is
    not such JSON is left in the content (the model's output, not an error)."""
    calls, first = [], None
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", {})
            calls.append({"name": obj["name"], "arguments": args if isinstance(args, dict) else {"value": args}})
            first = m.start() if first is None else first
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls


def tool_parser(spec: str) -> ToolParser | None:
    """The tool-call parser named by ``spec`` (``hermes``, ``none`` or ``pkg.module:fn``)."""
    if spec == "none":
        return None
    if spec == "hermes":
        return parse_hermes
    if ":" in spec:
        fn = resolve_import(spec, "env.kwargs.tool_parser")
        if not callable(fn):
            raise ConfigError(f"env.kwargs.tool_parser {spec!r} is not a function")
        return fn
    raise ConfigError(f"env.kwargs.tool_parser: {spec!r} is not 'hermes', 'none' or an import path 'pkg.module:fn'")


# ---- messages ---------------------------------------------------------------------------------


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is understood
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise EndpointError(
                    400, "invalid_content", f"{where}: only text content parts are supported, got {str(p)[:80]}"
                )
            parts.append(p["text"])
        return "".join(parts)
    raise EndpointError(
        400,
        "invalid_content",
        f"{where}: content must be a string, a list of text parts or null, got {type(content).__name__}",
    )


def _norm_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    out = []
    for c in calls or []:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EndpointError(400, "invalid_tool_calls", f"{where}: each tool call needs function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError:
                pass  # kept as the string it is
        out.append({"name": fn["name"], "arguments": args})
    return out


def normalize_messages(raw: Any) -> list[dict[str, Any]]:
    """Chat messages as ``{role, content[, tool_calls][, tool_call_id]}`` with string content (the
    form templates render and prefixes are compared in); EndpointError on a malformed list."""
    if not isinstance(raw, list) or not raw:
        raise EndpointError(400, "invalid_messages", "'messages' must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise EndpointError(400, "invalid_messages", f"{where}: a message is an object with a string 'role'")
        msg: dict[str, Any] = {"role": m["role"], "content": _content_text(m.get("content"), where)}
        if m.get("tool_calls"):
            msg["tool_calls"] = _norm_calls(m["tool_calls"], where)
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        out.append(msg)
    return out


def _same(a: dict, b: dict) -> bool:
    """Two normalised messages are the same turn (role, text and tool calls; ids are the client's)."""
    return a["role"] == b["role"] and a["content"] == b["content"] and a.get("tool_calls") == b.get("tool_calls")


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them (tool-call arguments as objects, ids as given)."""
    out = []
    for m in messages:
        t = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls"):
            t["tool_calls"] = [{"type": "function", "function": c} for c in m["tool_calls"]]
        if "tool_call_id" in m:
            t["tool_call_id"] = m["tool_call_id"]
        out.append(t)
    return out


_sorted_json = msgspec.json.Encoder(order="sorted").encode


def render_prompt(tokenizer, messages: list[dict], tools: list | None, cache: dict | None = None) -> list[int]:
    """Prompt ids of a new conversation (the run's prompt format; ``tools`` to the chat template).
    ``cache`` (bounded by the caller) keeps renders of repeated prompts: a group's ``n`` rollouts all
    open with the task's prompt, and the chat template costs more than the rest of a call."""
    if cache is not None:
        key = _sorted_json([messages, tools])
        ids = cache.get(key)
        if ids is None:
            if len(cache) >= 4096:
                cache.clear()
            ids = cache[key] = render_prompt(tokenizer, messages, tools)
        return list(ids)
    msgs = _template_messages(messages)
    if tools and prompt_format(tokenizer) == "chat":
        text = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return render_tokens(tokenizer, msgs)


# ---- sessions ---------------------------------------------------------------------------------


@dataclass
class Segment:
    """One future trajectory: the token ids so far, which of them were generated, their log-probs."""

    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int] = field(default_factory=list)  # per token: the generating policy version, -1 if none
    messages: list[dict] | None = None  # chat: the conversation these ids render (ends on the assistant)
    text: str | None = None  # completions: the prompt text plus completions so far
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    calls: int = 0


@dataclass
class Call:
    """One pending completion request (``n`` samples of one prompt)."""

    session: "Session"
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    n: int
    chat: bool
    base: Segment | None  # the segment this call extends (None: a new one)
    base_len: int
    messages: list[dict] | None = None
    prompt_text: str | None = None
    tools: bool = False
    kind: str = "chat"  # chat, completions or responses: the shape of the answer
    stream: bool = False
    logprobs: bool = False  # the answer carries the sampled tokens' log-probs
    include_usage: bool = False  # a stream ends with a usage chunk (stream_options.include_usage)
    body: dict = field(default_factory=dict)  # (responses: the request, echoed in the answer)
    history: list | None = None  # (responses: the conversation asked, as chat messages)
    waiter: tuple | None = None  # (event loop, future) of the HTTP handler awaiting it
    generations: list = field(default_factory=list)
    error: EndpointError | None = None


def finish_calls(calls: list[Call]) -> None:
    """Wake the handlers of finished ``calls``: one wake-up per event loop, not one per call."""
    loops: dict[Any, list] = {}
    for c in calls:
        if c.waiter is not None:
            loops.setdefault(c.waiter[0], []).append(c.waiter[1])
    for loop, futures in loops.items():
        try:
            loop.call_soon_threadsafe(_resolve, futures)
        except RuntimeError:  # the loop is closed: the server has stopped
            pass


class _Deadlines:
    """The request timeout of every call awaited on one event loop, with one timer: calls are
    queued in the order they came, and all have the same timeout, so their deadlines come in that
    order too; the timer fires at the first one's (a timer per call cost the server more)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.queue: collections.deque = collections.deque()
        self.timer = None

    def add(self, loop, future) -> None:
        queue = self.queue
        while queue and queue[0][1].done():  # (answered calls leave from the front, mostly in order)
            queue.popleft()
        queue.append((loop.time() + self.timeout_s, future))
        if self.timer is None:
            self.timer = loop.call_at(self.queue[0][0], self._fire, loop)

    def _fire(self, loop) -> None:
        self.timer, now, queue = None, loop.time(), self.queue
        while queue and (queue[0][1].done() or queue[0][0] <= now):
            _, future = queue.popleft()
            if not future.done():
                future.set_exception(TimeoutError())
        if queue:
            self.timer = loop.call_at(queue[0][0], self._fire, loop)


def _resolve(futures: list) -> None:
    for f in futures:
        if not f.done():
            f.set_result(None)


class Session:
    """One rollout's calls and the segments they built."""

    def __init__(self, endpoint: "Endpoint", budget: int | None):
        self.endpoint = endpoint
        self.token = secrets.token_urlsafe(24)
        self.segments: list[Segment] = []
        self.budget = budget  # most calls (None: no limit)
        self.calls = 0
        self.rejected: list[str] = []  # the errors answered, for the failure record
        self.responses: OrderedDict[str, list[dict]] = OrderedDict()  # Responses API: id -> its conversation
        self.closed = False
        self.lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.endpoint.port}/s/{self.token}/v1"

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self.endpoint.drop(self)

    def find_chat_base(self, messages: list[dict]) -> Segment | None:
        """The longest segment whose conversation ``messages`` extends with at least one message."""
        best = None
        for seg in self.segments:
            m = seg.messages
            if m is not None and len(m) < len(messages) and all(_same(a, b) for a, b in zip(m, messages)):
                if best is None or len(m) > len(best.messages):
                    best = seg
        return best

    def find_text_base(self, prompt: str) -> Segment | None:
        best = None
        for seg in self.segments:
            if (
                seg.text is not None
                and prompt.startswith(seg.text)
                and (best is None or len(seg.text) > len(best.text))
            ):
                best = seg
        return best


class Endpoint:
    """The HTTP server (one per process, started on first use) and its queue of calls."""

    def __init__(
        self,
        tokenizer,
        model_name: str,
        sampling: SamplingConfig,
        eos_ids,
        parser: ToolParser | None,
        request_timeout_s: float | None,
    ):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.configure(sampling, eos_ids)
        self.parser = parser
        self.request_timeout_s = request_timeout_s
        self.sessions: dict[str, Session] = {}
        self.pending: list[Call] = []
        self.cond = threading.Condition()
        self.last_arrival = 0.0
        self._woken = False
        self._waiting: dict[int, int] = {}  # thread -> the calls its wait_batch waits for
        self.generate_s = 0.0  # the last batch's generation time (Endpoint.linger)
        self.render_cache: dict[str, list[int]] = {}
        self.app = _App(self)
        self.server = Server(self.app, MAX_CONNECTIONS, READ_TIMEOUT_S)
        self.port = self.server.server_address[1]

    def configure(self, sampling: SamplingConfig, eos_ids, context_tokens: int | None = None) -> None:
        """The sampling settings, EOS and context length (None: unknown) of the engine the next batch of
        rollouts uses."""
        self.sampling = sampling
        self.context_tokens = context_tokens
        self.max_prompt_chars = max(MIN_PROMPT_CHARS, CHARS_PER_TOKEN * (context_tokens or 0))
        self.eos = int(min(eos_ids)) if eos_ids else None
        self.eos_ids = set(int(e) for e in eos_ids or ())

    def open(self, budget: int | None) -> Session:
        """A new session (one rollout); EndpointError past ``MAX_SESSIONS`` open at once."""
        s = Session(self, budget)
        with self.cond:
            if len(self.sessions) >= MAX_SESSIONS:
                raise EndpointError(
                    503,
                    "too_many_sessions",
                    f"{MAX_SESSIONS} rollouts already hold a session on this actor's endpoint; no more are opened",
                )
            self.sessions[s.token] = s
        return s

    def drop(self, session: Session) -> None:
        """Forget ``session``; its calls still waiting are answered with an error."""
        with self.cond:
            self.sessions.pop(session.token, None)
            left = [c for c in self.pending if c.session is session]
            self.pending = [c for c in self.pending if c.session is not session]
        for c in left:
            c.error = EndpointError(400, "episode_ended", "the episode this call belongs to has ended")
        finish_calls(left)

    def close(self) -> None:
        self.server.close()

    # -- the engine's side ----------------------------------------------------------------------
    def wake(self) -> None:
        """Make a waiting :meth:`wait_batch` return (an agent finished: fewer calls to wait for)."""
        with self.cond:
            self._woken = True
            self.cond.notify_all()

    def wait_batch(self, running: int, timeout: float) -> list[Call]:
        """Calls to generate now: once ``running`` calls wait (every agent is blocked), or when no new
        call came for :meth:`linger` seconds; [] after ``timeout`` seconds without any, or at a :meth:`wake`."""
        deadline = time.monotonic() + timeout
        me = threading.get_ident()
        with self.cond:
            self._waiting[me] = running
            try:
                while True:
                    now = time.monotonic()
                    linger = self.linger(len(self.pending), running)
                    if self.pending and (len(self.pending) >= running or now - self.last_arrival >= linger):
                        batch, self.pending = self.pending, []
                        return batch
                    if self._woken and not self.pending:
                        self._woken = False
                        return []
                    if now >= deadline:
                        return []
                    wait = deadline - now
                    if self.pending:  # (at most LINGER_S: calls that came meanwhile shorten the linger)
                        wait = min(wait, linger - (now - self.last_arrival) + 1e-3, LINGER_S)
                    self.cond.wait(max(wait, 1e-3))
            finally:
                del self._waiting[me]

    def linger(self, pending: int, running: int) -> float:
        """How long a batch waits for a next call: ``LINGER_S``, or longer while many of the ``running``
        agents have yet to call: up to a quarter of the last batch's generation time (at most
        ``LINGER_MAX_S``), times the share of agents not yet waiting. A batch costs the engine about as
        much with 2 calls as with 64, so going with the first 2 while 62 agents are still building their
        requests (their clients share this process; a pause of the interpreter parts their arrivals)
        would make the 62 wait a whole batch more."""
        if running <= 0 or pending >= running:
            return LINGER_S
        return max(LINGER_S, min(LINGER_MAX_S, self.generate_s / 4) * (running - pending) / running)

    def serve(self, engine, calls: list[Call], seed: int | None) -> None:
        """Generate ``calls`` with ``engine`` (grouped by max_tokens and stop strings) and record them."""
        groups: dict[tuple, list[Call]] = {}
        t0 = time.monotonic()
        for c in calls:
            groups.setdefault((c.max_tokens, tuple(c.stop)), []).append(c)
        for k, ((max_tokens, stop), group) in enumerate(groups.items()):
            sampling = SamplingConfig(
                n=1,
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                max_new_tokens=max_tokens,
                stop=list(stop),
            )
            prompts = [c.prompt_ids for c in group for _ in range(c.n)]
            try:
                gens = engine.generate(prompts, sampling, seed=None if seed is None else seed + k)
            except Exception as e:  # noqa: BLE001 - e.g. a prompt longer than the engine takes: that call fails
                for c in group:
                    c.error = EndpointError(
                        400,
                        "generation_failed",
                        f"the engine could not generate: {type(e).__name__}: {str(e)[:300]}",
                        "server_error",
                    )
                finish_calls(group)
                continue
            i = 0
            for c in group:
                c.generations = gens[i : i + c.n]
                i += c.n
                self._record(c, engine.version)
            finish_calls(group)
        self.generate_s = time.monotonic() - t0

    def _record(self, c: Call, version: int) -> None:
        """Extend the call's base segment (or start new ones) with each generation."""
        s = c.session
        with s.lock:
            for j, g in enumerate(c.generations):
                gen_ids, gen_lp, gen_v = g.token_ids.tolist(), g.logprobs.tolist(), token_versions(g, version)
                base = c.base
                # extend in place only the first sample, and only if nothing extended the base meanwhile
                if base is not None and j == 0 and len(base.ids) == c.base_len:
                    seg = base
                    extra = c.prompt_ids[len(seg.ids) :]
                    seg.ids += extra
                    seg.mask += [0] * len(extra)
                    seg.logprobs += [0.0] * len(extra)
                    seg.versions += [-1] * len(extra)
                else:
                    n_prompt = len(c.prompt_ids)
                    prefix_mask = base.mask[: c.base_len] if base is not None else []
                    prefix_lp = base.logprobs[: c.base_len] if base is not None else []
                    prefix_v = base.versions[: c.base_len] if base is not None else []
                    seg = Segment(
                        ids=list(c.prompt_ids),
                        mask=prefix_mask + [0] * (n_prompt - len(prefix_mask)),
                        logprobs=prefix_lp + [0.0] * (n_prompt - len(prefix_lp)),
                        versions=prefix_v + [-1] * (n_prompt - len(prefix_v)),
                        texts=list(base.texts) if base is not None else [],
                        finish_reasons=list(base.finish_reasons) if base is not None else [],
                        calls=base.calls if base is not None else 0,
                    )
                    s.segments.append(seg)
                seg.ids += gen_ids
                seg.mask += [1] * len(gen_ids)
                seg.logprobs += gen_lp
                seg.versions += gen_v
                seg.texts.append(g.text)
                seg.finish_reasons.append(g.finish_reason)
                seg.calls += 1
                if c.chat:
                    content, tool_calls = self.parse_tools(g.text, c.tools)
                    reply = {"role": "assistant", "content": content or ""}
                    if tool_calls:
                        reply["tool_calls"] = tool_calls
                    seg.messages = list(c.messages) + [reply]
                else:
                    seg.text = c.prompt_text + g.text

    def parse_tools(self, text: str, tools: bool) -> tuple[str | None, list[dict]]:
        if not tools or self.parser is None:
            return text, []
        try:
            content, calls = self.parser(text)
        except Exception:  # noqa: BLE001 - a user parser that fails on model output: no tool calls
            return text, []
        return content, list(calls or [])

    # -- the HTTP side --------------------------------------------------------------------------
    def session(self, token: str) -> Session:
        with self.cond:
            s = self.sessions.get(token)
        if s is None or s.closed:
            raise EndpointError(400, "episode_ended", "no such episode: it has ended, or the URL is wrong")
        return s

    def submit(self, s: Session, body: dict, kind: str, waiter: tuple | None = None) -> Call:
        """Queue the call of request ``body`` on route ``kind`` (``chat``, ``completions`` or
        ``responses``) for the next batch; EndpointError on a request that cannot be answered.
        ``waiter``: ``(event loop, future)`` resolved when the call is done."""
        model = body.get("model")
        if model != self.model_name:
            raise EndpointError(
                404, "model_not_found", f"the model {model!r} does not exist; this endpoint serves {self.model_name!r}"
            )
        n, max_tokens, stop = _sampling_args(body, kind, self.sampling.max_new_tokens)
        cap = self.sampling.max_new_tokens
        if kind == "responses":
            tools = responses.chat_tools(body.get("tools"), EndpointError)
        else:
            tools = body.get("tools") or None
            if tools is not None and not isinstance(tools, list):
                raise EndpointError(400, "invalid_tools", "'tools' must be a list")
        opts = body.get("stream_options")
        _check_size(body, self.max_prompt_chars)  # (before anything is tokenised)
        with s.lock:
            if s.closed:
                raise EndpointError(400, "episode_ended", "the episode this call belongs to has ended")
            if s.budget is not None and s.calls >= s.budget:
                raise EndpointError(
                    400,
                    "call_budget_spent",
                    f"this episode has made its {s.budget} calls (env.max_turns); no more are answered",
                )
            if kind == "responses":
                history = self._responses_messages(s, body)
                call = self._chat_call(s, history, tools)
                call.body, call.history = body, history
                call.logprobs = responses.LOGPROBS_INCLUDE in (body.get("include") or [])
            elif kind == "chat":
                call = self._chat_call(s, body.get("messages"), tools)
                call.logprobs = bool(body.get("logprobs"))
            else:
                call = self._text_call(s, body)
                call.logprobs = body.get("logprobs") not in (None, False)
            context = self.context_tokens
            if context and len(call.prompt_ids) + min(max_tokens, cap) > context:
                raise EndpointError(
                    400,
                    "context_length_exceeded",
                    f"the prompt is {len(call.prompt_ids)} tokens and "
                    f"the answer may take {min(max_tokens, cap)}: more than the model's context of "
                    f"{context} tokens",
                )
            s.calls += 1
        call.kind, call.stream, call.waiter = kind, bool(body.get("stream")), waiter
        call.include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        call.max_tokens, call.n = min(max_tokens, cap), n
        call.stop = list(dict.fromkeys([*self.sampling.stop, *stop]))
        with self.cond:
            self.pending.append(call)
            self.last_arrival = time.monotonic()
            # a waiting wait_batch wakes for the first call (its linger starts) and for the one that
            # completes a batch; between them it looks again every LINGER_S at most
            if len(self.pending) == 1 or len(self.pending) >= min(self._waiting.values(), default=0):
                self.cond.notify_all()
        return call

    @staticmethod
    def _responses_messages(s: Session, body: dict) -> list[dict]:
        prev_id = body.get("previous_response_id")
        previous = None
        if prev_id is not None:
            previous = s.responses.get(prev_id) if isinstance(prev_id, str) else None
            if previous is None:
                raise EndpointError(
                    404,
                    "previous_response_not_found",
                    f"previous_response_id {str(prev_id)[:60]!r} "
                    f"is not a response of this episode (the last "
                    f"{MAX_RESPONSES} are kept)",
                )
        return responses.chat_messages(body, previous, EndpointError)

    def _chat_call(self, s: Session, raw_messages: Any, tools) -> Call:
        messages = normalize_messages(raw_messages)
        base = s.find_chat_base(messages)
        if base is None:
            ids = render_prompt(self.tokenizer, messages, tools, self.render_cache)
        else:
            ids = list(base.ids)
            if self.eos is not None and (not ids or ids[-1] not in self.eos_ids):
                ids.append(self.eos)  # close a turn that ended on a stop string or the length cap
            ids += delta_tokens(
                self.tokenizer, _template_messages(base.messages), _template_messages(messages[len(base.messages) :])
            )
        return Call(s, ids, 0, [], 1, True, base, len(base.ids) if base else 0, messages=messages, tools=bool(tools))

    def _text_call(self, s: Session, body: dict) -> Call:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise EndpointError(400, "invalid_prompt", f"prompt token ids must lie in [0, {vocab})")
            return Call(s, list(prompt), 0, [], 1, False, None, 0, prompt_text=self.tokenizer.decode(prompt))
        if not isinstance(prompt, str) or not prompt:
            raise EndpointError(400, "invalid_prompt", "'prompt' must be a non-empty string (or a list of token ids)")
        base = s.find_text_base(prompt)
        if base is None:
            ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        else:
            ids = list(base.ids) + list(self.tokenizer(prompt[len(base.text) :], add_special_tokens=False)["input_ids"])
        return Call(s, ids, 0, [], 1, False, base, len(base.ids) if base else 0, prompt_text=prompt)

    # -- answers --------------------------------------------------------------------------------
    def _pieces(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]

    def _chat_logprobs(self, ids: list[int], lps: list[float]) -> dict:
        return {"content": self._logprob_items(ids, lps), "refusal": None}

    def _logprob_items(self, ids: list[int], lps: list[float]) -> list[dict]:
        return [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(self._pieces(ids), lps)
        ]

    def _text_logprobs(self, ids: list[int], lps: list[float]) -> dict:
        pieces = self._pieces(ids)
        offsets, at = [], 0
        for p in pieces:
            offsets.append(at)
            at += len(p)
        return {"tokens": pieces, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}

    def _usage(self, c: Call) -> dict:
        usage = {"prompt_tokens": len(c.prompt_ids), "completion_tokens": sum(len(g.token_ids) for g in c.generations)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return usage

    def _chat_message(self, c: Call, g) -> tuple[dict, str]:
        content, calls = self.parse_tools(g.text, c.tools)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if not calls:
            return msg, g.finish_reason
        msg["tool_calls"] = [
            {
                "id": fresh_id("call_"),
                "type": "function",
                "function": {"name": t["name"], "arguments": json.dumps(t["arguments"])},
            }
            for t in calls
        ]
        return msg, "tool_calls"

    def response(self, c: Call) -> dict:
        """The answer to a finished call, in its route's shape."""
        if c.kind == "responses":
            rid = fresh_id("resp_")
            resp, reply = responses.response_body(
                c,
                c.generations[0],
                self.parse_tools,
                self.model_name,
                c.body,
                self._logprob_items if c.logprobs else None,
                rid,
            )
            s = c.session
            with s.lock:
                s.responses[rid] = [*c.history, reply]
                while len(s.responses) > MAX_RESPONSES:
                    s.responses.popitem(last=False)
            return resp
        chat = c.kind == "chat"
        choices = []
        for i, g in enumerate(c.generations):
            ids, lps = g.token_ids.tolist(), g.logprobs.tolist()
            choice: dict[str, Any] = {"index": i, "finish_reason": g.finish_reason, "logprobs": None, "token_ids": ids}
            if chat:
                choice["message"], choice["finish_reason"] = self._chat_message(c, g)
                if c.logprobs:
                    choice["logprobs"] = self._chat_logprobs(ids, lps)
            else:
                choice["text"] = g.text
                if c.logprobs:
                    choice["logprobs"] = self._text_logprobs(ids, lps)
            choices.append(choice)
        return {
            "id": fresh_id("chatcmpl-" if chat else "cmpl-"),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": self._usage(c),
            "prompt_token_ids": c.prompt_ids,
        }

    def stream(self, c: Call) -> list[tuple[str | None, Any]]:
        """The server-sent events of a finished call asked with ``stream: true``: OpenAI's chunks
        (chat, completions; ``[DONE]`` last) or the Responses API's typed events. The completion is
        generated whole before its events are sent."""
        resp = self.response(c)
        if c.kind == "responses":
            return responses.stream_events(resp)
        chat = c.kind == "chat"
        head = {
            "id": resp["id"],
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": resp["created"],
            "model": self.model_name,
        }
        out: list[tuple[str | None, Any]] = []

        def chunk(choice: dict, **extra) -> None:
            out.append((None, {**head, "choices": [choice], **extra}))

        for ch in resp["choices"]:
            i, ids = ch["index"], ch["token_ids"]
            if not chat:
                chunk(
                    {
                        "index": i,
                        "text": ch["text"],
                        "logprobs": ch["logprobs"],
                        "finish_reason": None,
                        "token_ids": ids,
                    },
                    **({"prompt_token_ids": c.prompt_ids} if i == 0 else {}),
                )
                chunk({"index": i, "text": "", "logprobs": None, "finish_reason": ch["finish_reason"]})
                continue
            msg = ch["message"]
            chunk(
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
                **({"prompt_token_ids": c.prompt_ids} if i == 0 else {}),
            )
            calls = msg.get("tool_calls") or []
            tokens = {"logprobs": ch["logprobs"], "token_ids": ids}
            if msg["content"] or not calls:  # the text, with the sampled ids (and log-probs when asked)
                chunk({"index": i, "delta": {"content": msg["content"] or ""}, "finish_reason": None, **tokens})
                tokens = {"logprobs": None}
            for k, tc in enumerate(calls):
                chunk(
                    {"index": i, "delta": {"tool_calls": [{"index": k, **tc}]}, "logprobs": None, "finish_reason": None}
                )
            chunk({"index": i, "delta": {}, "finish_reason": ch["finish_reason"], **tokens})
        if c.include_usage:
            out.append((None, {**head, "choices": [], "usage": resp["usage"]}))
        out.append((None, "[DONE]"))
        return out


# ---- the HTTP side ----------------------------------------------------------------------------

_ROUTES = {"chat/completions": "chat", "completions": "completions", "responses": "responses"}


def _closing(status: int, code: str, message: str) -> EndpointError:
    """An error about the request's framing: answered, then the connection is closed."""
    return EndpointError(status, code, message, close=True)


def _sampling_args(body: dict, kind: str, cap: int) -> tuple[int, int, list[str]]:
    """A request's ``n``, ``max_tokens`` (``cap`` when absent) and ``stop``, checked: 400 otherwise."""
    n = 1 if body.get("n") is None or kind == "responses" else body["n"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise EndpointError(400, "invalid_n", f"'n' must be an integer from 1 to {MAX_N}, got {n!r}")
    max_tokens = (
        body.get("max_output_tokens")
        if kind == "responses"
        else body.get("max_completion_tokens", body.get("max_tokens"))
    ) or cap
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise EndpointError(400, "invalid_max_tokens", f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    stop = (body.get("stop") if kind != "responses" else None) or []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(x, str) and x for x in stop)) or len(stop) > 8:
        raise EndpointError(400, "invalid_stop", "'stop' must be a string or a list of at most 8 strings")
    return n, max_tokens, stop


def _check_size(body: dict, max_chars: int) -> None:
    """400 for a request too big to tokenise in good time: nested deeper than ``MAX_DEPTH``, more than
    ``MAX_ITEMS`` list items and object keys, or more than ``max_chars`` characters of text (a prompt
    of megabytes would hold the server's one thread, and every other session's calls, for minutes)."""
    chars = items = 0
    stack = [(body, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            chars += len(value)
            if chars > max_chars:
                raise EndpointError(
                    400,
                    "prompt_too_long",
                    f"the request holds more than {max_chars:,} characters of "
                    f"text (16 a token of the model's context, at least "
                    f"{MIN_PROMPT_CHARS:,})",
                )
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_DEPTH:
            raise EndpointError(400, "too_deep", f"the request nests deeper than {MAX_DEPTH} levels")
        items += len(value)
        if items > MAX_ITEMS:
            raise EndpointError(
                400,
                "too_many_items",
                f"the request holds more than {MAX_ITEMS:,} messages, parts, keys and list items in all",
            )
        if isinstance(value, dict):
            chars += sum(len(k) for k in value if isinstance(k, str))
            stack.extend((v, depth + 1) for v in value.values())
        else:
            stack.extend((v, depth + 1) for v in value)


def _route(path: str) -> tuple[str, str]:
    parts = path.strip("/").split("/")
    if len(parts) < 3 or parts[0] != "s" or parts[2] != "v1":
        raise EndpointError(
            404, "not_found", f"unknown path {path[:80]!r}; use the base URL the rollout was given (.../s/<session>/v1)"
        )
    return parts[1], "/".join(parts[3:])


class _App:
    """The ASGI application of an endpoint (served by :class:`asyncrl.endpoint.server.Server`)."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint
        timeout = endpoint.request_timeout_s
        self.deadlines = None if timeout is None else _Deadlines(timeout)  # (the server's one loop only)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        ep, session = self.endpoint, None
        try:
            token, route = _route(scope["path"])
            if scope["method"] == "GET":
                ep.session(token)
                if route != "models":
                    raise EndpointError(404, "not_found", f"GET {route!r}: only /v1/models is served by GET")
                return await send_json(
                    send,
                    200,
                    {"object": "list", "data": [{"id": ep.model_name, "object": "model", "owned_by": "asyncrl"}]},
                )
            if scope["method"] != "POST":
                raise EndpointError(405, "method_not_allowed", f"{scope['method']} is not served; use POST or GET")
            raw = await read_body(scope, receive, _closing, MAX_BODY_BYTES, READ_TIMEOUT_S)
            kind = _ROUTES.get(route)
            if kind is None:
                raise EndpointError(
                    404,
                    "not_found",
                    f"POST {route!r}: served are /v1/chat/completions, /v1/completions and /v1/responses",
                )
            session = ep.session(token)
            body = decode_json(raw, EndpointError)
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            call = ep.submit(session, body, kind, (loop, done))
            if self.deadlines is not None:
                self.deadlines.add(loop, done)
            try:
                await done
            except TimeoutError:
                raise EndpointError(
                    408,
                    "timeout",
                    f"no completion within {ep.request_timeout_s:g} s (env.kwargs.request_timeout_s)",
                    "server_error",
                ) from None
            if call.error is not None:
                raise call.error
            if call.stream:
                await send_events(send, ep.stream(call))
            else:
                await send_json(send, 200, ep.response(call))
        except EndpointError as e:
            if session is not None:
                with session.lock:
                    session.rejected.append(f"{e.code}: {e}")
            await send_json(send, e.status, e.body(), close=e.close)
        except Exception as e:  # noqa: BLE001 - never a crash: an internal error is a 500 answer
            await send_json(
                send,
                500,
                EndpointError(500, "internal_error", f"{type(e).__name__}: {str(e)[:300]}", "server_error").body(),
            )
