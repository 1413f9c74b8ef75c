"""The Absolute Zero workflow: propose -> solve -> evaluate -> learnability filter -> repropose ->
rewards, one Episode per seed prompt (the whole procedure is in the package docstring)."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ...config import TasksConfig, validate_section
from ...envs.arithmetic import make_problem
from ...envs.base import StepResult
from ...rollout.conversation import Conversation, run_conversations, start_conversations
from ...rollout.workflow import RolloutContext, Workflow, register_workflow
from ...types import Episode, Task, Trajectory, new_id
from . import code_o as _code_o  # noqa: F401  (registers the domain)
from . import harm as _harm  # noqa: F401  (registers the domain)
from .config import AbsoluteZeroConfig
from .domains import PROPOSE_PREFIX, Domain, Proposal, Scored, make_domain
from .filter import (
    MIXED,
    Learnability,
    RewardWeights,
    compute_unified_reward_and_filter,
    group_status,
    proposer_rewards,
)

PROPOSER_BATCH_GROUP = "absolute_zero/proposer"
CODE_DOMAINS = ("code_o",)  # domains whose proposals are programs run in the sandbox (algo.sandbox)


# ---------------------------------------------------------------------------------- warm start
def propose_warmstart_example(rng: random.Random) -> tuple[list[dict[str, str]], str]:
    """Tiny-model warm start for the proposer: ``propose:12+34`` -> a fresh expression with the
    seed's operator and operands of 1 to 3 digits (so that difficulty is the proposer's to learn)."""
    seed = make_problem(rng, TasksConfig())
    a, b, op = seed.metadata["a"], seed.metadata["b"], seed.metadata["op"]
    x, y = (_operand(rng, rng.randint(1, 3)) for _ in range(2))
    return [{"role": "user", "content": f"{PROPOSE_PREFIX}{a}{op}{b}"}], f"{x}{op}{y}"


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


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
    tables = {
        "azr_groups": "asyncrl.algos.absolute_zero.analysis:azr_groups_frame",
        "azr_questions": "asyncrl.algos.absolute_zero.analysis:azr_questions_frame",
    }
    views = ("asyncrl.algos.absolute_zero.ui:ProposedTasksView",)
    algo_config = AbsoluteZeroConfig

    @staticmethod
    def counts_for_reward(traj) -> bool:
        return traj.sample_type != "proposer" and not traj.is_replay  # the solver's answers

    def __init__(self, cfg):
        super().__init__(cfg)
        self.algo: AbsoluteZeroConfig = validate_section(self.algo_config, cfg.algo, "algo")
        self.warnings: list[str] = self.algo.start_warnings()  # the learner logs them as events
        for warning in self.warnings:
            print(f"[asyncrl] WARNING: {warning}", file=sys.stderr, flush=True)
        self.domain: Domain = make_domain(self.algo)
        self.dims = self.algo.dimensions()
        self.weights = RewardWeights(
            self.algo.safety_reward_weight, self.algo.task_completion_weight, self.algo.format_weight
        )
        self.n = self.algo.rollout_n or cfg.sampling.n
        self.solver_sampling = cfg.sampling
        self.proposer_sampling = cfg.sampling.model_copy(
            update={"n": 1, "max_new_tokens": self.algo.proposer_max_new_tokens}
        )
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
        convs = start_conversations(
            ctx.tokenizer,
            self._proposer_env,
            ptasks,
            k,
            group_ids=[f"{r.episode_id}/proposer" for r in runs],
            sample_type="proposer",
        )
        run_conversations(ctx.engine, ctx.tokenizer, self._proposer_env, convs, self.proposer_sampling, 1, seed=seed)
        items = [
            (convs[i * k + j].texts[-1] if convs[i * k + j].texts else "", r.seed, f"{r.episode_id}/a{number}/q{j}")
            for i, r in enumerate(runs)
            for j in range(k)
        ]
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
        convs = start_conversations(
            ctx.tokenizer,
            self.domain,
            [q.proposal.task for q in questions],
            n,
            group_ids=[f"{q.prompt_id}/solver" for q in questions],
            sample_type="solver",
        )
        run_conversations(
            ctx.engine, ctx.tokenizer, self.domain, convs, self.solver_sampling, self.algo.max_steps, seed=seed
        )
        scored: list[Scored] = self.domain.score_many([(c.task, c.history) for c in convs])
        for i, q in enumerate(questions):
            q.solver = convs[i * n : (i + 1) * n]
            for conv, sc in zip(q.solver, scored[i * n : (i + 1) * n]):
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
        return Episode(
            trajectories=trajs,
            actor_id=ctx.actor_id,
            task=run.seed,
            decision=decision,
            metrics=metrics,
            created_at=time.time(),
            id=run.episode_id,
        )

    def _proposer_row(self, run: PromptRun, q: Question, reward: float, version: int) -> Trajectory:
        group = PROPOSER_BATCH_GROUP if self.algo.proposer_update == "sampled" else f"{run.episode_id}/proposer"
        traj = q.conv.to_trajectory(
            version,
            {"reward": reward, "learnable": float(q.learnable)},
            {"prompt_id": run.episode_id, "attempt": run.final.number, "question_index": q.index},
        )
        traj.group_id, traj.advantage_scale = group, self.algo.proposer_weight
        return traj

    def _metrics(self, run: PromptRun, trajs: list[Trajectory], proposer_rewards_: list[float]) -> dict[str, float]:
        final, first = run.final, run.attempts[0]
        k = len(final.questions)
        learnable = sum(q.learnable for q in final.questions)
        solver = [t for t in trajs if t.sample_type == "solver"]
        integrated = [t for t in trajs if t.sample_type == "proposer"]
        p_mean = float(np.mean(proposer_rewards_))
        m = {
            "unified_filter/num_learnable": learnable,
            "unified_filter/num_total": k,
            "unified_filter/learnable_ratio": learnable / k,
            "unified_filter/num_sampled": int(final.sampled >= 0),
            "unified_filter/num_repropose": int(first.status != MIXED),
            "unified_filter/first_learnable_ratio": sum(q.learnable for q in first.questions) / k,
            "unified_filter/num_invalid": sum(not q.proposal.valid for q in final.questions),
            "repropose/total_attempts": len(run.attempts) - 1,
            "repropose/final_non_learnable": int(final.sampled < 0),
            "proposer/num_trajectories": sum(len(a.questions) for a in run.attempts),
            "proposer/num_integrated": len(integrated),
            "proposer/reward_mean": p_mean,
        }
        first_scores = [s for q in first.questions for s in q.scores]  # before any filtering
        if first_scores:
            m["solver/first_attempt_reward_mean"] = float(np.mean([s["reward"] for s in first_scores]))
            m["solver/first_attempt_solve_rate"] = float(np.mean([s.get("completion", 0.0) for s in first_scores]))
        if solver:
            s_mean = float(np.mean([t.reward for t in solver]))
            m.update(
                {
                    "harm/safety_score_mean": float(np.mean([t.scores.get("safety", 0.0) for t in solver])),
                    "harm/completion_score_mean": float(np.mean([t.scores.get("completion", 0.0) for t in solver])),
                    "harm/combined_reward_mean": s_mean,
                }
            )
            if self.algo.mode == "joint":
                m["joint/combined_reward_mean"] = s_mean + self.algo.proposer_weight * p_mean
                m["joint/proposer_solver_ratio"] = p_mean / s_mean if s_mean else 0.0
        return m

    def _decision(self, run: PromptRun, rewards: list[float], chosen: list[int], version: int) -> dict:
        cut = self.algo.record_max_chars
        return {
            "algorithm": "absolute_zero",
            "mode": self.algo.mode,
            "proposer_update": self.algo.proposer_update,
            "domain": self.algo.domain,
            "policy_version": version,
            "seed_prompt": run.seed.prompt[-1]["content"][:cut] if run.seed.prompt else "",
            "dimensions": [d.__dict__ for d in self.dims],
            "attempts": [
                {
                    "attempt": a.number,
                    "status": a.status,
                    "sampled_index": a.sampled,
                    "questions": [_question_record(q, cut) for q in a.questions],
                }
                for a in run.attempts
            ],
            "repropose_attempts": len(run.attempts) - 1,
            "final_status": run.final.status,
            "kept": run.final.sampled >= 0,
            "sampled_index": run.final.sampled,
            "proposer_rewards": rewards,
            "proposer_integrated": chosen if self.algo.mode == "joint" else [],
        }


def _question_record(q: Question, cut: int) -> dict:
    p = q.proposal
    return {
        "index": q.index,
        "proposal": p.text[:cut],
        "valid": p.valid,
        "reason": p.reason,
        "question": p.task.prompt[-1]["content"][:cut] if p.task else None,
        "answer": p.gold[:cut],
        "learnable": q.learnable,
        "ratios": q.check.ratios,
        "passed": q.check.passed,
        "responses": [c.texts[-1][:cut] if c.texts else "" for c in q.solver],
        "rewards": [s.get("reward", 0.0) for s in q.scores],
        "solve_rate": float(np.mean([s.get("completion", 0.0) for s in q.scores])) if q.scores else None,
        "score_errors": q.score_errors,
    }
