"""Reward shaping and masks from a response's length (DAPO, Yu et al. 2025): the soft overlong
punishment (``train.overlong_buffer``) added to the reward the advantage reads, and overlong
filtering (``train.mask_truncated``): responses cut off at the length limit left out of the loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ..types import Trajectory


def overlong_penalty(lengths: Sequence[float], max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment per response of ``lengths`` generated tokens, ``[N]`` float64:
    0 up to ``max_len - buffer`` tokens, then ``-factor * (L - (max_len - buffer)) / buffer`` (a
    linear ramp to ``-factor`` at ``max_len``), ``-factor`` beyond it."""
    if buffer <= 0 or buffer >= max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}); got {buffer}")
    n = torch.as_tensor(list(lengths), dtype=torch.float64)
    over = (n - (max_len - buffer)).clamp(min=0.0, max=float(buffer))
    return -factor * over / buffer


def truncated(trajectory: Trajectory) -> bool:
    """The response was cut off at the length limit: its last turn's finish reason is ``length``
    (``metadata['finish_reasons']``, which every built-in rollout records)."""
    reasons = trajectory.metadata.get("finish_reasons") or []
    return bool(reasons) and reasons[-1] == "length"


@dataclass(frozen=True)
class LengthShaping:
    """``train.overlong_*`` and ``train.mask_truncated`` for a batch of trajectories."""

    buffer: int = 0
    max_len: int = 0
    factor: float = 1.0
    mask_truncated: bool = False

    @classmethod
    def from_config(cls, train_cfg) -> "LengthShaping":
        return cls(
            buffer=train_cfg.overlong_buffer,
            max_len=train_cfg.overlong_max_len or 0,
            factor=train_cfg.overlong_penalty,
            mask_truncated=train_cfg.mask_truncated,
        )

    def penalties(self, trajs: Sequence[Trajectory]) -> Tensor | None:
        """``[N]`` rewards to add (float64), or None when the punishment is off."""
        if not self.buffer:
            return None
        return overlong_penalty([t.num_generated for t in trajs], self.max_len, self.buffer, self.factor)

    def dropped_rows(self, trajs: Sequence[Trajectory]) -> list[int]:
        """The rows overlong filtering leaves out of the loss (none when it is off)."""
        return [i for i, t in enumerate(trajs) if truncated(t)] if self.mask_truncated else []
