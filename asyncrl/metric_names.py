"""Metric names by section: the learner's metrics without a ``prefix/`` of their own get one (what
they are about), so that the UI groups every metric and the trackers file no metric as a section
of its own. No heavy imports: the learner uses it for its tracker tags."""

from __future__ import annotations

# Metrics without a ``prefix/`` of their own, by what they are about; anything else with a prefix is
# grouped by it, anything left is "other".
_GROUP_OF = {
    "reward": ("reward_mean", "reward_std", "reward_min", "reward_max"),
    "policy": (
        "loss",
        "pg_loss",
        "kl",
        "approx_kl",
        "entropy",
        "grad_norm",
        "lr",
        "clipfrac",
        "clipfrac_lower",
        "dual_clip_frac",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
        "is_weight_mean",
        "is_weight_max",
        "is_weight_capped_frac",
        "is_weight_masked_frac",
        "behavior_clipfrac",
        "nonfinite_steps",
        "skipped_nonfinite",
    ),
    "rollout": (
        "response_length_mean",
        "response_length_max",
        "response_length_min",
        "batch_tokens",
        "batch_trajectories",
    ),
    "staleness": ("staleness_mean", "staleness_max", "dropped_stale"),
    "learner": ("buffer_size", "in_flight", "episodes_acked", "bad_messages", "rejected_episodes"),
    "throughput": ("episodes_per_s", "samples_per_s", "tokens_per_s", "train_s", "wait_s", "ingest_s"),
}
GROUP_OF = {name: group for group, names in _GROUP_OF.items() for name in names}
# The order groups are shown in: what a reader of an RL run looks at first
GROUP_ORDER = (
    "reward",
    "eval",
    "score",
    "policy",
    "critic",
    "rollout",
    "groups",
    "dynamic_sampling",
    "staleness",
    "sync",
    "replay",
    "learner",
    "throughput",
    "env",
)


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


# What a metric's value counts over: most are per step; these are totals since the learner started
# (its process: a resume starts them again), and the eval metrics are per evaluation.
CUMULATIVE = frozenset(
    {
        "episodes_acked",
        "ingest_s",
        "dropped_stale",
        "bad_messages",
        "rejected_episodes",
        "nonfinite_steps",
        "dynamic_sampling/dropped_total",
    }
)
_UNITS = {
    "_s": "seconds",
    "_frac": "fraction",
    "_tokens": "tokens",
    "tokens": "tokens",
    "length_mean": "tokens",
    "length_max": "tokens",
    "length_min": "tokens",
    "lr": "learning rate",
}


def metric_span(name: str) -> str:
    """``cumulative`` (a total since the learner process started), ``per evaluation`` (``eval/*``)
    or ``per step``: said on the metric's chart."""
    if name in CUMULATIVE:
        return "cumulative"
    if name.startswith("eval/"):
        return "per evaluation"
    return "per step"


def metric_unit(name: str) -> str:
    """The unit of the metric's values for its chart's y axis (``seconds``, ``per second``, ``tokens``...),
    from its name's ending; the name itself where there is none to say."""
    base = name.rsplit("/", 1)[-1]
    if base.endswith("_per_s"):
        return base[: -len("_per_s")].replace("_", " ") + " per second"
    if base.startswith("tokens_"):
        return "tokens"
    for end, unit in _UNITS.items():
        if base.endswith(end) and (end.startswith("_") or base == end or end.startswith("length")):
            return unit
    return base
