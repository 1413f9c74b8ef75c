"""Held-out evaluation on the learner: accuracy (mean reward) on a fixed task list, run at the start,
every ``eval.every`` steps and at the end, with the learner's current weights.

A workflow may define ``evaluate(engine, tokenizer, env, tasks, sampling, cfg) -> dict`` to report
its own figures (RLCR: calibration); numbers go to metrics as ``eval/<name>``, the whole dict
(lists included, e.g. reliability-diagram bins) to the ``eval`` event."""

from __future__ import annotations

import time

from ..config import SamplingConfig
from ..engine.hf import HFEngine
from ..envs.base import make_env
from ..envs.tasks import eval_tasks
from ..objectives.advantages import one_per_rollout
from ..rollout.conversation import run_conversations, scored_trajectories, start_conversations
from ..rollout.workflow import get_workflow
from ..types import prompt_text


class EvaluationHung(RuntimeError):
    """Every call of an evaluation timed out: the reward (or environment) hangs; ``str`` is one line."""


GREEDY_TEMPERATURE = 1e-4  # softmax(logits / 1e-4) puts all mass on the argmax


def _hung_methods(env, before: dict, at_least: int) -> list[tuple[str, int]]:
    """The methods with at least ``at_least`` calls since ``before``, every one timed out."""
    out = []
    for method, (calls, timeouts) in env.by_method.items():
        c0, t0 = before.get(method, (0, 0))
        if calls - c0 >= at_least and timeouts - t0 == calls - c0:
            out.append((method, calls - c0))
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` are correct (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code"): ``1 - C(n - c, k) / C(n, k)``, computed as a
    product so that large ``n`` does not overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_ks(k: int) -> list[int]:
    """The j of pass@j reported for ``k`` samples: 1, 2, 4, ... below k, and k."""
    out, j = [], 1
    while j < k:
        out.append(j)
        j *= 2
    return out + [k]


def sample_scores(correct: list[int], k: int) -> dict[str, float]:
    """``pass@j`` (:func:`pass_ks`) and ``avg@k`` over problems with ``correct[i]`` of ``k`` samples right."""
    out = {f"pass@{j}": sum(pass_at_k(k, c, j) for c in correct) / len(correct) for j in pass_ks(k)}
    out[f"avg@{k}"] = sum(correct) / (k * len(correct))
    return out


class Evaluator:
    def __init__(self, cfg, tokenizer):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.env = make_env(cfg.env, stop_on_failures=False)  # evaluation records failures, never stops
        n = min(cfg.eval.size, cfg.tasks.eval_size)
        self.tasks = eval_tasks(cfg.tasks)[:n] if n else []
        temp = cfg.eval.temperature or GREEDY_TEMPERATURE
        self.sampling = SamplingConfig(
            n=1, temperature=temp, top_p=1.0, max_new_tokens=cfg.sampling.max_new_tokens, stop=cfg.sampling.stop
        )
        self.workflow = get_workflow(cfg.algorithm, cfg)
        self.history: list[dict] = []
        self._last = None

    def due(self, version: int) -> bool:
        """At the start, then at each multiple of ``eval.every`` (so a resumed run keeps the schedule)."""
        every = self.cfg.eval.every
        return self._last is None or (every > 0 and version // every > self._last // every)

    def resumed(self, history: list[dict]) -> None:
        """A resumed run: its evaluations so far (the summary compares from the first), the schedule
        going on from the last (no new baseline at the resume point)."""
        self.history = history
        versions = [int(e.get("version") or 0) for e in history]
        self._last = max(versions) if versions else None

    def maybe_run(self, model, version: int, force: bool = False, tick=None) -> dict:
        """Evaluate if due. ``tick()`` runs while environment calls are awaited (the learner's loop
        keeps answering); the calls are bounded by ``eval.timeout_s`` in all. Raises EvaluationHung
        when every call timed out (or the first ``eval.hung_after`` did)."""
        if not self.tasks or not (force or self.due(version)) or self._last == version:
            return {}
        t0 = time.time()
        engine = HFEngine(model, self.tokenizer, device=str(next(model.parameters()).device))
        engine.on_step = tick  # a long generation (a real model's 200 held-out prompts) does not silence the learner
        env = self.env
        before = {m: list(c) for m, c in env.by_method.items()}
        timeouts0 = env.timeouts
        env.tick, env.deadline = self._watch(tick, before), time.monotonic() + self.cfg.eval.timeout_s
        try:
            custom = self.workflow.evaluate(engine, self.tokenizer, env, self.tasks, self.sampling, self.cfg)
            result = dict(custom) if custom is not None else self._accuracy(engine)
        finally:
            env.tick, env.deadline = None, None
            model.train()
        hung = _hung_methods(env, before, 1)
        if hung:
            method, calls = hung[0]
            raise EvaluationHung(
                f"every one of the {calls} {method} calls of the held-out evaluation at version "
                f"{version} timed out (env.call_timeout_s={self.cfg.env.call_timeout_s}, "
                f"eval.timeout_s={self.cfg.eval.timeout_s:g}): {env.name} hangs; last: {env.last_error}"
            )
        timeouts = env.timeouts - timeouts0
        if timeouts:
            result["timeouts"] = timeouts
        result.update(version=version, greedy=not self.cfg.eval.temperature, eval_s=time.time() - t0)
        self.history.append(result)
        self._last = version
        return result

    def _watch(self, tick, before: dict):
        """The tick the guarded calls run: the caller's, plus giving up the evaluation (its budget
        set to now) once the first ``eval.hung_after`` calls of a method (reset, step, evaluate) have
        all timed out."""
        env, hung_after = self.env, self.cfg.eval.hung_after

        def watch():
            if tick is not None:
                tick()
            if env.deadline is not None and _hung_methods(env, before, hung_after):
                env.deadline = time.monotonic()  # the rest fail at once

        return watch

    def _accuracy(self, engine) -> dict:
        convs = start_conversations(self.tokenizer, self.env, self.tasks, 1, group_ids=[t.id for t in self.tasks])
        run_conversations(
            engine, self.tokenizer, self.env, convs, self.sampling, self.cfg.env.max_turns, seed=self.cfg.seed
        )
        trajs, failures = scored_trajectories(convs, self.env, 0)
        trajs = one_per_rollout(trajs)  # an agent's unmerged calls are one answer
        rewards = [t.reward for t in trajs] + [0.0] * len(failures)  # a failed reward counts as wrong
        out = {
            "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "reward_mean": sum(rewards) / len(rewards),
            "size": len(rewards),
            "failures": len(failures),
        }
        tasks = {t.id: t for t in self.tasks}
        out["samples"] = [
            {
                "task_id": t.group_id,
                "prompt": prompt_text(tasks[t.group_id].prompt),
                "answer": tasks[t.group_id].answer,
                "completion": t.text,
                "reward": t.reward,
                "correct": t.reward >= 1.0,
            }
            for t in trajs[: self.cfg.log.eval_samples]
            if t.group_id in tasks
        ]
        if failures:
            out["failure_examples"] = failures[:3]
        if self.cfg.eval.k:
            out.update(self._pass_at_k(engine))
        return out

    def _pass_at_k(self, engine) -> dict:
        """pass@j and avg@k over ``eval.k`` samples per held-out problem at the run's sampling settings."""
        k, s = self.cfg.eval.k, self.cfg.sampling
        sampling = SamplingConfig(
            n=k, temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens, stop=s.stop
        )
        convs = start_conversations(self.tokenizer, self.env, self.tasks, k, group_ids=[t.id for t in self.tasks])
        run_conversations(
            engine, self.tokenizer, self.env, convs, sampling, self.cfg.env.max_turns, seed=self.cfg.seed + 1
        )
        trajs, failures = scored_trajectories(convs, self.env, 0)
        trajs = one_per_rollout(trajs)  # an agent's unmerged calls are one answer
        correct = {t.id: 0 for t in self.tasks}  # a failed reward counts as wrong
        for t in trajs:
            correct[t.group_id] += t.reward >= 1.0
        return sample_scores(list(correct.values()), k)
