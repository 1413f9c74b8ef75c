"""Rewards -> advantages, for every algorithm, on either side of the wire.

Estimators live in a registry keyed by ``train.advantage.estimator`` (verl's shape: one scalar per
trajectory from the rewards of its group). The learner applies :func:`trajectory_advantages` to
every batch; a workflow that needs its own normalisation (RLCR's two levels) calls the same
estimators on the actor and carries the result in ``Trajectory.advantage``. Either way the
trajectory's typed ``advantage_scale`` (e.g. Absolute Zero's proposer weight) multiplies the result.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Callable, Sequence, get_args

import torch
from torch import Tensor

from ..config import AdvantageConfig
from ..registry import Registry
from ..types import Trajectory

ADV_ESTIMATORS: Registry[Callable[..., Tensor]] = Registry("advantage estimator")


_ADV = AdvantageConfig.model_fields  # the choices and defaults are the config's, declared once there
SINGLETON_RULES = get_args(_ADV["singleton"].annotation)
STD_ESTIMATORS = get_args(_ADV["std"].annotation)
# ``train.advantage`` settings an estimator takes as keyword arguments when they differ from their defaults
_OPTIONS = ("singleton", "std")


def _groups(group_ids: Sequence[str]) -> list[list[int]]:
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    return list(members.values())


def _checked(rewards: Tensor, group_ids: Sequence[str], singleton: str) -> tuple[Tensor, torch.dtype]:
    """``rewards`` as float64 and the dtype to return, after checking shapes and the singleton rule."""
    if singleton not in SINGLETON_RULES:
        raise ValueError(f"unknown singleton rule {singleton!r}; valid: {', '.join(SINGLETON_RULES)}")
    rewards = torch.as_tensor(rewards).detach()
    if rewards.dim() != 1 or len(group_ids) != rewards.shape[0]:
        raise ValueError(
            f"rewards must be [N] with N == len(group_ids); got {tuple(rewards.shape)} and {len(group_ids)} group ids"
        )
    return rewards.to(torch.float64), rewards.dtype if rewards.is_floating_point() else torch.float32


def _by_group(
    r64: Tensor,
    group_ids: Sequence[str],
    singleton: str,
    lone: Callable[[Tensor], Tensor],
    many: Callable[[Tensor], Tensor],
) -> Tensor:
    """Per group of ``group_ids``: ``many(r)`` for a group of two or more, ``lone(r)`` for a group of one
    under ``singleton="verl"`` (0 under ``"zero"``)."""
    out = torch.zeros_like(r64)
    for idx in _groups(group_ids):
        ix = torch.tensor(idx, device=r64.device)
        r = r64[ix]
        if len(idx) >= 2:
            out[ix] = many(r)
        elif singleton == "verl":
            out[ix] = lone(r)
    return out


@ADV_ESTIMATORS.register("grpo")
def compute_grpo_advantages(
    rewards: Tensor,
    group_ids: Sequence[str],
    norm_by_std: bool = _ADV["norm_by_std"].default,
    eps: float = 1e-6,
    singleton: str = _ADV["singleton"].default,
    std: str = _ADV["std"].default,
) -> Tensor:
    """GRPO outcome advantage, one scalar per trajectory (Shao et al. 2024, DeepSeekMath).

    Args:
        rewards: ``[N]`` float.
        group_ids: ``N`` group keys; trajectories with equal keys are normalised together.
        norm_by_std: ``A = (R - mean_g) / (std_g + eps)``; ``False`` gives ``A = R - mean_g``
            (Dr.GRPO, Liu et al. 2025; ExGRPO; RLCR).
        singleton: a group of one: ``"zero"`` (ours: a lone trajectory has no baseline, A = 0) or
            ``"verl"`` (verl's convention, mean 0 and std 1: ``A = R / (1 + eps)`` with
            ``norm_by_std``, ``A = R`` without).
        std: ``"unbiased"`` (divide by n - 1, verl's ``torch.std``) or ``"population"`` (divide by
            n; the RLCR reference design's formula).
    Returns:
        ``[N]`` advantages (same dtype as ``rewards``, no grad). Computed in float64, and a group
        whose rewards are all equal gets exactly 0 (in float32 the mean of eight rewards of 0.7 is
        off by ~6e-8, which ``/ (std + 1e-6)`` would turn into advantages of ~0.06).
    """
    if std not in STD_ESTIMATORS:
        raise ValueError(f"unknown std estimator {std!r}; valid: {', '.join(STD_ESTIMATORS)}")
    r64, out_dtype = _checked(rewards, group_ids, singleton)

    def many(r: Tensor) -> Tensor:
        if bool((r == r[0]).all()):
            return torch.zeros_like(r)  # equal rewards: exactly 0, whatever the rounding of mean and std
        a = r - r.mean()
        return a / (r.std(unbiased=(std == "unbiased")) + eps) if norm_by_std else a

    # verl: mean 0, std 1 for a group of one
    return _by_group(r64, group_ids, singleton, lambda r: r / (1.0 + eps) if norm_by_std else r, many).to(out_dtype)


@ADV_ESTIMATORS.register("rloo")
def compute_rloo_advantages(
    rewards: Tensor,
    group_ids: Sequence[str],
    norm_by_std: bool = _ADV["norm_by_std"].default,
    singleton: str = _ADV["singleton"].default,
    **_: object,
) -> Tensor:
    """RLOO: each trajectory's baseline is the mean of the other rewards of its group (Kool et al.
    2019; Ahmadian et al. 2024), ``A_i = R_i - (sum_g R - R_i) / (n - 1) = n / (n - 1) (R_i - mean_g)``;
    never divided by a std (``norm_by_std`` does not apply). A group of one: ``"zero"`` gives 0 (no other
    sample to compare with), ``"verl"`` gives ``A = R`` (verl's ``compute_rloo_outcome_advantage``).
    A group of equal rewards gets exactly 0. Computed in float64; ``[N]`` in the rewards' dtype."""
    r64, out_dtype = _checked(rewards, group_ids, singleton)

    def many(r: Tensor) -> Tensor:
        if bool((r == r[0]).all()):
            return torch.zeros_like(r)
        return r - (r.sum() - r) / (len(r) - 1)

    return _by_group(r64, group_ids, singleton, lambda r: r, many).to(out_dtype)


def _whiten(scores: Tensor, lengths: Sequence[float] | None, norm_by_std: bool) -> Tensor:
    """verl's ``masked_whiten`` of a per-trajectory score spread on its generated tokens: the batch's
    token-weighted mean ``mu = sum(n_i s_i) / sum(n_i)`` subtracted and, with ``norm_by_std``, the
    result times ``1 / sqrt(var + 1e-8)`` with ``var`` the token-weighted variance with Bessel's
    correction (``sum(n_i (s_i - mu)^2) / (sum(n_i) - 1)``). ``lengths`` None: every trajectory one
    token. A batch of at most one token gets zeros (its variance is undefined)."""
    w = torch.ones_like(scores) if lengths is None else torch.as_tensor(lengths, dtype=torch.float64)
    if w.shape != scores.shape:
        raise ValueError(f"got {w.shape[0]} lengths for {scores.shape[0]} rewards")
    total = float(w.sum())
    if total <= 1.0:
        return torch.zeros_like(scores)
    mu = (w * scores).sum() / total
    centred = scores - mu
    if not norm_by_std:
        return centred
    var = (w * centred**2).sum() / (total - 1.0)
    return centred * torch.rsqrt(var + 1e-8)


@ADV_ESTIMATORS.register("reinforce_pp")
def compute_reinforce_pp_advantages(
    rewards: Tensor,
    group_ids: Sequence[str],
    norm_by_std: bool = _ADV["norm_by_std"].default,
    singleton: str = _ADV["singleton"].default,
    lengths: Sequence[float] | None = None,
    **_: object,
) -> Tensor:
    """REINFORCE++ (Hu et al. 2025) on an outcome reward: no group baseline; the batch's rewards
    whitened over all its generated tokens (:func:`_whiten`, verl's
    ``compute_reinforce_plus_plus_outcome_advantage`` with ``gamma = 1``), so every trajectory of
    the batch is compared with every other. ``lengths``: generated tokens per trajectory (the
    learner passes them). Groups are ignored; ``norm_by_std`` false only centres."""
    r64, out_dtype = _checked(rewards, group_ids, singleton)
    return _whiten(r64, lengths, norm_by_std).to(out_dtype)


def discounted_reinforce_pp(rewards: Tensor, mask: Tensor, gamma: float, norm_by_std: bool = True) -> Tensor:
    """REINFORCE++ with a discount (``train.advantage.gamma < 1``, estimator ``reinforce_pp``): token
    ``t`` of row ``b`` returns ``R_b gamma^k``, ``k`` the row's generated tokens after ``t`` (verl's
    ``compute_reinforce_plus_plus_outcome_advantage`` with the reward on the last token), then
    whitened over every generated token of the batch (verl's ``masked_whiten``). ``rewards[B]``,
    ``mask[B, T]``; returns float32 ``[B, T]``, 0 off the mask.

    Multi-turn rows: environment tokens (mask 0) neither count in ``k`` nor reset the return, so
    every turn gets the trajectory's outcome, discounted by the generated tokens between (verl resets
    the running return at mask-0 positions, so its earlier turns get nothing of a final reward).
    With ``gamma = 1`` every token gets ``R_b`` and this equals :func:`compute_reinforce_pp_advantages`
    spread on the tokens."""
    on = mask > 0
    after = on.flip(-1).long().cumsum(-1).flip(-1) - on.long()
    returns = torch.as_tensor(rewards, dtype=torch.float64)[:, None] * float(gamma) ** after.to(torch.float64)
    values = returns[on]
    if values.numel() <= 1:
        return torch.zeros_like(returns, dtype=torch.float32)
    centred = returns - values.mean()
    if norm_by_std:
        var = ((values - values.mean()) ** 2).sum() / (values.numel() - 1.0)
        centred = centred * torch.rsqrt(var + 1e-8)
    return (centred * on).to(torch.float32)


@ADV_ESTIMATORS.register("reinforce_pp_baseline")
def compute_reinforce_pp_baseline_advantages(
    rewards: Tensor,
    group_ids: Sequence[str],
    norm_by_std: bool = _ADV["norm_by_std"].default,
    singleton: str = _ADV["singleton"].default,
    lengths: Sequence[float] | None = None,
    **_: object,
) -> Tensor:
    """REINFORCE++-baseline (Hu et al. 2025): the group's mean reward subtracted (a group of one:
    ``"zero"`` gives it score 0, ``"verl"`` keeps ``R`` as verl does), then whitened over the whole
    batch's generated tokens (:func:`_whiten`; verl's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``). Unlike GRPO the scale is the batch's,
    and a group of equal rewards ends at ``-mu / sigma``, not exactly 0."""
    r64, out_dtype = _checked(rewards, group_ids, singleton)
    scores = _by_group(r64, group_ids, singleton, lambda r: r, lambda r: r - r.mean())
    return _whiten(scores, lengths, norm_by_std).to(out_dtype)


@ADV_ESTIMATORS.register("gae")
def compute_gae_row_advantages(rewards: Tensor, group_ids: Sequence[str], **_: object) -> Tensor:
    """GAE (``train.advantage.estimator: gae``) is per token, from the learner's critic
    (:func:`asyncrl.objectives.gae.gae`, run by :mod:`asyncrl.learner.training.critic`), not one
    scalar per trajectory: called as a trajectory estimator it refuses, in one line."""
    raise ValueError(
        "train.advantage.estimator=gae is computed per token by the learner's critic, not per "
        "trajectory (a workflow that normalises on the actor, e.g. RLCR, cannot use it)"
    )


compute_gae_row_advantages.per_token = True  # trajectory_advantages: the learner fills the advantages in


def per_token(estimator: Callable[..., Tensor]) -> bool:
    """Whether an estimator works per token on the learner (GAE) rather than per trajectory."""
    return bool(getattr(estimator, "per_token", False))


def takes_lengths(estimator: Callable[..., Tensor]) -> bool:
    """Whether an estimator accepts ``lengths`` (generated tokens per trajectory) as a keyword."""
    params = inspect.signature(estimator).parameters.values()
    return any(p.name == "lengths" or p.kind is p.VAR_KEYWORD for p in params)


def estimator_options(adv_cfg) -> dict:
    """The ``train.advantage`` settings beyond ``norm_by_std`` (``singleton``, ``std``) that differ
    from their defaults, as keyword arguments: an estimator registered without them keeps working
    as long as they are left at their defaults."""
    defaults = {k: _ADV[k].default for k in _OPTIONS}
    return {k: v for k, d in defaults.items() if (v := getattr(adv_cfg, k, d)) != d}


def rollouts(trajs: Sequence[Trajectory]) -> list[int]:
    """For each trajectory, the index of the rollout it belongs to (first appearance order): rows that
    share a ``group_id`` and a non-empty ``rollout_id`` (an agent rollout's unmerged calls) are one
    rollout, every other row is a rollout of its own."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    for i, t in enumerate(trajs):
        key = (t.group_id, t.rollout_id) if t.rollout_id else ("", f"#{i}")
        out.append(seen.setdefault(key, len(seen)))
    return out


def one_per_rollout(trajs: Sequence[Trajectory]) -> list[Trajectory]:
    """The first row of each rollout (:func:`rollouts`): what counts a rollout once (evaluation)."""
    out: list[Trajectory] = []
    for t, r in zip(trajs, rollouts(trajs)):
        if r == len(out):  # (rollouts are numbered in the order they first appear)
            out.append(t)
    return out


def trajectory_advantages(
    trajs: list[Trajectory], adv_cfg, estimator: Callable[..., Tensor] | None = None, shaping: Tensor | None = None
) -> Tensor:
    """Scalar advantage per trajectory ``[N]``: the estimator over ``group_id`` groups; a trajectory
    that carries its own (``Trajectory.advantage``, e.g. RLCR) keeps it. Each is then multiplied by
    its ``advantage_scale``; an estimator that works per token on the learner (GAE: :func:`per_token`)
    gives each trajectory its ``advantage_scale`` alone, which multiplies its per-token advantages
    there. ``estimator``: ``train.advantage.estimator`` already looked up (the trainer
    does so once). ``shaping``: ``[N]`` added to the rewards first (:mod:`.shaping`).

    The estimator sees one sample per rollout (:func:`rollouts`): the rows of one rollout count
    once in their group's baseline, with their mean (shaped) reward and, for the estimators that
    weigh by length, their generated tokens together; each row gets its rollout's advantage."""
    estimator = estimator or ADV_ESTIMATORS.get(adv_cfg.estimator)
    scale = torch.tensor([t.advantage_scale for t in trajs], dtype=torch.float32)
    if per_token(estimator):  # (GAE) each row's scale, which the critic multiplies into its per-token advantages
        return scale
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
    if shaping is not None:
        rewards = rewards + shaping.to(torch.float64)
    which = rollouts(trajs)
    k = max(which, default=-1) + 1
    index = torch.tensor(which, dtype=torch.long)
    if k < len(trajs):  # some rollouts have several rows: one sample each
        counts = torch.zeros(k, dtype=torch.float64).index_add_(0, index, torch.ones(len(trajs), dtype=torch.float64))
        sample_rewards = torch.zeros(k, dtype=torch.float64).index_add_(0, index, rewards) / counts
    else:
        sample_rewards = rewards
    group_ids: list[str] = []  # each rollout's group (rollouts are numbered in the order they first appear)
    for t, r in zip(trajs, which):
        if r == len(group_ids):
            group_ids.append(t.group_id)
    options = estimator_options(adv_cfg)
    if takes_lengths(estimator):
        lengths = [0.0] * k
        for t, r in zip(trajs, which):
            lengths[r] += t.num_generated
        options["lengths"] = lengths
    adv = estimator(sample_rewards, group_ids, norm_by_std=adv_cfg.norm_by_std, **options)[index]
    own = torch.tensor([t.advantage if t.advantage is not None else 0.0 for t in trajs], dtype=torch.float32)
    has_own = torch.tensor([t.advantage is not None for t in trajs])
    return (torch.where(has_own, own.double(), adv.double()) * scale.double()).float()


def informative(trajs: Sequence[Trajectory]) -> bool:
    """Dynamic sampling's rule (DAPO; ``buffer.filter_groups``): whether trajectories carry a learning
    signal. True when one of them has an advantage of its own other than 0 (RLCR), or a group
    (``group_id``) of the rest holds two different rewards; a group of equal rewards, or of one,
    gives GRPO and RLOO nothing to learn from."""
    rewards: dict[str, set[float]] = defaultdict(set)
    for t in trajs:
        if t.advantage is not None:
            if t.advantage != 0.0:
                return True
            continue
        rewards[t.group_id].add(float(t.reward))
    return any(len(r) > 1 for r in rewards.values())
