"""The reference designs' options and the numeric fixes of issue 16 (docs/algorithms/seed_fidelity.md), against
hand-computed numbers: GRPO in float64 with equal-reward groups exactly 0, verl's group-of-one rule,
population vs unbiased std (RLCR), ECE bin edges, replay retrieval by sampling, Absolute Zero's
question-group size."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from asyncrl.algos.absolute_zero.config import AbsoluteZeroConfig
from asyncrl.algos.rlcr.calibration import bin_index, expected_calibration_error
from asyncrl.algos.rlcr.config import RLCRConfig
from asyncrl.algos.rlcr.trees import tree_advantages
from asyncrl.config import ConfigError, load_config, validate_section
from asyncrl.learner.experience import ExperiencePool
from asyncrl.learner.ingest.staleness import StalenessPolicy
from asyncrl.objectives.advantages import compute_grpo_advantages, trajectory_advantages
from asyncrl.types import Episode, Trajectory


# ---------------------------------------------------------------------------- GRPO numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reward, n", [(0.7, 8), (2.47, 25), (0.1, 3)])
def test_equal_rewards_give_exactly_zero(dtype, reward, n):
    # in float32, (0.7 - mean) / (std + 1e-6) was 0.056 for each of eight rewards of 0.7
    adv = compute_grpo_advantages(torch.full((n,), reward, dtype=dtype), ["g"] * n, norm_by_std=True)
    assert adv.dtype == dtype and adv.tolist() == [0.0] * n


def test_grpo_is_computed_in_float64():
    # rewards [0.7, 0.7, 0.7, 0.7 + 1e-4] in float32: mean 0.700025, unbiased std 5e-5
    r = torch.tensor([0.7, 0.7, 0.7, 0.7001], dtype=torch.float32)
    r64 = r.double()
    dev = r64 - r64.mean()
    expected = (dev / (dev.square().sum() / 3).sqrt().add(1e-6)).tolist()
    assert compute_grpo_advantages(r, ["g"] * 4).tolist() == pytest.approx(expected, rel=1e-6)
    assert expected[3] == pytest.approx(1.5 / (1 + 1e-6 / 5e-5), rel=1e-2)  # 0.75e-4 / 5e-5 = 1.5


def test_verl_singleton_rule_gives_the_reward():
    # verl: a group of one has mean 0 and std 1 -> A = (R - 0) / (1 + 1e-6); ours: 0
    r, groups = torch.tensor([5.0, 1.0, 0.0]), ["alone", "pair", "pair"]
    assert compute_grpo_advantages(r, groups).tolist()[0] == 0.0
    verl = compute_grpo_advantages(r, groups, singleton="verl").tolist()
    assert verl[0] == pytest.approx(5.0 / (1 + 1e-6), rel=1e-7) and verl[0] != 5.0  # float32 output
    assert verl[1:] == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)])
    assert compute_grpo_advantages(r, groups, norm_by_std=False, singleton="verl").tolist() == [5.0, 0.5, -0.5]


def test_population_std():
    # [1, 0, 1, 1]: mean 0.75, squared deviations sum 0.75; population var 0.1875, unbiased 0.25
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    pop = compute_grpo_advantages(r, ["g"] * 4, std="population").tolist()
    assert pop == pytest.approx(
        [
            0.25 / (math.sqrt(0.1875) + 1e-6),
            -0.75 / (math.sqrt(0.1875) + 1e-6),
            0.25 / (math.sqrt(0.1875) + 1e-6),
            0.25 / (math.sqrt(0.1875) + 1e-6),
        ]
    )
    assert compute_grpo_advantages(r, ["g"] * 4).tolist()[1] == pytest.approx(-0.75 / (0.5 + 1e-6))


def test_train_advantage_options_reach_the_estimator():
    cfg = load_config(None, ["train.advantage.singleton=verl", "train.advantage.std=population"])
    trajs = [
        Trajectory(
            token_ids=np.arange(3),
            loss_mask=np.array([0, 1, 1]),
            behavior_logprobs=np.zeros(3),
            policy_version=0,
            reward=r,
            group_id=g,
        )
        for r, g in ((2.0, "a"), (1.0, "b"), (0.0, "b"))
    ]
    # group a alone: 2 / (1 + 1e-6); group b [1, 0]: population std 0.5 -> +-0.5 / 0.500001
    assert trajectory_advantages(trajs, cfg.train.advantage).tolist() == pytest.approx(
        [2 / (1 + 1e-6), 0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)], rel=1e-6
    )
    with pytest.raises(ConfigError, match="train.advantage.singleton"):
        load_config(None, ["train.advantage.singleton=one"])


# ---------------------------------------------------------------------------- experience replay
def _mgr(*over) -> ExperiencePool:
    cfg = load_config(None, ["replay.enabled=true", "sampling.n=4", *over])
    return ExperiencePool(cfg.replay, n=4, total_steps=10, staleness=StalenessPolicy.from_config(cfg), seed=0)


def _stored(task_id: str, entropy: float, tid: str, reward: float = 1.0) -> Trajectory:
    t = Trajectory(
        token_ids=np.arange(5),
        loss_mask=np.array([0, 0, 1, 1, 1]),
        behavior_logprobs=np.zeros(5),
        policy_version=0,
        reward=reward,
        task_id=task_id,
        group_id=f"g-{task_id}",
        metadata={"entropy": entropy},
    )
    t.id = tid
    return t


def test_isolated_replay_with_verl_singleton_rule_gets_its_reward():
    """The reference design: unique group ids on verl, so a stored success is trained with A = R = 1
    (Dr.GRPO, no std), not 0; the fresh rollout left alone in its group gets its reward 0 too."""
    m = _mgr("replay.isolate_replay_groups=true")
    m.store([_stored("t", 0.1, "s")])
    ep = Episode(trajectories=[_stored("t", 0.0, "f", reward=0.0)], decision={"replay": {"k": 1}})
    assert m.attach([ep]) == 1
    adv_cfg = load_config(None, ["train.advantage.norm_by_std=false", "train.advantage.singleton=verl"]).train.advantage
    assert trajectory_advantages(ep.trajectories, adv_cfg).tolist() == [0.0, 1.0]


def test_replay_retrieval_top_k_vs_sample():
    picks = {}
    for retrieval in ("top_k", "sample"):
        m = _mgr(f"replay.retrieval={retrieval}", "replay.exp_select_mode=argmin")
        m.store([_stored("t", e, f"s{e}") for e in (0.1, 0.2, 0.3)])
        draws = [tuple(t.metadata["replay_of"] for t in m.stored_copies("t", 2, "g")) for _ in range(60)]
        picks[retrieval] = draws
    # top-k by entropy: always the two lowest-entropy stored trajectories
    assert set(picks["top_k"]) == {("s0.1", "s0.2")}
    # the reference design: two uniform draws with replacement, whatever the entropy order
    counts = Counter(x for d in picks["sample"] for x in d)
    assert set(counts) == {"s0.1", "s0.2", "s0.3"} and all(len(d) == 2 for d in picks["sample"])
    assert any(d[0] == d[1] for d in picks["sample"])  # with replacement


# ---------------------------------------------------------------------------- RLCR
def test_rlcr_population_std_is_the_default_and_differs_from_unbiased():
    assert RLCRConfig().std == "population"
    acc = np.array([1.0, 0.0, 1.0, 1.0])
    conf = np.array([[0.9, 0.5], [1.0, 0.0], [0.6, 0.6], [1.0, 1.0]])
    pop_ans, pop_conf = tree_advantages(acc, conf, norm_by_std=True, std="population")
    unb_ans, _ = tree_advantages(acc, conf, norm_by_std=True, std="unbiased")
    s = math.sqrt(0.1875)  # population std of [1, 0, 1, 1]
    assert pop_ans.tolist() == pytest.approx(
        [0.25 / (s + 1e-6), -0.75 / (s + 1e-6), 0.25 / (s + 1e-6), 0.25 / (s + 1e-6)]
    )
    assert unb_ans[1] / pop_ans[1] == pytest.approx(s / 0.5, rel=1e-5)  # 0.866: sqrt(3/4) at G = 4
    # confidences of answer 0: [0.9, 0.5], population std 0.2 -> +-0.2 / 0.200001; equal ones -> 0
    assert pop_conf[0].tolist() == pytest.approx([0.2 / (0.2 + 1e-6), -0.2 / (0.2 + 1e-6)])
    assert pop_conf[2].tolist() == [0.0, 0.0] and pop_conf[3].tolist() == [0.0, 0.0]


def test_ece_bin_edge_conventions():
    c = [0.0, 0.2, 0.25, 0.3, 1.0]
    assert bin_index(c).tolist() == [0, 2, 2, 3, 9]  # [b/10, (b+1)/10), 1.0 in the last bin
    assert bin_index(c, right_closed=True).tolist() == [0, 1, 2, 2, 9]  # (b/10, (b+1)/10], 0.0 in the first
    # 0.2 (right) and 0.25 (wrong): one bin [0.2, 0.3) -> |0.5 - 0.225| = 0.275;
    # right-closed: (0.1, 0.2] and (0.2, 0.3] -> 0.5 * 0.8 + 0.5 * 0.25 = 0.525
    assert expected_calibration_error([0.2, 0.25], [1, 0]) == pytest.approx(0.275)
    assert expected_calibration_error([0.2, 0.25], [1, 0], right_closed=True) == pytest.approx(0.525)


# ---------------------------------------------------------------------------- Absolute Zero
def test_one_question_per_group_is_refused():
    with pytest.raises(ConfigError, match=r"algo\.questions_per_prompt.*at least 2.*never mixed"):
        validate_section(AbsoluteZeroConfig, {"questions_per_prompt": 1}, "algo")
    assert validate_section(AbsoluteZeroConfig, {"questions_per_prompt": 2}, "algo").questions_per_prompt == 2
    # where (docs/algorithms/seed_fidelity.md): not at config load, which does not know the algorithm's settings, but at
    # start-up, by preflight, before anything is built or written
    from asyncrl.commands.preflight import preflight

    cfg = load_config(None, ["algorithm=absolute_zero", "algo.questions_per_prompt=1"])
    with pytest.raises(ConfigError, match=r"algo\.questions_per_prompt.*at least 2"):
        preflight(cfg)
