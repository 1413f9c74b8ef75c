"""An OpenEnv (openenv-core) environment and the agent that plays it, for ``asyncrl run -c
examples/openenv.yaml``. The environment is served by OpenEnv's own server (``create_app`` +
uvicorn) as a plain process, no Docker:

    .venv/bin/python -m examples.openenv_add 8011      # serves on 127.0.0.1:8011; leave it running

OpenEnv's server has no authentication of its own, so this one answers only under a secret path,
``http://127.0.0.1:8011/<token>`` (any other path is 404, a WebSocket is closed), and writes that URL
to ``runs/openenv.url`` (mode 0600): another user of the machine can reach the port but not the
environment.

The agent (``env.agent=examples.openenv_add:play``) opens a session with OpenEnv's client at
``$OPENENV_URL`` (default: the URL in ``runs/openenv.url``), resets it with the run's task (the quick
start's ``47+69=``, so the held-out split is asyncrl's), asks the policy once and steps with its reply;
the reward is the environment's: 1 for the right sum, 0 otherwise. Before a run starts, asyncrl's
preflight calls ``play.preflight()``, which says in one line when no server answers.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import re
import secrets
import signal
import sys
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

URL_FILE = Path("runs") / "openenv.url"
SERVER_SESSIONS = 128  # sessions the server holds at once
MAX_SESSIONS = 16  # sessions one process opens at once (the actor's rollouts; the learner's held-out evaluation)
TIMEOUT_S = 120.0  # to open a session, and for each reply (a busy machine answers late, not never)
_gates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its semaphore
_SUM = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*=\s*$")


class SumAction(Action):
    answer: str = Field(..., description="The model's answer")


class SumObservation(Observation):
    question: str = Field(default="", description="The addition to solve")
    feedback: str = Field(default="", description="right or wrong")


class SumEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.question, self.answer = "", ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, question: str = "", **_) -> SumObservation:
        m = _SUM.match(question or "")
        if m is None:
            raise ValueError(f"reset needs question='A+B=' with two whole numbers; got {question!r}")
        self.question, self.answer = question.strip(), str(int(m[1]) + int(m[2]))
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return SumObservation(question=self.question, done=False, reward=0.0)

    def step(self, action: SumAction, **_) -> SumObservation:  # type: ignore[override]
        self._state.step_count += 1
        right = action.answer.strip() == self.answer
        return SumObservation(
            question=self.question, feedback="right" if right else "wrong", done=True, reward=1.0 if right else 0.0
        )

    @property
    def state(self) -> State:
        return self._state


app = create_app(SumEnvironment, SumAction, SumObservation, env_name="sum", max_concurrent_envs=SERVER_SESSIONS)


class SecretPath:
    """ASGI: serve ``app`` under ``/<token>`` only (the path is the credential); anything else is
    404, or a closed WebSocket."""

    def __init__(self, app, token: str):
        self.app, self.prefix = app, "/" + token

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            path = scope.get("path", "")
            n = len(self.prefix)
            if not (hmac.compare_digest(path[:n], self.prefix) and path[n : n + 1] in ("", "/")):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                else:
                    await send(
                        {"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]}
                    )
                    await send({"type": "http.response.body", "body": b"not found"})
                return
            scope = dict(scope, path=path[n:] or "/", root_path=scope.get("root_path", "") + self.prefix)
        try:
            await self.app(scope, receive, send)
        except Exception as e:  # noqa: BLE001
            # the client closed its session first; OpenEnv's endpoint (openenv-core 0.3) then fails to close
            # it again, a traceback per session in the server's log: nothing is wrong, nothing to say
            if scope["type"] == "websocket" and type(e).__name__ in ("WebSocketDisconnect", "ClientDisconnected"):
                return
            raise


def server_url() -> str:
    """``$OPENENV_URL``, else the URL the server wrote to ``runs/openenv.url``."""
    url = os.environ.get("OPENENV_URL")
    if url is None:
        try:
            url = URL_FILE.read_text().strip()
        except FileNotFoundError:
            raise RuntimeError(
                f"no OpenEnv server: {URL_FILE} does not exist and OPENENV_URL is not set; start "
                f"it first: .venv/bin/python -m examples.openenv_add 8011"
            ) from None
    return url.rstrip("/")


def _gate() -> asyncio.Semaphore:
    """This event loop's bound on open sessions: a held-out evaluation starts every task's agent at
    once, and a server past its sessions refuses the rest (each a failed, so wrong, answer)."""
    loop = asyncio.get_running_loop()
    gate = _gates.get(loop)
    if gate is None:
        gate = _gates[loop] = asyncio.Semaphore(MAX_SESSIONS)
    return gate


async def play(task, client, model):
    """One episode: reset with the task's question, one policy reply as the action, the env's reward."""
    from openenv.core.generic_client import GenericEnvClient

    async with (
        _gate(),
        GenericEnvClient(base_url=server_url(), connect_timeout_s=TIMEOUT_S, message_timeout_s=TIMEOUT_S) as env,
    ):
        obs = (await env.reset(question=task.prompt[-1]["content"])).observation
        messages = [{"role": "user", "content": obs["question"]}]
        reply = await client.chat.completions.create(model=model, messages=messages)
        result = await env.step({"answer": reply.choices[0].message.content or ""})
        return {"reward": float(result.reward or 0.0), "openenv/right": float(result.reward == 1.0)}


def _preflight() -> None:
    """Raise, in one line, when no OpenEnv server answers at ``$OPENENV_URL``."""
    url = server_url()
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=60) as r:  # (a busy machine answers late)
            r.read()
    except (urllib.error.URLError, OSError) as e:
        where = url.split("://", 1)[-1].split("/", 1)[0]
        raise RuntimeError(
            f"no OpenEnv server answers at {where} ({getattr(e, 'reason', e)}); start it first: "
            f".venv/bin/python -m examples.openenv_add {where.rsplit(':', 1)[-1]}"
        ) from None


play.preflight = _preflight

if __name__ == "__main__":
    import uvicorn

    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        raise SystemExit("usage: python -m examples.openenv_add PORT   (serves on 127.0.0.1:PORT)")
    port, token = int(sys.argv[1]), secrets.token_urlsafe(24)
    URL_FILE.parent.mkdir(exist_ok=True)
    URL_FILE.unlink(missing_ok=True)
    fd = os.open(URL_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"http://127.0.0.1:{port}/{token}\n")
    print(f"OpenEnv server 'sum' on 127.0.0.1:{port}, under a secret path written to {URL_FILE}", flush=True)

    def _stopped(*_):  # (uvicorn, stopped by SIGTERM, raises it again once shut down: this handler)
        URL_FILE.unlink(missing_ok=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, _stopped)
    try:
        uvicorn.run(SecretPath(app, token), host="127.0.0.1", port=port, log_level="warning")
    finally:
        URL_FILE.unlink(missing_ok=True)
