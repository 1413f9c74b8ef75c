"""The ``algo:`` section of ``algorithm: absolute_zero`` (defaults are the Absolute Zero paper's)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ...envs.judge import JudgeConfig
from ...sandbox.arith import ArithLimits
from ...sandbox.python import SandboxLimits, isolation_problem, isolation_warning
from . import code_o as _code_o  # noqa: F401  (registers the domain)
from . import harm as _harm  # noqa: F401  (registers the domain)
from .filter import Dimension

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
    return {
        "safety": DimensionConfig(direction="above"),  # learnability_safety_threshold & safe ratio
        "completion": DimensionConfig(direction="below"),
    }  # completion threshold & incomplete ratio


class AbsoluteZeroConfig(BaseModel):
    """``algo:`` section of ``algorithm: absolute_zero``. Defaults are the seeds'."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["unified", "joint"] = Field(
        "unified",
        description=(
            "unified (learnability filter, solver trained only); joint: also train the proposer (docs/algorithms/absolute_zero.md)."
        ),
    )
    proposer_update: Literal["sampled", "group"] = Field(
        "sampled",
        description=(
            "joint mode: 'sampled' (seed) trains the sampled question's proposer row only; 'group' trains "
            "every question of the final group with its learnability as reward, normalised in the group."
        ),
    )
    domain: str = Field("arithmetic", description="Self-play domain: arithmetic, code_o or harm.")
    questions_per_prompt: int = Field(
        4,
        description=(
            "Questions in one proposed question group (k >= 2: the group must be able to mix learnable and "
            "unlearnable questions)."
        ),
    )
    rollout_n: int | None = Field(None, ge=1, description="Solver responses per question (null: sampling.n).")
    max_steps: int = Field(1, ge=1, description="Solver environment turns per response (reset/step loop).")
    max_repropose_attempts: int = Field(3, ge=0, description="Re-proposals of a group that is not mixed.")
    learnability: dict[str, DimensionConfig] = Field(
        default_factory=_seed_dimensions, min_length=1, description="Learnability dimensions by name (all must pass)."
    )
    safety_reward_weight: float = Field(0.7, description="Solver reward weight of the safety score.")
    task_completion_weight: float = Field(0.3, description="Solver reward weight of the completion score.")
    format_weight: float = Field(0.5, description="Solver reward weight of the format score (turns ended by EOS).")
    proposer_weight: float = Field(0.1, ge=0, description="Scale of proposer advantages in joint mode.")
    proposer_max_new_tokens: int = Field(12, ge=1, description="Token budget of one proposal.")
    arithmetic: ArithLimits = Field(default_factory=ArithLimits, description="Safe evaluator bounds (arithmetic).")
    sandbox: SandboxLimits = Field(
        default_factory=SandboxLimits,
        description=("code_o: isolation (bwrap, remote or none) and limits of the sandbox that runs proposals."),
    )
    sandbox_workers: int = Field(2, ge=1, description="code_o: sandboxed runs in parallel.")
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="LLM judge endpoint (harm).")
    harm_max_chars: int = Field(2000, ge=1, description="harm: longest proposed instruction.")
    record_max_chars: int = Field(300, ge=16, description="Texts in the decision record are cut to this.")

    @field_validator("questions_per_prompt")
    @classmethod
    def _mixable(cls, k: int) -> int:
        if k < 2:
            raise ValueError(
                "must be at least 2: a one-question group is never mixed (learnable and not "
                "learnable), so no solver group would ever be kept and every proposer reward would "
                "be the same -0.5: nothing would be learned"
            )
        return k

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
        return [
            Dimension(name, d.score or name, d.threshold, d.direction, d.min_ratio, d.max_ratio)
            for name, d in self.learnability.items()
        ]
