from .base import Environment, SingleTurnEnv, StepResult, get_reward_fn, make_env
from .tasks import eval_tasks, load_task_file, task_stream

__all__ = [
    "Environment",
    "SingleTurnEnv",
    "StepResult",
    "eval_tasks",
    "get_reward_fn",
    "load_task_file",
    "make_env",
    "task_stream",
]
