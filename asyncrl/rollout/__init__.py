"""Turning tasks into episodes on an actor: the conversation loop and the workflows."""

from .conversation import Conversation, run_conversations, scored_trajectories, start_conversations
from .workflow import RolloutContext, Workflow, get_workflow, register_workflow, workflow_class

__all__ = [
    "Conversation",
    "RolloutContext",
    "Workflow",
    "get_workflow",
    "register_workflow",
    "run_conversations",
    "scored_trajectories",
    "start_conversations",
    "workflow_class",
]
