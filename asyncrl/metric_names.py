"""Metric names by section: the learner's metrics without a ``prefix/`` of their own get one (what
they are about), so that the UI groups every metric and the trackers file no metric as a section
of its own. No heavy imports: the learner uses it for its tracker tags."""

from __future__ import annotations

# Metrics without a ``prefix/`` of their own, by what they are about; anything else with a prefix is
# grouped by it, anything left is "other".
_GROUP_OF = {
    "reward": ("reward_mean", "reward_std", "reward_min", "reward_max"),
    "policy": ("loss", "pg_loss", "kl", "approx_kl", "entropy", "grad_norm", "lr", "clipfrac", "clipfrac_lower",
               "dual_clip_frac", "ratio_mean", "ratio_min", "ratio_max", "is_weight_mean", "is_weight_max",
               "is_weight_capped_frac", "is_weight_masked_frac", "nonfinite_steps", "skipped_nonfinite"),
    "rollout": ("response_length_mean", "response_length_max", "response_length_min", "batch_tokens",
                "batch_trajectories"),
    "staleness": ("staleness_mean", "staleness_max", "dropped_stale"),
    "learner": ("buffer_size", "in_flight", "episodes_acked", "bad_messages", "rejected_episodes"),
    "throughput": ("episodes_per_s", "samples_per_s", "tokens_per_s", "train_s", "wait_s", "ingest_s"),
}
GROUP_OF = {name: group for group, names in _GROUP_OF.items() for name in names}
# The order groups are shown in: what a reader of an RL run looks at first
GROUP_ORDER = ("reward", "eval", "score", "policy", "rollout", "groups", "staleness", "sync", "replay", "learner",
               "throughput", "env")


def metric_group(name: str) -> str:
    """The section a metric belongs to: its own ``prefix/``, else what it is about (``policy`` for
    ``loss``, ``throughput`` for ``tokens_per_s``...), else ``other``."""
    if "/" in name:
        return name.split("/", 1)[0]
    return GROUP_OF.get(name, "other")


def tag(name: str) -> str:
    """The metric's name with its section as a prefix (``policy/loss``, ``eval/accuracy``): the tag
    trackers file it under, so that no metric is a section of its own."""
    return name if "/" in name else f"{metric_group(name)}/{name}"
