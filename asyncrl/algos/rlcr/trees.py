"""Answer -> confidence trees: growing them with the engine, scoring, two-level advantages, rows, records."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...engine.base import Generation
from ...envs.answer_checks import verify
from ...objectives.advantages import ADV_ESTIMATORS
from ...prompts import delta_tokens, render_tokens
from ...types import Task, Trajectory, row_versions
from .config import RLCRConfig
from .parsing import Parsed, brier_reward, parse_answer, parse_confidence, span_mask


# --------------------------------------------------------------------------------------- trees
@dataclass
class ConfidenceNode:
    gen: Generation  # turn 2: confidence_ids[j, k, h] = gen.token_ids
    parsed: Parsed
    mask: np.ndarray  # uint8 [L] over gen.token_ids
    reward: float = 0.0
    advantage: float = 0.0


@dataclass
class AnswerNode:
    gen: Generation  # turn 1: answer_ids[j, k] = gen.token_ids
    parsed: Parsed
    mask: np.ndarray  # uint8 [L] over gen.token_ids
    context_ids: list[int]  # turn-2 prompt: prompt + answer (+ EOS) + user turn + assistant header
    reward: float = 0.0  # acc_reward
    advantage: float = 0.0
    confidences: list[ConfidenceNode] = field(default_factory=list)


@dataclass
class ConfidenceTree:
    """prompt -> G_a answers -> G_a x G_c confidences for one task."""

    task: Task
    prompt_ids: list[int]
    answers: list[AnswerNode]

    @property
    def answer_ids(self) -> list[list[int]]:
        """``answer_ids[k]``: generated tokens of answer ``k``."""
        return [a.gen.token_ids.tolist() for a in self.answers]

    @property
    def confidence_ids(self) -> list[list[list[int]]]:
        """``confidence_ids[k][h]``: generated tokens of confidence ``h`` about answer ``k``."""
        return [[c.gen.token_ids.tolist() for c in a.confidences] for a in self.answers]

    def acc_rewards(self) -> np.ndarray:
        """``[G_a]``."""
        return np.array([a.reward for a in self.answers], dtype=np.float64)

    def conf_rewards(self) -> np.ndarray:
        """``[G_a, G_c]``."""
        return np.array([[c.reward for c in a.confidences] for a in self.answers], dtype=np.float64)


def _eos_ids(engine, tokenizer) -> set[int]:
    ids = getattr(engine, "eos_ids", None)
    return set(ids) if ids else {int(tokenizer.eos_token_id)}


def opening_messages(env, task: Task, system_prompt: str | None) -> list[dict[str, str]]:
    history = env.reset(task)
    if system_prompt and (not history or history[0].get("role") != "system"):
        history = [{"role": "system", "content": system_prompt}, *history]
    return history


def _answer_node(
    tokenizer,
    gen: Generation,
    history: list[dict[str, str]],
    prompt: list[int],
    ask: list[dict[str, str]],
    eos: set[int],
) -> AnswerNode:
    """Parse and mask turn 1; its turn-2 prompt is the sampled tokens (closed with EOS if the turn was
    cut at the length limit) plus the template's tokens for the user turn and the next header."""
    parsed = parse_answer(gen.text)
    ids = gen.token_ids.tolist()
    closed = ids if ids and ids[-1] in eos else ids + [int(tokenizer.eos_token_id)]
    said = history + [{"role": "assistant", "content": gen.text}]
    return AnswerNode(
        gen,
        parsed,
        span_mask(tokenizer, gen, parsed.span, eos),
        context_ids=prompt + closed + delta_tokens(tokenizer, said, ask),
    )


def grow_trees(
    engine,
    tokenizer,
    env,
    tasks: list[Task],
    algo: RLCRConfig,
    sampling,
    seed: int | None,
    g_a: int | None = None,
    g_c: int | None = None,
) -> list[ConfidenceTree]:
    """Sample the trees of ``tasks`` (parsed and masked, not yet scored): one engine call for all
    G_a answers of all tasks, then one for all G_c confidences of all answers."""
    g_a = g_a or algo.num_generations_answer
    g_c = g_c or algo.num_generations_confidence
    eos = _eos_ids(engine, tokenizer)
    ans_sampling = sampling.model_copy(update={"max_new_tokens": algo.answer_max_new_tokens or sampling.max_new_tokens})
    conf_sampling = sampling.model_copy(
        update={"max_new_tokens": algo.confidence_max_new_tokens or sampling.max_new_tokens}
    )
    histories = [opening_messages(env, t, algo.system_prompt) for t in tasks]
    prompts = [render_tokens(tokenizer, h) for h in histories]
    gens = engine.generate([p for p in prompts for _ in range(g_a)], ans_sampling, seed=seed)
    ask = [{"role": "user", "content": algo.confidence_prompt}]
    trees = [
        ConfidenceTree(
            task,
            prompt,
            [_answer_node(tokenizer, gen, history, prompt, ask, eos) for gen in gens[j * g_a : (j + 1) * g_a]],
        )
        for j, (task, history, prompt) in enumerate(zip(tasks, histories, prompts))
    ]
    contexts = [a.context_ids for tree in trees for a in tree.answers for _ in range(g_c)]
    conf_gens = iter(engine.generate(contexts, conf_sampling, seed=None if seed is None else seed + 1))
    for tree in trees:
        for a in tree.answers:
            for _ in range(g_c):
                gen = next(conf_gens)
                parsed = parse_confidence(gen.text)
                a.confidences.append(ConfidenceNode(gen, parsed, span_mask(tokenizer, gen, parsed.span, eos)))
    return trees


def score_tree(tree: ConfidenceTree, verifier: str) -> None:
    """Set ``acc_reward`` on answers and the Brier ``conf_reward`` on their confidences."""
    for a in tree.answers:
        right = a.parsed.ok and verify(verifier, tree.task.answer, a.parsed.value, tree.task.metadata)
        a.reward = 1.0 if right else 0.0
        for c in a.confidences:
            c.reward = brier_reward(a.reward, c.parsed.value if c.parsed.ok else None)


def tree_advantages(
    acc: np.ndarray,
    conf: np.ndarray,
    norm_by_std: bool,
    lambda_ans: float = 1.0,
    lambda_conf: float = 1.0,
    std: str = "unbiased",
    estimator: str = "grpo",
) -> tuple[np.ndarray, np.ndarray]:
    """Decoupled advantages of one tree.

    Args:
        acc: ``[G_a]`` acc_reward of the answers (one group: the prompt).
        conf: ``[G_a, G_c]`` conf_reward; row ``k`` is the group of answer ``k``'s confidences.
        estimator: the ``ADV_ESTIMATORS`` entry (the run's ``train.advantage.estimator``) applied at
            both levels, each level on its own (a batch-level estimator sees one level's rewards).
    Returns:
        ``(adv_ans [G_a], adv_conf [G_a, G_c])``: with ``grpo``, ``R - mean``, divided by the group std +
        1e-6 when ``norm_by_std`` (``std``: "unbiased" or "population"), scaled by ``lambda_ans`` /
        ``lambda_conf``. Row ``k`` of ``adv_conf`` depends on row ``k`` of ``conf`` only (for the
        per-group estimators).
    """
    fn = ADV_ESTIMATORS.get(estimator)
    acc = np.asarray(acc, dtype=np.float64)
    conf = np.asarray(conf, dtype=np.float64).reshape(len(acc), -1)
    adv_ans = fn(torch.as_tensor(acc), ["prompt"] * len(acc), norm_by_std=norm_by_std, std=std)
    g_c = conf.shape[1]
    groups = [str(k) for k in range(len(acc)) for _ in range(g_c)]
    adv_conf = fn(torch.as_tensor(conf.reshape(-1)), groups, norm_by_std=norm_by_std, std=std)
    return lambda_ans * adv_ans.numpy(), lambda_conf * adv_conf.numpy().reshape(len(acc), g_c)


def assign_advantages(tree: ConfidenceTree, algo: RLCRConfig, estimator: str = "grpo") -> None:
    adv_ans, adv_conf = tree_advantages(
        tree.acc_rewards(),
        tree.conf_rewards(),
        algo.norm_by_std,
        algo.lambda_ans,
        algo.lambda_conf,
        algo.std,
        estimator,
    )
    for k, a in enumerate(tree.answers):
        a.advantage = float(adv_ans[k])
        for h, c in enumerate(a.confidences):
            c.advantage = float(adv_conf[k, h])


def _row(context: list[int], gen: Generation, mask: np.ndarray, version: int, **kw) -> Trajectory:
    """Trajectory ``context + gen``: loss mask and behaviour log-probs only on ``mask``."""
    pad = len(context)
    full_mask = np.concatenate([np.zeros(pad, dtype=np.uint8), mask])
    logprobs = np.concatenate([np.zeros(pad, dtype=np.float32), gen.logprobs * mask])
    versions = [-1] * pad + (gen.versions.tolist() if gen.versions is not None else [version] * len(mask))
    policy_version, per_token = row_versions(versions, full_mask, version)
    return Trajectory(
        token_ids=np.asarray(context + gen.token_ids.tolist(), dtype=np.int32),
        loss_mask=full_mask,
        behavior_logprobs=logprobs,
        policy_version=policy_version,
        token_versions=per_token,
        text=gen.text,
        **kw,
    )


def tree_trajectories(tree: ConfidenceTree, version: int, episode_id: str) -> list[Trajectory]:
    """G_a answer rows then G_a x G_c confidence rows (answer-major), advantages set."""
    answers, confidences = [], []
    tid = tree.task.id
    for k, a in enumerate(tree.answers):
        scores = {"reward": a.reward, "acc_reward": a.reward, "format_ok": float(a.parsed.ok)}
        answers.append(
            _row(
                tree.prompt_ids,
                a.gen,
                a.mask,
                version,
                reward=a.reward,
                scores=scores,
                sample_type="answer",
                group_id=episode_id,
                task_id=tid,
                advantage=a.advantage,
                metadata={"turns": 1, "rlcr": {"k": k}, "finish_reason": a.gen.finish_reason},
            )
        )
        for h, c in enumerate(a.confidences):
            scores = {
                "reward": c.reward,
                "conf_reward": c.reward,
                "acc_reward": a.reward,
                "format_ok": float(c.parsed.ok),
            }
            if c.parsed.ok:
                scores["confidence"] = float(c.parsed.value)
            confidences.append(
                _row(
                    a.context_ids,
                    c.gen,
                    c.mask,
                    version,
                    reward=c.reward,
                    scores=scores,
                    sample_type="confidence",
                    group_id=f"{episode_id}/{k}",
                    task_id=tid,
                    advantage=c.advantage,
                    metadata={"turns": 2, "rlcr": {"k": k, "h": h}, "finish_reason": c.gen.finish_reason},
                )
            )
    return answers + confidences


def _mask_span(traj: Trajectory) -> list[int] | None:
    on = np.nonzero(traj.loss_mask)[0]
    return [int(on[0]), int(on[-1]) + 1] if on.size else None


def tree_record(tree: ConfidenceTree, trajs: list[Trajectory]) -> dict:
    """The decision record for the UI and the event log: the tree with texts, rewards, advantages
    and each row's masked span ``[start, end)`` in token positions of that row."""
    g_a = len(tree.answers)
    answer_rows, conf_rows = iter(trajs[:g_a]), iter(trajs[g_a:])
    answers = []
    for k, a in enumerate(tree.answers):
        row = next(answer_rows)
        confs = []
        for h, c in enumerate(a.confidences):
            crow = next(conf_rows)
            confs.append(
                {
                    "h": h,
                    "trajectory_id": crow.id,
                    "text": c.gen.text,
                    "confidence": c.parsed.value if c.parsed.ok else None,
                    "format_ok": c.parsed.ok,
                    "reason": c.parsed.reason,
                    "conf_reward": c.reward,
                    "advantage": c.advantage,
                    "mask_span": _mask_span(crow),
                    "num_tokens": int(len(crow.token_ids)),
                }
            )
        answers.append(
            {
                "k": k,
                "trajectory_id": row.id,
                "text": a.gen.text,
                "answer": a.parsed.value,
                "format_ok": a.parsed.ok,
                "reason": a.parsed.reason,
                "acc_reward": a.reward,
                "advantage": a.advantage,
                "mask_span": _mask_span(row),
                "num_tokens": int(len(row.token_ids)),
                "confidences": confs,
            }
        )
    gold = tree.task.answer
    return {
        "kind": "rlcr_tree",
        "algorithm": "rlcr",
        "gold": gold if isinstance(gold, (int, float, str)) else str(gold),
        "prompt_tokens": len(tree.prompt_ids),
        "answers": answers,
    }


def _std(x: list[float]) -> float:
    return float(np.std(x)) if x else 0.0


def tree_metrics(tree: ConfidenceTree) -> dict[str, float]:
    """Per-episode metrics (the learner logs their batch means)."""
    acc = [a.reward for a in tree.answers]
    confs = [c for a in tree.answers for c in a.confidences]
    conf_r = [c.reward for c in confs]
    stated = [(c.parsed.value, a.reward) for a in tree.answers for c in a.confidences if c.parsed.ok]
    m = {
        "reward_mean": float(np.mean(acc)),
        "rlcr/answer_reward_mean": float(np.mean(acc)),
        "rlcr/answer_reward_std": _std(acc),
        "rlcr/answer_tokens_mean": float(np.mean([len(a.gen.token_ids) for a in tree.answers])),
        "rlcr/answer_format_fail": float(np.mean([not a.parsed.ok for a in tree.answers])),
        "rlcr/effective_ga": float(np.var(acc) > 0),
    }
    if confs:
        m.update(
            {
                "rlcr/confidence_reward_mean": float(np.mean(conf_r)),
                "rlcr/confidence_reward_std": _std(conf_r),
                "rlcr/confidence_tokens_mean": float(np.mean([len(c.gen.token_ids) for c in confs])),
                "rlcr/confidence_format_fail": float(np.mean([not c.parsed.ok for c in confs])),
                "rlcr/effective_gc": float(
                    np.mean([np.var([c.reward for c in a.confidences]) > 0 for a in tree.answers])
                ),
            }
        )
    if stated:
        c, y = np.array(stated, dtype=np.float64).T
        m.update({"rlcr/confidence_mean": float(c.mean()), "rlcr/train_brier": float(np.mean((c - y) ** 2))})
    return m
