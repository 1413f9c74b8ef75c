"""Turning tasks into trajectories: the multi-turn conversation loop every workflow builds on.

Token ids are accumulated turn by turn rather than re-tokenising the transcript, so the learner
trains on exactly the tokens the engine sampled. Generated tokens get ``loss_mask = 1`` and their
behaviour log-probs; prompt tokens and environment turns get 0.
Prompts are rendered by ``asyncrl.prompts`` (chat template or plain text).
Each token also records the policy version that generated it (-1 for tokens it did not generate), so
that a row made across an in-flight weight update carries per-token versions (``types.row_versions``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..engine.base import token_versions
from ..envs.base import Environment
from ..envs.guard import EnvFailure
from ..prompts import delta_tokens, render_tokens
from ..types import Task, Trajectory, new_id, row_versions


@dataclass
class Conversation:
    """One conversation in progress (one future trajectory)."""

    task: Task
    history: list[dict[str, str]]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    group_id: str
    sample_type: str = "policy"
    done: bool = False
    turns: int = 0
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    failure: str | None = None  # the environment failed on it (asyncrl.envs.guard): not trained on
    scores: dict[str, float] | None = None  # set by an environment that scores while it drives (env.type=agent)
    extra_rows: list = field(default_factory=list)  # more trajectories of this rollout (an agent's unmerged calls)
    versions: list[int] = field(default_factory=list)  # per token: the policy version that generated it, -1 if none
    routing: Any = None  # int16 [tokens, width]: the latest turn's recorded experts (routing replay), or None

    def to_trajectory(
        self, version: int, scores: dict[str, float], metadata: dict[str, Any] | None = None, rollout_id: str = ""
    ) -> Trajectory:
        traj = _trajectory(
            self,
            (self.token_ids, self.loss_mask, self.logprobs, self.texts, self.finish_reasons, self.turns, self.versions),
            version,
            scores,
            metadata,
            rollout_id,
        )
        if self.routing is not None:  # tokens after the last call (an environment's closing turn): none recorded
            n, r = len(self.token_ids), self.routing[: len(self.token_ids)]
            traj.routing = np.concatenate([r, np.full((n - len(r), r.shape[1]), -1, np.int16)])
        return traj

    def trajectories(self, version: int, scores: dict[str, float]) -> list[Trajectory]:
        """The conversation's trajectory, then those of ``extra_rows`` (same scores and group). Rows of
        one rollout share a ``rollout_id``, so that its group's baseline counts the rollout once."""
        if not self.extra_rows:
            return [self.to_trajectory(version, scores)]
        rid = new_id()
        return [self.to_trajectory(version, scores, rollout_id=rid)] + [
            _trajectory(self, row, version, scores, None, rid) for row in self.extra_rows
        ]


def _trajectory(
    conv: Conversation,
    row: tuple,
    version: int,
    scores: dict[str, float],
    metadata: dict[str, Any] | None,
    rollout_id: str = "",
) -> Trajectory:
    ids, mask, logprobs, texts, reasons, turns, versions = row
    if len(versions) != len(ids):  # no per-token versions recorded: all the rollout's version
        versions = [-1] * len(ids)
    policy_version, per_token = row_versions(versions, mask, version)
    return Trajectory(
        token_ids=np.asarray(ids, dtype=np.int32),
        loss_mask=np.asarray(mask, dtype=np.uint8),
        behavior_logprobs=np.asarray(logprobs, dtype=np.float32),
        policy_version=policy_version,
        token_versions=per_token,
        reward=float(scores.get("reward", 0.0)),
        scores=dict(scores),
        sample_type=conv.sample_type,
        group_id=conv.group_id,
        task_id=conv.task.id,
        rollout_id=rollout_id,
        text=texts[-1] if len(texts) == 1 else "\n".join(texts),
        metadata={"turns": turns, "finish_reasons": reasons, **(metadata or {})},
    )


def start_conversations(
    tokenizer, env: Environment, tasks: list[Task], n: int, group_ids: list[str], sample_type: str = "policy"
) -> list[Conversation]:
    convs = []
    for task, gid in zip(tasks, group_ids):
        try:
            history, failure = env.reset(task), None
        except EnvFailure as e:  # recorded on the conversations, which are then not generated
            history, failure = [dict(m) for m in task.prompt], str(e)
        ids = render_tokens(tokenizer, history)
        for _ in range(n):
            convs.append(
                Conversation(
                    task=task,
                    history=[dict(m) for m in history],
                    token_ids=list(ids),
                    loss_mask=[0] * len(ids),
                    logprobs=[0.0] * len(ids),
                    versions=[-1] * len(ids),
                    group_id=gid,
                    sample_type=sample_type,
                    done=failure is not None,
                    failure=failure,
                )
            )
    return convs


def run_conversations(
    engine, tokenizer, env: Environment, convs: list[Conversation], sampling, max_turns: int, seed: int | None = None
) -> list[Conversation]:
    """Advance every conversation until the environment says done or ``max_turns`` is reached.
    Each turn is one batched engine call over the conversations still active. An environment that
    drives its own generation (``env.type=agent``: ``drive``) runs them its way instead."""
    if getattr(env, "drives_generation", False):
        return env.drive(engine, tokenizer, convs, sampling, seed, guard=env)
    eos = tokenizer.eos_token_id
    for turn in range(max_turns):
        active = [c for c in convs if not c.done]
        if not active:
            break
        gens = engine.generate([c.token_ids for c in active], sampling, seed=None if seed is None else seed + turn)
        for conv, gen in zip(active, gens):
            conv.token_ids += gen.token_ids.tolist()
            conv.loss_mask += [1] * len(gen.token_ids)
            conv.logprobs += gen.logprobs.tolist()
            conv.versions += token_versions(gen, engine.version)
            if gen.routing is not None:  # the latest call read the whole conversation: its routes cover it
                conv.routing = gen.routing
            conv.texts.append(gen.text)
            conv.finish_reasons.append(gen.finish_reason)
            conv.history.append({"role": "assistant", "content": gen.text})
            conv.turns += 1
            try:
                result = env.step(conv.task, conv.history, gen.text)
            except EnvFailure as e:
                conv.failure, conv.done = str(e), True
                continue
            if result.done or turn == max_turns - 1:
                conv.done = True
                continue
            if eos is not None and (len(gen.token_ids) == 0 or gen.token_ids[-1] != eos):
                conv.token_ids.append(eos)  # close a length-truncated turn before the next message
                conv.loss_mask.append(0)
                conv.logprobs.append(0.0)
                conv.versions.append(-1)
            extra = delta_tokens(tokenizer, conv.history, result.messages)
            conv.history.extend(result.messages)
            conv.token_ids += extra
            conv.loss_mask += [0] * len(extra)
            conv.logprobs += [0.0] * len(extra)
            conv.versions += [-1] * len(extra)
    return convs


def scored_trajectories(convs: list, env, version: int) -> tuple[list, list[str]]:
    """Trajectories of the conversations the environment scored, and the failure messages of the
    others (a failed reset, step or evaluate: ``asyncrl.envs.guard``); failed ones are not trained on."""
    trajs, failures = [], []
    for c in convs:
        if c.failure is None:
            try:
                trajs += c.trajectories(version, c.scores if c.scores is not None else env.evaluate(c.task, c.history))
                continue
            except EnvFailure as e:
                c.failure = str(e)
        failures.append(c.failure)
    return trajs, failures


def failure_record(failures: list[str], version: int) -> dict:
    """The ``decision`` fields for an episode with failed conversations (none: ``{}``). An episode
    whose conversations all failed keeps its policy version here (it has no trajectories)."""
    if not failures:
        return {}
    return {"failures": failures[:8], "num_failures": len(failures), "policy_version": version}


def episode_metrics(rewards: list[float], failures: int) -> dict[str, float]:
    out = {"env/failures": float(failures)}
    if rewards:
        out["reward_mean"] = sum(rewards) / len(rewards)
    return out
