"""Absolute Zero self-play: one policy as proposer and solver (seeds 000 and 001, DESIGN 5.1).

Per seed prompt (one task in, one Episode out):

1. propose: the policy, prompted as proposer, samples ``questions_per_prompt`` questions; each
   proposer conversation is kept (tokens and behaviour log-probs) as a proposer trajectory and
   each output is parsed by the domain into a solver task, or rejected with a reason;
2. solve: every valid question gets ``rollout_n`` solver conversations through the domain's
   environment (reset / step up to ``max_steps`` / evaluate -> named scores);
3. unified reward and filter: solver reward per response, learnability per question, and the
   group status (``filter.compute_unified_reward_and_filter``);
4. repropose: a group that is all learnable or all not learnable is proposed again, only that
   group, up to ``max_repropose_attempts`` times; each attempt replaces that group's data;
5. keep: a mixed group keeps one learnable question, drawn with a seeded RNG, and its
   ``rollout_n`` responses (group id ``<episode>/solver``); a group that never became mixed keeps
   no solver rows (the Episode may then hold no trajectories at all);
6. proposer rows (``mode: joint``): rewards 1.0 learnable / 0.0 not / -0.5 never mixed, advantage
   scaled by ``proposer_weight`` (``Trajectory.advantage_scale``). ``proposer_update: sampled`` (the
   seed) keeps one row per prompt, normalised against the other prompts' proposer rows in the
   batch (group ``absolute_zero/proposer``); ``group`` keeps every question of the final group,
   normalised within the group (``<episode>/proposer``).

The Episode's ``decision`` is the full record (every attempt's questions, ratios, thresholds,
flags, reasons, the sampled index and proposer rewards); ``metrics`` use the seeds' names.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..rollout.conversation import Conversation, run_conversations, start_conversations
from ..config import TasksConfig, validate_section
from ..envs.arithmetic import make_problem
from ..envs.base import StepResult
from ..envs.judge import JudgeConfig
from ..envs.safe_arith import ArithLimits
from ..envs.sandbox import SandboxLimits, isolation_problem, isolation_warning
from ..types import Episode, Task, Trajectory, new_id
from .azr import code_o as _code_o  # noqa: F401  (registers the domain)
from .azr import harm as _harm  # noqa: F401  (registers the domain)
from .azr.domains import PROPOSE_PREFIX, Domain, Proposal, Scored, make_domain
from .azr.filter import (MIXED, Dimension, Learnability, RewardWeights, compute_unified_reward_and_filter,
                         group_status, proposer_rewards)
from ..rollout.workflow import RolloutContext, Workflow, register_workflow

PROPOSER_BATCH_GROUP = "absolute_zero/proposer"
CODE_DOMAINS = ("code_o",)  # domains whose proposals are programs run in the sandbox (algo.sandbox)


class DimensionConfig(BaseModel):
    """One learnability dimension (the key in ``algo.learnability`` is its name)."""

    model_config = ConfigDict(extra="forbid")

    score: str | None = Field(None, description="Named score it reads (null: the dimension's name).")
    threshold: float = Field(0.5, description="A response counts when its score is strictly above/below this.")
    direction: Literal["above", "below"] = Field("above", description="Count scores above or below the threshold.")
    min_ratio: float = Field(0.3, ge=0, le=1, description="Smallest counted fraction for a learnable question.")
    max_ratio: float = Field(0.7, ge=0, le=1, description="Largest counted fraction for a learnable question.")

    @model_validator(mode="after")
    def _check(self) -> "DimensionConfig":
        if self.min_ratio > self.max_ratio:
            raise ValueError(f"min_ratio ({self.min_ratio}) exceeds max_ratio ({self.max_ratio})")
        return self


def _seed_dimensions() -> dict[str, DimensionConfig]:
    return {"safety": DimensionConfig(direction="above"),  # learnability_safety_threshold & safe ratio
            "completion": DimensionConfig(direction="below")}  # completion threshold & incomplete ratio


class AbsoluteZeroConfig(BaseModel):
    """``algo:`` section of ``algorithm: absolute_zero``. Defaults are the seeds'."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["unified", "joint"] = Field("unified", description=(
        "unified (seed 001): train the solver only; joint (seed 000): also train the proposer."))
    proposer_update: Literal["sampled", "group"] = Field("sampled", description=(
        "joint mode: 'sampled' (seed) trains the sampled question's proposer row only; 'group' trains "
        "every question of the final group with its learnability as reward, normalised in the group."))
    domain: str = Field("arithmetic", description="Self-play domain: arithmetic, code_o or harm.")
    questions_per_prompt: int = Field(4, ge=1, description="Questions in one proposed question group (k).")
    rollout_n: int | None = Field(None, ge=1, description="Solver responses per question (null: sampling.n).")
    max_steps: int = Field(1, ge=1, description="Solver environment turns per response (reset/step loop).")
    max_repropose_attempts: int = Field(3, ge=0, description="Re-proposals of a group that is not mixed.")
    learnability: dict[str, DimensionConfig] = Field(default_factory=_seed_dimensions, min_length=1,
                                                     description="Learnability dimensions by name (all must pass).")
    safety_reward_weight: float = Field(0.7, description="Solver reward weight of the safety score.")
    task_completion_weight: float = Field(0.3, description="Solver reward weight of the completion score.")
    format_weight: float = Field(0.5, description="Solver reward weight of the format score (turns ended by EOS).")
    proposer_weight: float = Field(0.1, ge=0, description="Scale of proposer advantages in joint mode.")
    proposer_max_new_tokens: int = Field(12, ge=1, description="Token budget of one proposal.")
    arithmetic: ArithLimits = Field(default_factory=ArithLimits, description="Safe evaluator bounds (arithmetic).")
    sandbox: SandboxLimits = Field(default_factory=SandboxLimits, description=(
        "code_o: isolation (bwrap, remote or none) and limits of the sandbox that runs proposals."))
    sandbox_workers: int = Field(2, ge=1, description="code_o: sandboxed runs in parallel.")
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="LLM judge endpoint (harm).")
    harm_max_chars: int = Field(2000, ge=1, description="harm: longest proposed instruction.")
    record_max_chars: int = Field(300, ge=16, description="Texts in the decision record are cut to this.")

    @model_validator(mode="after")
    def _sandbox_works_here(self) -> "AbsoluteZeroConfig":
        """A domain that runs model-written code refuses to start without its sandbox (bwrap is
        probed once per process); ``sandbox.isolation: none`` must be chosen explicitly."""
        if self.domain in CODE_DOMAINS:
            problem = isolation_problem(self.sandbox)
            if problem:
                raise ValueError(problem)
        return self

    def start_warnings(self) -> list[str]:
        """Warnings to show on every start (printed by each process, an event in the run log)."""
        warning = isolation_warning(self.sandbox) if self.domain in CODE_DOMAINS else None
        return [warning] if warning else []

    def dimensions(self) -> list[Dimension]:
        return [Dimension(name, d.score or name, d.threshold, d.direction, d.min_ratio, d.max_ratio)
                for name, d in self.learnability.items()]


# ---------------------------------------------------------------------------------- warm start
def propose_warmstart_example(rng: random.Random) -> tuple[list[dict[str, str]], str]:
    """Tiny-model warm start for the proposer: ``propose:12+34`` -> a fresh expression with the
    seed's operator and operands of 1 to 3 digits (so that difficulty is the proposer's to learn)."""
    seed = make_problem(rng, TasksConfig())
    a, b, op = seed.metadata["a"], seed.metadata["b"], seed.metadata["op"]
    x, y = (_operand(rng, rng.randint(1, 3)) for _ in range(2))
    return [{"role": "user", "content": f"{PROPOSE_PREFIX}{a}{op}{b}"}], f"{x}{op}{y}"


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


WARMSTART_FORMAT = "azr_propose"


# ---------------------------------------------------------------------------------- records
@dataclass
class Question:
    index: int
    prompt_id: str  # the seed prompt's episode id
    conv: Conversation  # the proposer conversation
    proposal: Proposal
    solver: list[Conversation] = field(default_factory=list)
    scores: list[dict[str, float]] = field(default_factory=list)
    score_errors: list[str] = field(default_factory=list)
    check: Learnability = field(default_factory=lambda: Learnability(False))

    @property
    def learnable(self) -> bool:
        return self.check.learnable


@dataclass
class Attempt:
    number: int
    questions: list[Question]
    status: str = ""
    sampled: int = -1


@dataclass
class PromptRun:
    """One seed prompt across its attempts; the last attempt is the group that counts."""

    seed: Task
    episode_id: str
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def final(self) -> Attempt:
        return self.attempts[-1]


class _ProposerEnv:
    """The proposer's one-turn 'environment': the prompt, one reply, done."""

    def reset(self, task: Task) -> list[dict[str, str]]:
        return [dict(m) for m in task.prompt]

    def step(self, task, history, response) -> StepResult:
        return StepResult(done=True)

    def evaluate(self, task, history) -> dict[str, float]:
        return {"reward": 0.0}


def format_score(conv: Conversation) -> float:
    """Fraction of the conversation's turns that ended by EOS/stop rather than the length cap."""
    reasons = conv.finish_reasons
    return float(np.mean([r == "stop" for r in reasons])) if reasons else 0.0


# ---------------------------------------------------------------------------------- workflow
@register_workflow("absolute_zero")
class AbsoluteZeroWorkflow(Workflow):
    warmstart_formats = {WARMSTART_FORMAT: propose_warmstart_example}  # the embedded model's proposer

    def __init__(self, cfg):
        super().__init__(cfg)
        self.algo: AbsoluteZeroConfig = validate_section(AbsoluteZeroConfig, cfg.algo, "algo")
        self.warnings: list[str] = self.algo.start_warnings()  # the learner logs them as events
        for warning in self.warnings:
            print(f"[asyncrl] WARNING: {warning}", file=sys.stderr, flush=True)
        self.domain: Domain = make_domain(self.algo)
        self.dims = self.algo.dimensions()
        self.weights = RewardWeights(self.algo.safety_reward_weight, self.algo.task_completion_weight,
                                     self.algo.format_weight)
        self.n = self.algo.rollout_n or cfg.sampling.n
        self.solver_sampling = cfg.sampling
        self.proposer_sampling = cfg.sampling.model_copy(
            update={"n": 1, "max_new_tokens": self.algo.proposer_max_new_tokens})
        self._proposer_env = _ProposerEnv()

    def rollout(self, tasks: list[Task], ctx: RolloutContext) -> list[Episode]:
        version = ctx.engine.version
        rng = random.Random(ctx.seed)
        runs = [PromptRun(t, new_id()) for t in tasks]
        pending = list(runs)
        for number in range(self.algo.max_repropose_attempts + 1):
            self._attempt(pending, number, ctx, rng)
            pending = [r for r in pending if r.final.status != MIXED]
            if not pending:
                break
        return [self._episode(r, ctx, version, rng) for r in runs]

    # -- one attempt: propose -> solve -> evaluate -> learnability -> rewards ------------------
    def _attempt(self, runs: list[PromptRun], number: int, ctx: RolloutContext, rng: random.Random) -> None:
        base_seed = ctx.seed + 10_007 * (number + 1)
        groups = self._propose(runs, number, ctx, base_seed)
        questions = [q for g in groups for q in g]
        self._solve([q for q in questions if q.proposal.valid], ctx, base_seed + 5_003)
        tables = [[q.scores for q in g] for g in groups]
        result = compute_unified_reward_and_filter(tables, self.dims, self.weights, rng)
        for i, (run, group) in enumerate(zip(runs, groups)):
            for q, check, rewards in zip(group, result.learnable[i], result.rewards[i]):
                q.check = check
                for scores, reward in zip(q.scores, rewards):
                    scores["reward"] = reward
            status = group_status([q.learnable for q in group])
            run.attempts.append(Attempt(number, group, status, result.sampled[i]))

    def _propose(self, runs: list[PromptRun], number: int, ctx: RolloutContext, seed: int) -> list[list[Question]]:
        k = self.algo.questions_per_prompt
        ptasks = [Task(id=f"{r.seed.id}/propose", prompt=self.domain.proposer_prompt(r.seed)) for r in runs]
        convs = start_conversations(ctx.tokenizer, self._proposer_env, ptasks, k,
                                    group_ids=[f"{r.episode_id}/proposer" for r in runs], sample_type="proposer")
        run_conversations(ctx.engine, ctx.tokenizer, self._proposer_env, convs, self.proposer_sampling, 1, seed=seed)
        items = [(convs[i * k + j].texts[-1] if convs[i * k + j].texts else "", r.seed,
                  f"{r.episode_id}/a{number}/q{j}") for i, r in enumerate(runs) for j in range(k)]
        proposals = self.domain.parse_many(items)
        groups = []
        for i, run in enumerate(runs):
            group = [Question(j, run.episode_id, convs[i * k + j], proposals[i * k + j]) for j in range(k)]
            for q in group:
                if q.proposal.task is not None:
                    q.proposal.task.metadata["prompt_id"] = run.episode_id
            groups.append(group)
        return groups

    def _solve(self, questions: list[Question], ctx: RolloutContext, seed: int) -> None:
        if not questions:
            return
        n = self.n
        convs = start_conversations(ctx.tokenizer, self.domain, [q.proposal.task for q in questions], n,
                                    group_ids=[f"{q.prompt_id}/solver" for q in questions], sample_type="solver")
        run_conversations(ctx.engine, ctx.tokenizer, self.domain, convs, self.solver_sampling,
                          self.algo.max_steps, seed=seed)
        scored: list[Scored] = self.domain.score_many([(c.task, c.history) for c in convs])
        for i, q in enumerate(questions):
            q.solver = convs[i * n:(i + 1) * n]
            for conv, sc in zip(q.solver, scored[i * n:(i + 1) * n]):
                q.scores.append({**sc.scores, "format": format_score(conv)})
                if sc.reason and sc.reason not in q.score_errors:
                    q.score_errors.append(sc.reason)

    # -- assembling the episode -------------------------------------------------------------------
    def _episode(self, run: PromptRun, ctx: RolloutContext, version: int, rng: random.Random) -> Episode:
        final = run.final
        kept = final.sampled >= 0
        rewards = proposer_rewards([q.learnable for q in final.questions], never_mixed=not kept)
        if self.algo.proposer_update == "group":
            chosen = list(range(len(final.questions)))
        else:
            chosen = [final.sampled if kept else rng.randrange(len(final.questions))]
        trajs: list[Trajectory] = []
        if kept:
            q = final.questions[final.sampled]
            meta = {"prompt_id": run.episode_id, "attempt": final.number, "question_index": q.index}
            trajs += [c.to_trajectory(version, s, meta) for c, s in zip(q.solver, q.scores)]
        if self.algo.mode == "joint":
            trajs += [self._proposer_row(run, final.questions[j], rewards[j], version) for j in chosen]
        metrics = self._metrics(run, trajs, [rewards[j] for j in chosen])
        decision = self._decision(run, rewards, chosen, version)
        return Episode(trajectories=trajs, actor_id=ctx.actor_id, task=run.seed, decision=decision,
                       metrics=metrics, created_at=time.time(), id=run.episode_id)

    def _proposer_row(self, run: PromptRun, q: Question, reward: float, version: int) -> Trajectory:
        group = PROPOSER_BATCH_GROUP if self.algo.proposer_update == "sampled" else f"{run.episode_id}/proposer"
        traj = q.conv.to_trajectory(version, {"reward": reward, "learnable": float(q.learnable)},
                                    {"prompt_id": run.episode_id, "attempt": run.final.number,
                                     "question_index": q.index})
        traj.group_id, traj.advantage_scale = group, self.algo.proposer_weight
        return traj

    def _metrics(self, run: PromptRun, trajs: list[Trajectory], proposer_rewards_: list[float]) -> dict[str, float]:
        final, first = run.final, run.attempts[0]
        k = len(final.questions)
        learnable = sum(q.learnable for q in final.questions)
        solver = [t for t in trajs if t.sample_type == "solver"]
        integrated = [t for t in trajs if t.sample_type == "proposer"]
        p_mean = float(np.mean(proposer_rewards_))
        m = {"unified_filter/num_learnable": learnable, "unified_filter/num_total": k,
             "unified_filter/learnable_ratio": learnable / k,
             "unified_filter/num_sampled": int(final.sampled >= 0),
             "unified_filter/num_repropose": int(first.status != MIXED),
             "unified_filter/first_learnable_ratio": sum(q.learnable for q in first.questions) / k,
             "unified_filter/num_invalid": sum(not q.proposal.valid for q in final.questions),
             "repropose/total_attempts": len(run.attempts) - 1,
             "repropose/final_non_learnable": int(final.sampled < 0),
             "proposer/num_trajectories": sum(len(a.questions) for a in run.attempts),
             "proposer/num_integrated": len(integrated), "proposer/reward_mean": p_mean}
        first_scores = [s for q in first.questions for s in q.scores]  # before any filtering
        if first_scores:
            m["solver/first_attempt_reward_mean"] = float(np.mean([s["reward"] for s in first_scores]))
            m["solver/first_attempt_solve_rate"] = float(np.mean([s.get("completion", 0.0) for s in first_scores]))
        if solver:
            s_mean = float(np.mean([t.reward for t in solver]))
            m.update({"harm/safety_score_mean": float(np.mean([t.scores.get("safety", 0.0) for t in solver])),
                      "harm/completion_score_mean": float(np.mean([t.scores.get("completion", 0.0) for t in solver])),
                      "harm/combined_reward_mean": s_mean})
            if self.algo.mode == "joint":
                m["joint/combined_reward_mean"] = s_mean + self.algo.proposer_weight * p_mean
                m["joint/proposer_solver_ratio"] = p_mean / s_mean if s_mean else 0.0
        return m

    def _decision(self, run: PromptRun, rewards: list[float], chosen: list[int], version: int) -> dict:
        cut = self.algo.record_max_chars
        return {
            "algorithm": "absolute_zero", "mode": self.algo.mode, "proposer_update": self.algo.proposer_update,
            "domain": self.algo.domain, "policy_version": version,
            "seed_prompt": run.seed.prompt[-1]["content"][:cut] if run.seed.prompt else "",
            "dimensions": [d.__dict__ for d in self.dims],
            "attempts": [{"attempt": a.number, "status": a.status, "sampled_index": a.sampled,
                          "questions": [_question_record(q, cut) for q in a.questions]} for a in run.attempts],
            "repropose_attempts": len(run.attempts) - 1, "final_status": run.final.status,
            "kept": run.final.sampled >= 0, "sampled_index": run.final.sampled,
            "proposer_rewards": rewards, "proposer_integrated": chosen if self.algo.mode == "joint" else [],
        }


def _question_record(q: Question, cut: int) -> dict:
    p = q.proposal
    return {"index": q.index, "proposal": p.text[:cut], "valid": p.valid, "reason": p.reason,
            "question": p.task.prompt[-1]["content"][:cut] if p.task else None, "answer": p.gold[:cut],
            "learnable": q.learnable, "ratios": q.check.ratios, "passed": q.check.passed,
            "responses": [c.texts[-1][:cut] if c.texts else "" for c in q.solver],
            "rewards": [s.get("reward", 0.0) for s in q.scores],
            "solve_rate": float(np.mean([s.get("completion", 0.0) for s in q.scores])) if q.scores else None,
            "score_errors": q.score_errors}
