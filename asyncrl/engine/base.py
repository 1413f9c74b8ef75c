"""The generation-engine contract shared by the Hugging Face and vLLM back ends.

An engine turns token-id prompts into sampled continuations and reports, for every generated token,
the behaviour log-probability ``log softmax(logits / temperature)[token]`` under the weights it used
(``version``). Log-probs are taken before any top-p filtering, so that they are what the learner
recomputes with the same temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from ..config import SamplingConfig

FINISH_REASONS = ("stop", "length")


@dataclass
class Generation:
    """One sampled continuation of one prompt.

    ``token_ids`` and ``logprobs`` have the same length ``L`` (generated tokens only, no prompt, no
    padding; the EOS token is included when it was generated).
    """

    token_ids: np.ndarray  # int32 [L]
    logprobs: np.ndarray  # float32 [L]
    text: str  # decoded generated text without special tokens
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    versions: np.ndarray | None = None  # int32 [L]: the policy version that made each token (None: the engine's)
    # int16 [P + L, layers x top_k]: the experts each token of prompt + generation went to (routing replay,
    # asyncrl.engine.routing; -1 where no forward read the token); None: not recorded
    routing: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.token_ids = np.ascontiguousarray(self.token_ids, dtype=np.int32)
        self.logprobs = np.ascontiguousarray(self.logprobs, dtype=np.float32)
        if self.versions is not None:
            self.versions = np.ascontiguousarray(self.versions, dtype=np.int32)
            if self.versions.shape != self.token_ids.shape:
                raise ValueError(
                    f"Generation: versions {self.versions.shape} must match token_ids {self.token_ids.shape}"
                )
        if self.routing is not None:
            self.routing = np.ascontiguousarray(self.routing, dtype=np.int16)
            if self.routing.ndim != 2 or self.routing.shape[0] < len(self.token_ids):
                raise ValueError(
                    f"Generation: routing {self.routing.shape} must be 2-D with a row for every prompt and "
                    f"generated token (at least the {len(self.token_ids)} generated)"
                )
        if self.token_ids.shape != self.logprobs.shape or self.token_ids.ndim != 1:
            raise ValueError(
                f"Generation: token_ids {self.token_ids.shape} and logprobs "
                f"{self.logprobs.shape} must be 1-D of the same length"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Generation.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")


def token_versions(gen: Generation, version: int) -> list[int]:
    """The per-token policy versions of ``gen`` (``version`` for each token where it has none)."""
    return gen.versions.tolist() if gen.versions is not None else [int(version)] * len(gen.token_ids)


@runtime_checkable
class Engine(Protocol):
    """What actors need from a generation back end."""

    version: int  # policy version of the weights in use
    eos_ids: "set[int] | list[int]"  # tokens that end a generation (kept as its last token)
    # optional: ``tokens_generated``, an int counting generated tokens as they come. The actor's heartbeat
    # reports it, and the learner keeps an actor's credits while it advances (a batch that takes minutes)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seed: int | None = None) -> list[Generation]:
        """One ``Generation`` per prompt (callers repeat a prompt ``n`` times for a group)."""
        ...

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights (the learner's ``named_parameters`` names, CPU or GPU tensors) in place
        and set ``version``; unknown names or wrong shapes raise ValueError before anything loads."""
        ...
