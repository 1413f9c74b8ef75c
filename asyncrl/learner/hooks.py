"""The learner's hook boundary: what a learner-side extension (experience replay) may do.

A hook sees each batch before it is collated and each step's result after it, and may add fields
to actors' credit messages and files to checkpoints. The trainer knows nothing about hooks: it
takes loss inputs and returns a :class:`asyncrl.learner.training.trainer.TrainStepResult`.

Per step the learner calls, in order: ``before_batch`` (it may add trajectories to episodes),
the trainer's step (with per-row log-probs and entropies when ``needs_rows``), ``after_step``
(returns metrics; it may rename the step's own statistics it owns: ``owned_stats``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Protocol

from ..types import Episode
from .training.trainer import TrainStepResult


class LearnerHook(Protocol):
    needs_rows: ClassVar[bool]  # the step must return per-row log-probs and entropies
    owned_stats: ClassVar[frozenset[str]]  # step statistics this hook reports under its own names

    def before_batch(self, episodes: list[Episode], version: int) -> None:
        """Called with the episodes of the next batch (they may be changed in place)."""

    def after_step(self, episodes: list[Episode], result: TrainStepResult | None, version: int) -> dict[str, float]:
        """Called after the step that trained ``episodes`` at ``version`` (``result`` None when
        the batch had no rows); returns metrics for ``metrics.jsonl``."""

    def credit_work(self, actor: Any, n: int, version: int) -> dict[str, Any]:
        """Fields added to ``actor``'s credit message for ``n`` credits (``asyncrl.wire.messages.Credit``)."""

    def save(self, directory: Path) -> None:
        """Write this hook's state into a checkpoint being made."""

    def load(self, directory: Path, version: int) -> None:
        """Restore from a checkpoint's ``directory`` (it may hold no state of this hook)."""

    def checkpoint_saved(self, path: Path, version: int) -> None:
        """Called after a checkpoint at ``path`` was renamed into place."""
