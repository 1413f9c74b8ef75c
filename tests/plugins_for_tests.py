"""Plugins loaded by import path in tests (the same way users plug in their own)."""

from asyncrl.types import Task


def short_reply_reward(task: Task, response: str) -> float:
    """A reward with variance even for an untrained model: 1 for replies of at most 3 characters."""
    return 1.0 if len(response) <= 3 else 0.0
