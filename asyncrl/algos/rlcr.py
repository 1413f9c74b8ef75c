"""RLCR: accuracy plus calibrated confidence, on two-turn answer -> confidence trees (seed 003).

One prompt grows one tree, sent as one Episode:

    prompt ──> answer k = 1..G_a            turn 1: <think>...</think><answer>...</answer>
                 └─> confidence h = 1..G_c  turn 2, after a user message asking for a confidence:
                                            [<analysis>...</analysis>]<confidence>c</confidence>

All turn-1 generations of a batch are one engine call, all turn-2 generations another.

Rewards (last tag wins; format or parse failure gives 0):
``acc_reward[k] = verify(gold, answer[k])`` in {0, 1} and ``conf_reward[k, h] = 1 - (acc_reward[k] -
c[k, h])^2`` (Brier), always against the accuracy of the very answer the confidence is about.

Rows: each answer is a trajectory (``sample_type="answer"``: prompt + turn 1) that learns on the
think+answer span; each confidence another (``"confidence"``: prompt + answer + user turn + turn 2)
that learns on the analysis+confidence span only. Prompts and inserted user turns are never learned.
An output whose tags cannot be found learns on its whole turn, so that its zero reward can push it
away. The span ends at the closing tag (plus the EOS token right after it).

Advantages are computed here and carried on ``Trajectory.advantage``: answers are normalised among
the prompt's G_a answers, confidences among the G_c siblings of the same answer and never across
answers (a confidence about a wrong answer must not be baselined against ones about a right
answer); scaled by ``lambda_ans`` and ``lambda_conf``. The learner's loss then runs over each row's
own mask with any ``loss_agg_mode``.

``evaluate`` reports calibration on held-out tasks (accuracy, Brier, ECE, AUROC, reliability bins).
This module also registers the embedded model's ``rlcr`` warm-start format: the tag format with
uninformative confidences, so that calibration has to be learned by RL.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from ..models.prompts import delta_tokens, render_tokens
from ..config import TasksConfig, validate_section
from ..engine.base import Generation
from ..envs.arithmetic import make_problem
from ..envs.verifiers import require_math_verify, verify
from ..advantages import compute_grpo_advantages
from ..types import Episode, Task, Trajectory, new_id
from ..rollout.workflow import RolloutContext, Workflow, register_workflow
from .calibration import calibration_report

DEFAULT_SYSTEM_PROMPT = "Answer in tags."
DEFAULT_CONFIDENCE_PROMPT = "Confidence (0-1)?"


class RLCRConfig(BaseModel):
    """The ``algo:`` section for ``algorithm: rlcr``."""

    model_config = ConfigDict(extra="forbid")

    num_generations_answer: int = Field(4, ge=1, description=(
        "G_a: answers sampled per prompt (turn 1), normalised together. 1 leaves answers no baseline "
        "(advantage 0)."))
    num_generations_confidence: int = Field(4, ge=1, description=(
        "G_c: confidences sampled per answer (turn 2), normalised together. 1 leaves confidences no "
        "baseline (advantage 0)."))
    lambda_ans: float = Field(1.0, ge=0, description="Scale of the answer advantages.")
    lambda_conf: float = Field(1.0, ge=0, description="Scale of the confidence advantages.")
    norm_by_std: bool = Field(False, description=(
        "Divide advantages by their group's std (unbiased); false: A = R - mean (RLCR, Dr.GRPO)."))
    verifier: Literal["auto", "numeric", "math", "exact_match"] = Field("auto", description=(
        "Answer check: 'numeric' (exact number), 'math' (math-verify), 'exact_match' (normalised "
        "string), 'auto' (task.metadata['verifier'], else numeric for numeric golds, else exact_match)."))
    system_prompt: str | None = Field(DEFAULT_SYSTEM_PROMPT, description=(
        "System message put before each task's prompt (unless it has one); null: none. The embedded "
        "model's rlcr warm-start format uses the default."))
    confidence_prompt: str = Field(DEFAULT_CONFIDENCE_PROMPT, min_length=1, description=(
        "The user message that asks for a confidence in turn 2 (the warm start uses the default)."))
    answer_max_new_tokens: int | None = Field(None, ge=1, description=(
        "Turn-1 token budget; null: sampling.max_new_tokens."))
    confidence_max_new_tokens: int | None = Field(None, ge=1, description=(
        "Turn-2 token budget; null: sampling.max_new_tokens."))


# --------------------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class Parsed:
    """One turn's parse: ``value`` (answer text or confidence float) and the learnable char span."""

    ok: bool
    value: Any = None
    reason: str = ""  # why it failed ("" when ok)
    span: tuple[int, int] | None = None  # [start, end) chars of the learnable region; None: whole turn


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_THINK = re.compile(r"<think>.*?</think>", re.S)
_CONFIDENCE = re.compile(r"<confidence>(.*?)</confidence>", re.S)
_DECIMAL = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)$")


def _span(text: str, open_tags: tuple[str, ...], last: re.Match) -> tuple[int, int]:
    """From the first of ``open_tags`` (before the last match) to the end of the last match."""
    starts = [i for i in (text.find(t) for t in open_tags) if 0 <= i <= last.start()]
    return min(starts), last.end()


def parse_answer(text: str) -> Parsed:
    """Turn 1: the last ``<answer>..</answer>`` (stripped), which must follow a ``<think>..</think>``.
    The learnable span runs from the first ``<think>`` to the end of the last ``</answer>``."""
    matches = list(_ANSWER.finditer(text))
    if not matches:
        return Parsed(False, reason="no <answer>...</answer>")
    last = matches[-1]
    if not _THINK.search(text, 0, last.start()):
        return Parsed(False, reason="no <think>...</think> before the answer")
    return Parsed(True, last.group(1).strip(), span=_span(text, ("<think>", "<answer>"), last))


def parse_confidence(text: str) -> Parsed:
    """Turn 2: the last ``<confidence>..</confidence>`` as a decimal number in [0, 1]. The learnable
    span runs from the first ``<analysis>`` (if any, else ``<confidence>``) to the last close tag."""
    matches = list(_CONFIDENCE.finditer(text))
    if not matches:
        return Parsed(False, reason="no <confidence>...</confidence>")
    last = matches[-1]
    raw = last.group(1).strip()
    if not _DECIMAL.match(raw):
        return Parsed(False, reason=f"confidence {raw[:20]!r} is not a number")
    value = float(raw)
    if not 0.0 <= value <= 1.0:
        return Parsed(False, reason=f"confidence {raw} is outside [0, 1]")
    return Parsed(True, value, span=_span(text, ("<analysis>", "<confidence>"), last))


def brier_reward(acc_reward: float, confidence: float | None) -> float:
    """``1 - (acc_reward - confidence)^2``; 0 when the confidence did not parse (``None``)."""
    if confidence is None:
        return 0.0
    return 1.0 - (float(acc_reward) - float(confidence)) ** 2


# --------------------------------------------------------------------------------------- masks
def token_char_offsets(tokenizer, token_ids, text: str) -> np.ndarray:
    """``[L + 1]``: token ``i`` covers chars ``[off[i], off[i+1])`` of ``text`` (the decode of
    ``token_ids`` without special tokens, which cover no chars)."""
    ids = [int(t) for t in token_ids]
    pieces = tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=True)
    off = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)
    if off[-1] != len(text):  # merges that decode differently alone (byte-level BPE): decode prefixes
        prefixes = tokenizer.batch_decode([ids[:i] for i in range(len(ids) + 1)], skip_special_tokens=True)
        off = np.array([len(p) for p in prefixes], dtype=np.int64)
    return off


def span_mask(tokenizer, gen: Generation, span: tuple[int, int] | None, eos_ids: set[int]) -> np.ndarray:
    """uint8 ``[L]`` over a turn's generated tokens: 1 on the tokens that cover chars ``span`` of
    ``gen.text`` and on an EOS token right after them; all ones when ``span`` is None."""
    n = len(gen.token_ids)
    if span is None:
        return np.ones(n, dtype=np.uint8)
    off = token_char_offsets(tokenizer, gen.token_ids, gen.text)
    start, end = span
    covering = np.nonzero((off[1:] > start) & (off[:-1] < end))[0]
    mask = np.zeros(n, dtype=np.uint8)
    if covering.size:
        first, last = int(covering[0]), int(covering[-1])
        if last + 1 < n and int(gen.token_ids[last + 1]) in eos_ids and off[last + 1] == end:
            last += 1
        mask[first:last + 1] = 1
    return mask


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


def _answer_node(tokenizer, gen: Generation, history: list[dict[str, str]], prompt: list[int],
                 ask: list[dict[str, str]], eos: set[int]) -> AnswerNode:
    """Parse and mask turn 1; its turn-2 prompt is the sampled tokens (closed with EOS if the turn was
    cut at the length limit) plus the template's tokens for the user turn and the next header."""
    parsed = parse_answer(gen.text)
    ids = gen.token_ids.tolist()
    closed = ids if ids and ids[-1] in eos else ids + [int(tokenizer.eos_token_id)]
    said = history + [{"role": "assistant", "content": gen.text}]
    return AnswerNode(gen, parsed, span_mask(tokenizer, gen, parsed.span, eos),
                      context_ids=prompt + closed + delta_tokens(tokenizer, said, ask))


def grow_trees(engine, tokenizer, env, tasks: list[Task], algo: RLCRConfig, sampling, seed: int | None,
               g_a: int | None = None, g_c: int | None = None) -> list[ConfidenceTree]:
    """Sample the trees of ``tasks`` (parsed and masked, not yet scored): one engine call for all
    G_a answers of all tasks, then one for all G_c confidences of all answers."""
    g_a = g_a or algo.num_generations_answer
    g_c = g_c or algo.num_generations_confidence
    eos = _eos_ids(engine, tokenizer)
    ans_sampling = sampling.model_copy(update={"max_new_tokens": algo.answer_max_new_tokens
                                               or sampling.max_new_tokens})
    conf_sampling = sampling.model_copy(update={"max_new_tokens": algo.confidence_max_new_tokens
                                                or sampling.max_new_tokens})
    histories = [opening_messages(env, t, algo.system_prompt) for t in tasks]
    prompts = [render_tokens(tokenizer, h) for h in histories]
    gens = engine.generate([p for p in prompts for _ in range(g_a)], ans_sampling, seed=seed)
    ask = [{"role": "user", "content": algo.confidence_prompt}]
    trees = [ConfidenceTree(task, prompt, [_answer_node(tokenizer, gen, history, prompt, ask, eos)
                                           for gen in gens[j * g_a:(j + 1) * g_a]])
             for j, (task, history, prompt) in enumerate(zip(tasks, histories, prompts))]
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


def tree_advantages(acc: np.ndarray, conf: np.ndarray, norm_by_std: bool, lambda_ans: float = 1.0,
                    lambda_conf: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Decoupled advantages of one tree.

    Args:
        acc: ``[G_a]`` acc_reward of the answers (one group: the prompt).
        conf: ``[G_a, G_c]`` conf_reward; row ``k`` is the group of answer ``k``'s confidences.
    Returns:
        ``(adv_ans [G_a], adv_conf [G_a, G_c])``: GRPO advantages (``R - mean``, divided by the
        unbiased std + 1e-6 when ``norm_by_std``) scaled by ``lambda_ans`` / ``lambda_conf``. Row
        ``k`` of ``adv_conf`` depends on row ``k`` of ``conf`` only.
    """
    acc = np.asarray(acc, dtype=np.float64)
    conf = np.asarray(conf, dtype=np.float64).reshape(len(acc), -1)
    adv_ans = compute_grpo_advantages(torch.as_tensor(acc), ["prompt"] * len(acc), norm_by_std=norm_by_std)
    g_c = conf.shape[1]
    groups = [str(k) for k in range(len(acc)) for _ in range(g_c)]
    adv_conf = compute_grpo_advantages(torch.as_tensor(conf.reshape(-1)), groups, norm_by_std=norm_by_std)
    return lambda_ans * adv_ans.numpy(), lambda_conf * adv_conf.numpy().reshape(len(acc), g_c)


def assign_advantages(tree: ConfidenceTree, algo: RLCRConfig) -> None:
    adv_ans, adv_conf = tree_advantages(tree.acc_rewards(), tree.conf_rewards(), algo.norm_by_std,
                                        algo.lambda_ans, algo.lambda_conf)
    for k, a in enumerate(tree.answers):
        a.advantage = float(adv_ans[k])
        for h, c in enumerate(a.confidences):
            c.advantage = float(adv_conf[k, h])


def _row(context: list[int], gen: Generation, mask: np.ndarray, version: int, **kw) -> Trajectory:
    """Trajectory ``context + gen``: loss mask and behaviour log-probs only on ``mask``."""
    pad = len(context)
    full_mask = np.concatenate([np.zeros(pad, dtype=np.uint8), mask])
    logprobs = np.concatenate([np.zeros(pad, dtype=np.float32), gen.logprobs * mask])
    return Trajectory(token_ids=np.asarray(context + gen.token_ids.tolist(), dtype=np.int32),
                      loss_mask=full_mask, behavior_logprobs=logprobs, policy_version=version,
                      text=gen.text, **kw)


def tree_trajectories(tree: ConfidenceTree, version: int, episode_id: str) -> list[Trajectory]:
    """G_a answer rows then G_a x G_c confidence rows (answer-major), advantages set."""
    answers, confidences = [], []
    tid = tree.task.id
    for k, a in enumerate(tree.answers):
        scores = {"reward": a.reward, "acc_reward": a.reward, "format_ok": float(a.parsed.ok)}
        answers.append(_row(tree.prompt_ids, a.gen, a.mask, version, reward=a.reward, scores=scores,
                            sample_type="answer", group_id=episode_id, task_id=tid, advantage=a.advantage,
                            metadata={"turns": 1, "rlcr": {"k": k}, "finish_reason": a.gen.finish_reason}))
        for h, c in enumerate(a.confidences):
            scores = {"reward": c.reward, "conf_reward": c.reward, "acc_reward": a.reward,
                      "format_ok": float(c.parsed.ok)}
            if c.parsed.ok:
                scores["confidence"] = float(c.parsed.value)
            confidences.append(_row(a.context_ids, c.gen, c.mask, version, reward=c.reward, scores=scores,
                                    sample_type="confidence", group_id=f"{episode_id}/{k}", task_id=tid,
                                    advantage=c.advantage,
                                    metadata={"turns": 2, "rlcr": {"k": k, "h": h},
                                              "finish_reason": c.gen.finish_reason}))
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
            confs.append({"h": h, "trajectory_id": crow.id, "text": c.gen.text,
                          "confidence": c.parsed.value if c.parsed.ok else None, "format_ok": c.parsed.ok,
                          "reason": c.parsed.reason, "conf_reward": c.reward, "advantage": c.advantage,
                          "mask_span": _mask_span(crow), "num_tokens": int(len(crow.token_ids))})
        answers.append({"k": k, "trajectory_id": row.id, "text": a.gen.text,
                        "answer": a.parsed.value, "format_ok": a.parsed.ok, "reason": a.parsed.reason,
                        "acc_reward": a.reward, "advantage": a.advantage, "mask_span": _mask_span(row),
                        "num_tokens": int(len(row.token_ids)), "confidences": confs})
    gold = tree.task.answer
    return {"kind": "rlcr_tree", "gold": gold if isinstance(gold, (int, float, str)) else str(gold),
            "prompt_tokens": len(tree.prompt_ids), "answers": answers}


def _std(x: list[float]) -> float:
    return float(np.std(x)) if x else 0.0


def tree_metrics(tree: ConfidenceTree) -> dict[str, float]:
    """Per-episode metrics (the learner logs their batch means)."""
    acc = [a.reward for a in tree.answers]
    confs = [c for a in tree.answers for c in a.confidences]
    conf_r = [c.reward for c in confs]
    stated = [(c.parsed.value, a.reward) for a in tree.answers for c in a.confidences if c.parsed.ok]
    m = {"reward_mean": float(np.mean(acc)),
         "rlcr/answer_reward_mean": float(np.mean(acc)), "rlcr/answer_reward_std": _std(acc),
         "rlcr/answer_tokens_mean": float(np.mean([len(a.gen.token_ids) for a in tree.answers])),
         "rlcr/answer_format_fail": float(np.mean([not a.parsed.ok for a in tree.answers])),
         "rlcr/effective_ga": float(np.var(acc) > 0)}
    if confs:
        m.update({"rlcr/confidence_reward_mean": float(np.mean(conf_r)),
                  "rlcr/confidence_reward_std": _std(conf_r),
                  "rlcr/confidence_tokens_mean": float(np.mean([len(c.gen.token_ids) for c in confs])),
                  "rlcr/confidence_format_fail": float(np.mean([not c.parsed.ok for c in confs])),
                  "rlcr/effective_gc": float(np.mean([np.var([c.reward for c in a.confidences]) > 0
                                                      for a in tree.answers]))})
    if stated:
        c, y = np.array(stated, dtype=np.float64).T
        m.update({"rlcr/confidence_mean": float(c.mean()), "rlcr/train_brier": float(np.mean((c - y) ** 2))})
    return m


# --------------------------------------------------------------------------------------- workflow
@register_workflow("rlcr")
class RLCRWorkflow(Workflow):
    """One Episode per task carrying its confidence tree (``Episode.decision``)."""

    warmstart_formats = {"rlcr": lambda rng: rlcr_warmstart_example(rng)}  # tags: answer, then confidence

    def __init__(self, cfg):
        super().__init__(cfg)
        self.algo: RLCRConfig = validate_section(RLCRConfig, cfg.algo, "algo")
        if self.algo.verifier == "math":
            require_math_verify()  # fail at start-up, not on the first batch

    def rollout(self, tasks: list[Task], ctx: RolloutContext) -> list[Episode]:
        version = ctx.engine.version
        trees = grow_trees(ctx.engine, ctx.tokenizer, ctx.env, tasks, self.algo, self.cfg.sampling, ctx.seed)
        episodes = []
        for tree in trees:
            score_tree(tree, self.algo.verifier)
            assign_advantages(tree, self.algo)
            eid = new_id()
            trajs = tree_trajectories(tree, version, eid)
            episodes.append(Episode(trajectories=trajs, actor_id=ctx.actor_id, task=tree.task, id=eid,
                                    decision=tree_record(tree, trajs), metrics=tree_metrics(tree),
                                    created_at=time.time()))
        return episodes

    def evaluate(self, engine, tokenizer, env, tasks: list[Task], sampling, cfg) -> dict:
        """One answer and one confidence per held-out task (the evaluator's sampling, greedy by
        default). An unparsable confidence counts as 0 and is reported as ``confidence_parse_fail``."""
        trees = grow_trees(engine, tokenizer, env, tasks, self.algo, sampling, cfg.seed, g_a=1, g_c=1)
        conf, correct, answer_fail, conf_fail = [], [], 0, 0
        for tree in trees:
            score_tree(tree, self.algo.verifier)
            a = tree.answers[0]
            c = a.confidences[0]
            conf.append(c.parsed.value if c.parsed.ok else 0.0)
            correct.append(a.reward)
            answer_fail += not a.parsed.ok
            conf_fail += not c.parsed.ok
        report = calibration_report(conf, correct)
        report.update(reward_mean=report["accuracy"], answer_format_fail=answer_fail / max(len(trees), 1),
                      confidence_parse_fail=conf_fail / max(len(trees), 1))
        return report


# --------------------------------------------------------------------------------------- warm start
WARMSTART_MAX_OPERAND = 19  # a + b with operands 0..19: partial accuracy after a short warm start
WARMSTART_CONFIDENCE = "0.9"  # the usual stated confidence: overconfident, and unrelated to correctness


def _uninformative_confidence(rng: random.Random) -> str:
    """Half the time 0.9, otherwise uniform over 0.0, 0.1, ..., 1.0: independent of correctness."""
    return WARMSTART_CONFIDENCE if rng.random() < 0.5 else f"{rng.randint(0, 10) / 10:.1f}"


def _wrong_answer(rng: random.Random, right: int) -> int:
    """A plausible slip: off by one or two in a digit, never the right answer."""
    if right > 11:
        return right + rng.choice([-11, -10, -2, -1, 1, 2, 10, 11])
    return right + rng.randint(1, 9)


def rlcr_warmstart_example(rng: random.Random) -> tuple[list[dict[str, str]], str]:
    """A turn-1 example (tags around a right answer) or a turn-2 example (after a right or wrong
    answer, an uninformative confidence), half and half."""
    task = make_problem(rng, TasksConfig(max_operand=WARMSTART_MAX_OPERAND))
    question = task.prompt[0]["content"]
    opening = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, *task.prompt]

    def said(answer: int) -> str:
        return f"<think>{question.rstrip('=')}</think><answer>{answer}</answer>"

    if rng.random() < 0.5:
        return opening, said(task.answer)
    shown = task.answer if rng.random() < 0.5 else _wrong_answer(rng, task.answer)
    messages = [*opening, {"role": "assistant", "content": said(shown)},
                {"role": "user", "content": DEFAULT_CONFIDENCE_PROMPT}]
    return messages, f"<confidence>{_uninformative_confidence(rng)}</confidence>"


