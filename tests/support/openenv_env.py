"""An OpenEnv (openenv-core) environment for tests/unit/envs/test_bring_envs.py: one addition per episode,
served over HTTP/WebSocket by OpenEnv's own server (``create_app`` + uvicorn), without Docker.

    python -m tests.support.openenv_env PORT     # serves on 127.0.0.1:PORT
"""

from __future__ import annotations

import random
import sys
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class AddAction(Action):
    answer: str = Field(..., description="The model's answer")


class AddObservation(Observation):
    question: str = Field(default="", description="The addition to solve")
    feedback: str = Field(default="", description="right or wrong")


class AddEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.a = self.b = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **_) -> AddObservation:
        rng = random.Random(seed)
        self.a, self.b = rng.randint(0, 9), rng.randint(0, 9)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return AddObservation(question=f"{self.a}+{self.b}=", done=False, reward=0.0)

    def step(self, action: AddAction, **_) -> AddObservation:  # type: ignore[override]
        self._state.step_count += 1
        right = action.answer.strip() == str(self.a + self.b)
        # a wrong answer costs its length (so tests can tell the server's reward from any other)
        return AddObservation(
            question=f"{self.a}+{self.b}=",
            feedback="right" if right else "wrong",
            done=True,
            reward=1.0 if right else -len(action.answer.strip()) / 100,
        )

    @property
    def state(self) -> State:
        return self._state


app = create_app(AddEnvironment, AddAction, AddObservation, env_name="add", max_concurrent_envs=64)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
