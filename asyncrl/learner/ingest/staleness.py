"""How stale trained data may be, decided in one place (``buffer.max_staleness``, ``buffer.stale_tokens``).

One :class:`StalenessPolicy` is built from the config by the learner and handed to what acts on it:

- the credit limit (:meth:`credit_pool`): credits are granted only while ``in_flight + buffered``
  stays below ``(max_staleness + 1) * batch_tasks`` (AReaL's capacity rule), at most the buffer's
  capacity, which bounds the staleness of what arrives;
- the buffer's drop rule (:meth:`too_old`, :class:`.buffer.EpisodeQueue`):
  an episode older than ``max_staleness`` is dropped, judged by its oldest token (``drop``) or by its
  newest (``keep`` and ``truncate``: rows made across in-flight updates);
- the token truncation (:meth:`truncate`): under ``truncate`` the tokens of a kept row that are
  older than the bound get no loss;
- the trainer's token-lag statistics (``staleness/token_frac_past_bound``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from ...config import BufferConfig, TrainConfig
from ...types import Episode

_BUFFER, _TRAIN = BufferConfig.model_fields, TrainConfig.model_fields  # the defaults are the config's
STALE_TOKENS = get_args(_BUFFER["stale_tokens"].annotation)


@dataclass(frozen=True)
class StalenessPolicy:
    max_staleness: int = _BUFFER["max_staleness"].default
    stale_tokens: str = _BUFFER["stale_tokens"].default
    batch_tasks: int = _TRAIN["batch_tasks"].default
    capacity: int = _BUFFER["capacity"].default

    def __post_init__(self) -> None:
        if self.stale_tokens not in STALE_TOKENS:
            raise ValueError(f"unknown buffer.stale_tokens {self.stale_tokens!r}; valid: {', '.join(STALE_TOKENS)}")
        if self.max_staleness < 0:
            raise ValueError(f"buffer.max_staleness must be >= 0; got {self.max_staleness}")

    @classmethod
    def from_config(cls, cfg) -> "StalenessPolicy":
        return cls(
            max_staleness=cfg.buffer.max_staleness,
            stale_tokens=cfg.buffer.stale_tokens,
            batch_tasks=cfg.train.batch_tasks,
            capacity=cfg.buffer.capacity,
        )

    def credit_pool(self) -> int:
        """Most episodes generated or waiting at once (in flight + buffered)."""
        return min((self.max_staleness + 1) * self.batch_tasks, self.capacity)

    def age(self, episode: Episode, version: int) -> int:
        """``version`` minus the version the episode is judged by (its newest token's unless ``drop``)."""
        return version - (episode.policy_version if self.stale_tokens == "drop" else episode.newest_version)

    def too_old(self, episode: Episode, version: int) -> bool:
        return self.age(episode, version) > self.max_staleness

    def truncate(self, batch, version: int) -> int:
        """Under ``truncate``: no loss on the batch's tokens older than the bound; returns how many."""
        return batch.truncate_stale(version, self.max_staleness) if self.stale_tokens == "truncate" else 0
