"""A worked example of plugging your own environment, reward and tasks into asyncrl.

Run it with the embedded model:

    asyncrl run -c configs/quickstart.yaml name=countdown \
        tasks.type=file tasks.path=examples/countdown_tasks.jsonl \
        env.type=examples.countdown:RetryEnv env.reward=examples.countdown:reward env.max_turns=2

- ``reward(task, response)`` scores one reply (a float, or a dict of named scores with ``reward``).
- ``RetryEnv`` is multi-turn: a wrong first answer gets a hint and a second try. Only the
  assistant's tokens are learned from; the hint turn has loss mask 0.
"""

from __future__ import annotations

from asyncrl.envs.base import StepResult, get_reward_fn, scores_from
from asyncrl.types import Task


def reward(task: Task, response: str) -> dict:
    text = response.strip()
    correct = text == str(task.answer)
    return {"reward": 1.0 if correct else 0.0, "format": 1.0 if text.lstrip("-").isdigit() else 0.0}


class RetryEnv:
    """Two turns at most: a wrong first answer gets the hint 'try again' and one more attempt."""

    def __init__(self, reward: str = "examples.countdown:reward", max_turns: int = 2, **_):
        self.reward_fn = get_reward_fn(reward)
        self.max_turns = max_turns

    def reset(self, task: Task) -> list[dict]:
        return [dict(m) for m in task.prompt]

    def step(self, task: Task, history: list[dict], response: str) -> StepResult:
        if scores_from(self.reward_fn(task, response))["reward"] >= 1.0:
            return StepResult(done=True)
        return StepResult(messages=[{"role": "user", "content": "try again"}], done=False)

    def evaluate(self, task: Task, history: list[dict]) -> dict[str, float]:
        replies = [m["content"] for m in history if m["role"] == "assistant"]
        scores = scores_from(self.reward_fn(task, replies[-1] if replies else ""))
        scores["turns"] = float(len(replies))
        return scores
