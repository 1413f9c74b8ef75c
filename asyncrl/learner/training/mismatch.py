"""Train/inference mismatch every step, not only when an actor is current (``train.mismatch_rows``).

The trainer measures the tokens generated with the learner's current weights (lag 0, in the step's
own forward: ``trainer.mismatch_stats``). In an async run most tokens come from an older version,
so the learner also keeps the weights it published for the last ``train.mismatch_versions``
versions (its trainable tensors: LoRA's adapters only) and, each step, runs up to
``train.mismatch_rows`` rows holding such tokens through a scratch copy of the model loaded with
the version that generated them. ``mismatch/*`` is then token-weighted over both (``mismatch/tokens``
and ``mismatch/lagged_tokens`` say how many of each). What is compared is the engine's behaviour
log-prob of each generated token against the learner's for the same weights and the same sampling
temperature (docs/guide/guarantees.md has each engine's log-prob contract).
"""

from __future__ import annotations

import copy
import time

import torch

from .batch import TrainBatch


class LaggedMismatch:
    def __init__(self, trainer, model, keep: int, rows: int, budget: float = 1.0):
        """``budget``: the share of the learner's step time the measurement may take over the run
        (``train.mismatch_budget``); a step is measured when the time spent so far allows it."""
        self.trainer, self.keep, self.rows, self.budget = trainer, keep, rows, budget
        self.spent = self.stepped = 0.0  # seconds measuring, seconds of the steps
        self.names = {n for n, p in model.named_parameters() if p.requires_grad}
        self.scratch = copy.deepcopy(model).eval().requires_grad_(False)  # (never trained: no optimizer state)
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        self._loaded: int | None = None

    def remember(self, version: int, state: dict[str, torch.Tensor], copied: bool) -> None:
        """The weights published as ``version`` (``state``: what the learner sent, by parameter name;
        ``copied``: already a snapshot no later update changes)."""
        mine = {k: (v if copied else v.detach().clone()) for k, v in state.items() if k in self.names or not self.names}
        self.kept[version] = mine
        for old in sorted(self.kept)[: -(self.keep + 1)]:
            del self.kept[old]

    def due(self) -> bool:
        """Whether this step may be measured within the budget."""
        return self.spent <= self.budget * self.stepped

    def note_step(self, seconds: float) -> None:
        self.stepped += seconds

    @torch.no_grad()
    def measure(self, batch: TrainBatch, version: int) -> dict[str, float]:
        """``mismatch/lagged_*`` over up to ``rows`` rows of tokens made by a kept older version
        (``mismatch/lagged_s``: the seconds it took)."""
        t0 = time.perf_counter()
        fresh = (batch.response_mask > 0) & (batch.exp_mask == 0)
        versions = batch.token_versions.to(batch.response_mask.device)
        diffs, kls = [], []
        budget = self.rows
        for v in sorted((v for v in self.kept if v < version), reverse=True):
            if budget <= 0:
                break
            m = fresh & (versions == v)
            counts = m.sum(dim=1)
            index = [int(i) for i in torch.argsort(counts, descending=True)[:budget] if counts[i] > 0]
            if not index:
                continue
            budget -= len(index)
            self._load(v)
            sub = batch.take(index)
            logp = self.trainer.logprobs(self.scratch, sub)
            sm = (sub.response_mask > 0) & (sub.exp_mask == 0) & (sub.token_versions.to(logp.device) == v)
            log_r = (logp - sub.behavior_logprobs.to(logp.device))[sm].double()
            diffs.append(log_r.abs())
            kls.append(log_r.exp() - log_r - 1)
        self.spent += time.perf_counter() - t0
        if not diffs:
            return {}
        diff, kl = torch.cat(diffs), torch.cat(kls)
        return {
            "mismatch/lagged_logprob_abs_diff_mean": float(diff.mean()),
            "mismatch/lagged_logprob_abs_diff_max": float(diff.max()),
            "mismatch/lagged_kl": float(kl.mean()),
            "mismatch/lagged_tokens": float(diff.numel()),
            "mismatch/lagged_s": time.perf_counter() - t0,
        }

    def _load(self, version: int) -> None:
        if self._loaded != version:
            self.scratch.load_state_dict(self.kept[version], strict=False)
            self._loaded = version


def merge_mismatch(stats: dict[str, float], lagged: dict[str, float]) -> dict[str, float]:
    """``mismatch/*`` over the current version's tokens and the lagged ones, token-weighted."""
    if not lagged:
        return {}
    n0, n1 = stats.get("mismatch/tokens", 0.0), lagged["mismatch/lagged_tokens"]
    out = {**lagged, "mismatch/current_tokens": n0}
    if not n0:
        out.update(
            {
                "mismatch/logprob_abs_diff_mean": lagged["mismatch/lagged_logprob_abs_diff_mean"],
                "mismatch/logprob_abs_diff_max": lagged["mismatch/lagged_logprob_abs_diff_max"],
                "mismatch/kl": lagged["mismatch/lagged_kl"],
                "mismatch/tokens": n1,
            }
        )
        return out
    w0, w1 = n0 / (n0 + n1), n1 / (n0 + n1)
    out.update(
        {
            "mismatch/logprob_abs_diff_mean": w0 * stats["mismatch/logprob_abs_diff_mean"]
            + w1 * lagged["mismatch/lagged_logprob_abs_diff_mean"],
            "mismatch/logprob_abs_diff_max": max(
                stats["mismatch/logprob_abs_diff_max"], lagged["mismatch/lagged_logprob_abs_diff_max"]
            ),
            "mismatch/kl": w0 * stats["mismatch/kl"] + w1 * lagged["mismatch/lagged_kl"],
            "mismatch/tokens": n0 + n1,
        }
    )
    return out
