"""Plugins loaded by import path in tests (the same way users plug in their own)."""

import contextlib

from asyncrl.types import Task


def short_reply_reward(task: Task, response: str) -> float:
    """A reward with variance even for an untrained model: 1 for replies of at most 3 characters."""
    return 1.0 if len(response) <= 3 else 0.0


def _call_number(task: Task, response: str) -> int:
    """A stable pseudo-random number per (task, response), so that misbehaviour is spread evenly."""
    import zlib

    return zlib.crc32(f"{task.id}|{response}".encode()) % 10


def flaky_reward(task: Task, response: str):
    """Misbehaves on about 3 calls in 10: raises, returns NaN, returns a string; else short_reply_reward."""
    k = _call_number(task, response)
    if k == 0:
        raise RuntimeError("flaky reward failed")
    if k == 1:
        return float("nan")
    if k == 2:
        return "1.0"
    return short_reply_reward(task, response)


def broken_reward(task: Task, response: str) -> float:
    raise KeyError("answer")


def hanging_reward(task: Task, response: str) -> float:
    """Never returns (a reward that waits on a dead service)."""
    import threading

    threading.Event().wait()
    return 0.0


def half_constant_reward(task: Task, response: str) -> float:
    """0.5 whatever the reply for about half of the tasks (their groups carry no signal), else
    ``short_reply_reward``: dynamic sampling has groups to drop and groups to keep."""
    import zlib

    return 0.5 if zlib.crc32(task.id.encode()) % 2 == 0 else short_reply_reward(task, response)


def constant_reward(task: Task, response: str) -> float:
    return 0.5


def slow_hf_engine(cfg, model_dir, tokenizer, load_model):
    """``engine.type: tests.support.plugins:slow_hf_engine``: the real HF engine on a model whose every
    forward pass first waits ``ASYNCRL_TEST_STEP_S`` seconds, so that a batch takes minutes of wall time
    while its tokens come one step at a time (what a real model on a CPU, or a reasoning run, looks like
    to the learner)."""
    import os
    import time

    from asyncrl.engine.hf import HFEngine

    model = load_model()
    delay = float(os.environ.get("ASYNCRL_TEST_STEP_S", "1.0"))
    forward = model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(delay)
        return forward(*args, **kwargs)

    model.forward = slow_forward
    return HFEngine(model, tokenizer, device=cfg.engine.device)


def slow_ppo_loss(inputs, cfg):
    """``train.policy_loss: tests.support.plugins:slow_ppo_loss``: PPO's loss after waiting
    ``ASYNCRL_TEST_LOSS_S`` seconds per micro-batch, so that a learner step takes as long as a real
    model's (a stop then arrives in the middle of one)."""
    import os
    import time

    from asyncrl.objectives.losses import POLICY_LOSSES

    time.sleep(float(os.environ.get("ASYNCRL_TEST_LOSS_S", "1.0")))
    return POLICY_LOSSES.get("ppo")(inputs, cfg)


@contextlib.contextmanager
def cpu_varlen():
    """``train.attention=varlen`` on a CPU. torch's varlen kernel is CUDA-only, so its reference (the same
    sequences, one SDPA call each: ``attention.reference_varlen``) stands in for the kernel alone; the
    flat bin, the cumulative sequence lengths, the registered attention function and the switch of the
    model's attention implementation are the real code."""
    from asyncrl.learner.training import attention

    kernel, available = attention.VARLEN_KERNEL, attention.available

    def allow(path, model, device, training=True):
        return None if path == "varlen" else available(path, model, device, training)

    attention.VARLEN_KERNEL, attention.available = attention.reference_varlen, allow
    try:
        yield
    finally:
        attention.VARLEN_KERNEL, attention.available = kernel, available
