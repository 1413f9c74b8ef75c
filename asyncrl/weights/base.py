"""The weight-sync interface: how a new version of the policy reaches the actors.

The learner's ``weights`` channel (``asyncrl.learner.ingest.server``) delivers one ``weights`` message per
version to each subscriber; a transport decides what that message carries and how the tensors
travel:

- a :class:`WeightPublisher` (learner side) turns ``(state, version)`` into the message's frames;
- a :class:`WeightReceiver` (actor side) turns a received message into ``(version, tensors)``
  that ``Engine.update_weights`` loads.

``asyncrl.weights.make_publisher`` and ``make_receiver`` pick them by ``sync.type``.

The version tag travels in the message either way, so an actor always knows what it applied.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..wire.codec import Message


class WeightsError(ValueError):
    """A weights message this receiver cannot use; the text says what was wrong and expected."""


WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_weight_values(named: dict[str, torch.Tensor]) -> None:
    """WeightsError unless every tensor is a float32, bfloat16 or float16 tensor of finite values:
    run by the actor on every received version (full weights and LoRA adapters alike) before the
    engine takes any of it, so a broken or hostile version changes nothing."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in WEIGHT_DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise WeightsError(
                f"weights tensor {name!r} is {got}; weights are float32, bfloat16 or float16 "
                f"(nothing of this version was loaded)"
            )
        if t.numel() and not _finite(t):
            bad = int((~torch.isfinite(t)).sum())
            raise WeightsError(
                f"weights tensor {name!r} holds {bad} NaN or infinite value(s) of {t.numel()} "
                f"(nothing of this version was loaded)"
            )


def _finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in ``t``: its minimum and maximum are finite (a NaN propagates into both,
    +inf is the maximum, -inf the minimum). One vectorised pass, 15-40x faster on a CPU than
    ``isfinite(t).all()`` (418M bfloat16 values: about 50 ms on one core)."""
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


class WeightPublisher(Protocol):
    """What the learner calls (and nothing else: no attribute is probed)."""

    needs_snapshot: bool  # True: ``frames`` keeps the tensors it is given (the learner passes copies)

    def frames(self, state: dict[str, torch.Tensor], version: int, digest: str | None = None) -> list:
        """The frames of the ``weights`` message for ``version`` (``state``: name -> CPU tensor),
        carrying ``digest`` (``asyncrl.weights.digest``) for the actors' receipts."""
        ...

    def poll(self) -> None:
        """Housekeeping between steps (``nccl``: actors joining the group)."""
        ...

    def close(self) -> None:
        """Release what the transport holds (shared memory, sockets, groups)."""
        ...


class WeightReceiver(Protocol):
    def tensors(self, msg: Message) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, {name: tensor})`` from a received ``weights`` message, or WeightsError."""
        ...

    def close(self) -> None:
        """Release what the receiver holds (threads, shared memory)."""
        ...


class Publisher:
    """Defaults for a :class:`WeightPublisher`: keeps its input, no housekeeping, nothing to close."""

    needs_snapshot = True

    def poll(self) -> None:
        pass

    def close(self) -> None:
        pass


class Receiver:
    """Defaults for a :class:`WeightReceiver`: nothing to close."""

    def close(self) -> None:
        pass
