from .base import (Environment, SingleTurnEnv, StepResult, eval_tasks, get_reward_fn, load_task_file,
                   make_env, task_stream)

__all__ = ["Environment", "SingleTurnEnv", "StepResult", "eval_tasks", "get_reward_fn", "load_task_file",
           "make_env", "task_stream"]
