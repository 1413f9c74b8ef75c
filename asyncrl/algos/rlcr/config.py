"""RLCR's ``algo:`` section."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_SYSTEM_PROMPT = "Answer in tags."
DEFAULT_CONFIDENCE_PROMPT = "Confidence (0-1)?"


class RLCRConfig(BaseModel):
    """The ``algo:`` section for ``algorithm: rlcr``."""

    model_config = ConfigDict(extra="forbid")

    num_generations_answer: int = Field(
        4,
        ge=1,
        description=(
            "G_a: answers sampled per prompt (turn 1), normalised together. 1 leaves answers no baseline (advantage 0)."
        ),
    )
    num_generations_confidence: int = Field(
        4,
        ge=1,
        description=(
            "G_c: confidences sampled per answer (turn 2), normalised together. 1 leaves confidences no "
            "baseline (advantage 0)."
        ),
    )
    lambda_ans: float = Field(1.0, ge=0, description="Scale of the answer advantages.")
    lambda_conf: float = Field(1.0, ge=0, description="Scale of the confidence advantages.")
    norm_by_std: bool = Field(
        False, description=("Divide advantages by their group's std (see std); false: A = R - mean (Dr.GRPO).")
    )
    std: Literal["population", "unbiased"] = Field(
        "population",
        description=(
            "Group std used with norm_by_std: 'population' (divide by G, the RLCR reference design's formula) "
            "or 'unbiased' (G - 1, verl's; about 1.15x larger at G = 4)."
        ),
    )
    ece_bins: Literal["left_closed", "right_closed"] = Field(
        "right_closed",
        description=(
            "Held-out ECE and reliability bins: 'right_closed' (b/10, (b+1)/10] (default: the reference ECE code's, "
            "Guo et al. 2017; 0.0 in the first bin) or 'left_closed' [b/10, (b+1)/10) (1.0 in the last bin; the "
            "default before 2026-11-26). Confidences on the 0.1 grid sit on bin edges, so the choice moves ECE; "
            "every eval record names the one used (ece_bins)."
        ),
    )
    verifier: Literal["auto", "numeric", "math", "exact_match"] = Field(
        "auto",
        description=(
            "Answer check: 'numeric' (exact number), 'math' (math-verify), 'exact_match' (normalised "
            "string), 'auto' (task.metadata['verifier'], else numeric for numeric golds, else exact_match)."
        ),
    )
    system_prompt: str | None = Field(
        DEFAULT_SYSTEM_PROMPT,
        description=(
            "System message put before each task's prompt (unless it has one); null: none. The embedded "
            "model's rlcr warm-start format uses the default."
        ),
    )
    confidence_prompt: str = Field(
        DEFAULT_CONFIDENCE_PROMPT,
        min_length=1,
        description=("The user message that asks for a confidence in turn 2 (the warm start uses the default)."),
    )
    answer_max_new_tokens: int | None = Field(
        None, ge=1, description=("Turn-1 token budget; null: sampling.max_new_tokens.")
    )
    confidence_max_new_tokens: int | None = Field(
        None, ge=1, description=("Turn-2 token budget; null: sampling.max_new_tokens.")
    )
