"""The token trace (issue 67): every ``log.sample_every`` steps, for up to ``log.trace_rows`` rows of
the batch, what the loss saw on each token, as a ``token_trace`` event the UI's Tokens tab and the
notebooks read.

Per row: its trajectory's summary (sample type, which is the role for Absolute Zero and the level for
RLCR; reward; the advantage it was trained with) and, per token (the last ``log.sample_max_tokens``),
its text, its ``role`` (``prompt``; ``generated``: trained, loss mask 1; ``environment``: a later
turn's tokens the environment wrote, loss mask 0 inside the response; ``replayed``: off-policy
tokens of experience replay) and, on generated and replayed tokens: the version that generated it,
the behaviour log-prob (the engine's), the learner's log-prob (this step's policy before its
update), the old log-prob the ratio is taken against, the behaviour weight (the off-policy
correction), the ratio, the advantage, and flags: ``is_capped`` / ``is_masked`` (the correction
truncated or zeroed the weight), ``clipped`` / ``dual_clipped`` (the loss took its clipped branch),
``blocked`` (the trust region around the behaviour policy removed its gradient) and ``dropped``
(trained by the trajectory's mask, but out of the loss: the staleness bound truncated it, or
overlong filtering).

The learner's log-probs come from a forward of those rows before the step (the model that
publishes: one process's own, a group's full copy), so the step itself is unchanged.
"""

from __future__ import annotations

import torch

ROLES = ("prompt", "generated", "environment", "replayed")
_FLOATS = ("behaviour", "learner", "old", "weight", "ratio", "token_advantage")
_FLAGS = ("is_capped", "is_masked", "clipped", "dual_clipped", "blocked")


def pick_rows(n: int, k: int) -> list[int]:
    """Up to ``k`` of ``n`` rows, spread evenly over the batch (its first and last among them)."""
    if n <= 0 or k <= 0:
        return []
    if k >= n:
        return list(range(n))
    if k == 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


class TokenTrace:
    def __init__(self, trainer, model, tokenizer, log_cfg):
        """``log_cfg``: the run's ``log`` settings (``sample_every``, ``trace_rows``, ``sample_max_tokens``)."""
        self.trainer, self.model, self.tokenizer = trainer, model, tokenizer
        self.every, self.rows, self.max_tokens = log_cfg.sample_every, log_cfg.trace_rows, log_cfg.sample_max_tokens

    def before(self, batch, version: int) -> tuple[list[int], torch.Tensor] | None:
        """On a traced step (the step that makes ``version + 1``): the rows to trace and the
        learner's log-probs of them before the update; None otherwise."""
        step = version + 1
        if not self.every or not self.rows or step % self.every or batch is None:
            return None
        index = pick_rows(batch.batch_size, self.rows)
        return index, self.trainer.logprobs(self.model, batch.take(index))

    def record(self, batch, traced: tuple[list[int], torch.Tensor], episodes: list) -> list[dict]:
        """The rows of a ``token_trace`` event (module docstring); ``episodes``: the batch's, in the
        order their trajectories are its rows."""
        index, logp = traced
        rows = [(ep, t) for ep in episodes for t in ep.trajectories]
        per = {k: v.detach().cpu() for k, v in self.trainer.trace_tokens(batch, index, logp).items()}
        out = []
        for i, b in enumerate(index):
            episode, traj = rows[b]
            row = self._row(traj, episode, {k: v[i] for k, v in per.items()})
            row["advantage"] = round(float(batch.row_advantages[b]), 6)
            out.append(row)
        return out

    def _row(self, traj, episode, per: dict[str, torch.Tensor]) -> dict:
        n = len(traj.token_ids)
        start = max(0, n - self.max_tokens)
        loss, exp = traj.loss_mask, traj.off_policy_mask
        first = next((j for j in range(n) if loss[j] or (exp is not None and exp[j])), n)
        roles, cols = [], {k: [] for k in ("version", *_FLOATS, *_FLAGS, "dropped")}
        for j in range(start, n):
            replayed = exp is not None and bool(exp[j])
            role = "replayed" if replayed else "generated" if loss[j] else "prompt" if j < first else "environment"
            roles.append(role)
            t = j - 1  # (its target position: token j is predicted at j - 1)
            on = role in ("generated", "replayed") and 0 <= t < per["learner"].shape[0]
            cols["version"].append(int(per["version"][t]) if on else None)
            for k in _FLOATS:
                cols[k].append(round(float(per[k][t]), 4) if on else None)
            for k in _FLAGS:
                cols[k].append(int(bool(per[k][t])) if on and k in per else None)
            cols["dropped"].append(int(float(per["response_mask"][t]) == 0 and not replayed) if on else None)
        lo, hi = traj.version_range()
        return {
            **traj.summary(),  # (its sample type, reward, task, replayed or not, token counts)
            "episode_id": episode.id,
            "actor_id": episode.actor_id,
            "trajectory_id": traj.id,
            "task_id": episode.task.id if getattr(episode, "task", None) is not None else None,
            "oldest_version": lo,
            "newest_version": hi,
            "offset": start,
            "tokens": self.tokenizer.batch_decode(
                [[int(x)] for x in traj.token_ids[start:]], skip_special_tokens=False
            ),
            "role": roles,
            **cols,
        }
