"""Experience replay (seed 004): the ExperiencePool, alignment, masks, loss and persistence."""

from __future__ import annotations

import json
import math
import random

import msgspec
import numpy as np
import pytest
import torch

from asyncrl.algos.grpo import GRPOWorkflow
from asyncrl.config import ConfigError, load_config
from asyncrl.engine.hf import HFEngine
from asyncrl.envs.base import make_env
from asyncrl.learner.experience import (
    ExperiencePool,
    ReplayHook,
    align_recorded_logprobs,
    compact_logprobs,
    make_replay_trajectory,
)
from asyncrl.learner.ingest.staleness import StalenessPolicy
from asyncrl.learner.training.batch import collate, compute_logprobs
from asyncrl.learner.training.trainer import PolicyTrainer
from asyncrl.models.loading import load_policy
from asyncrl.objectives.advantages import trajectory_advantages
from asyncrl.objectives.losses import LossConfig
from asyncrl.rollout import RolloutContext
from asyncrl.types import Episode, Task, Trajectory
from tests.conftest import scripted_conversation


def _cfg(*over):
    return load_config(None, ["replay.enabled=true", "sampling.n=4", *over])


def _mgr(*over, total_steps=10):
    cfg = _cfg(*over)
    return ExperiencePool(
        cfg.replay, n=cfg.sampling.n, total_steps=total_steps, staleness=StalenessPolicy.from_config(cfg), seed=0
    )


def _traj(task_id, reward, entropy=0.0, tid=None, n_tok=5):
    t = Trajectory(
        token_ids=np.arange(n_tok),
        loss_mask=[0, 0, 1, 1, 1][:n_tok],
        behavior_logprobs=np.zeros(n_tok),
        policy_version=0,
        reward=reward,
        task_id=task_id,
        group_id=f"g-{task_id}",
        metadata={"entropy": entropy},
    )
    if tid:
        t.id = tid
    return t


def _group(task_id, successes, n=4, entropies=None):
    ents = entropies or [0.1 * (i + 1) for i in range(n)]
    return [_traj(task_id, 1.0 if i < successes else 0.0, ents[i], tid=f"{task_id}-{i}") for i in range(n)]


def _update(m, groups):
    saved = m.update_solved(groups)
    for t in saved:
        m.tasks[t.task_id] = msgspec.to_builtins(Task(t.task_id, [{"role": "user", "content": t.task_id}], 0))
    m.store(saved)
    return saved


# ---------------------------------------------------------------------------- buckets, skip, bounds
def test_bucket_moves_keep_a_task_in_exactly_one_bucket():
    m = _mgr()
    m.move_to_bucket("a", 3)
    m.move_to_bucket("b", 3)
    assert m.buckets == {3: ["a", "b"]}
    m.move_to_bucket("a", 1)
    assert m.buckets == {3: ["b"], 1: ["a"]}
    m.move_to_bucket("b", 1)
    assert m.buckets == {1: ["a", "b"]}  # empty bucket 3 is gone
    # through the rollout results: a pooled task moves with its latest success count
    m = _mgr()
    _update(m, {"t": _group("t", 2)})
    assert m.buckets == {2: ["t"]}
    _update(m, {"t": _group("t", 0)})  # failed now: moves to bucket 0, its old success is kept
    assert m.buckets == {0: ["t"]} and len(m.stored["t"]) == 1
    _update(m, {"t": _group("t", 3)})
    assert m.buckets == {3: ["t"]} and len(m.stored["t"]) == 2


def test_skip_set_in_and_out():
    m = _mgr()
    _update(m, {"t": _group("t", 2), "u": _group("u", 1)})
    assert set(m.stored) == {"t", "u"}
    _update(m, {"t": _group("t", 4)})  # fully solved: into the skip set, out of pool and buckets
    assert m.solved == {"t"}
    assert "t" not in m.stored and m.bucket_of("t") is None and "t" not in m.tasks
    assert m.buckets == {1: ["u"]}
    body, sent = m.withheld_update(None)
    assert body == {"withhold_reset": True, "withhold_add": ["t"]} and sent == {"t"}
    _update(m, {"t": _group("t", 3)})  # not fully solved any more: out of the skip set, back in the pool
    assert m.solved == set() and m.bucket_of("t") == 3 and len(m.stored["t"]) == 1
    body, sent = m.withheld_update(sent)
    assert body == {"withhold_remove": ["t"]} and sent == set()
    # a replay task with n - k = 3 fresh rollouts, all correct, is fully solved too
    _update(m, {"u": _group("u", 3, n=3)})
    assert "u" in m.solved and "u" not in m.stored


def test_bounds_decide_who_enters_the_pool():
    m = _mgr("replay.experience_lbound=1", "replay.experience_rbound=3")
    _update(m, {f"s{s}": _group(f"s{s}", s) for s in range(4)})
    assert set(m.stored) == {"s2"}  # 1 < s < 3
    assert m.buckets == {2: ["s2"]}
    m = _mgr()  # defaults: 0 < s < n
    _update(m, {f"s{s}": _group(f"s{s}", s) for s in range(5)})
    assert set(m.stored) == {"s1", "s2", "s3"} and m.solved == {"s4"}


@pytest.mark.parametrize("mode,expected", [("argmin", "t-1"), ("argmax", "t-2")])
def test_selection_by_entropy(mode, expected):
    m = _mgr(f"replay.exp_select_mode={mode}")
    # successes are t-0, t-1, t-2 with entropies 0.5, 0.2, 0.9 (t-3 failed, entropy 0.01)
    _update(m, {"t": _group("t", 3, entropies=[0.5, 0.2, 0.9, 0.01])})
    assert [t.id for t in m.stored["t"]] == [expected]


def test_selection_random_is_a_seeded_success():
    picks = []
    for _ in range(2):
        m = _mgr("replay.exp_select_mode=random")
        _update(m, {"t": _group("t", 3)})
        picks.append(m.stored["t"][0].id)
    assert picks[0] == picks[1] and picks[0] in {"t-0", "t-1", "t-2"}


@pytest.mark.parametrize("mode", ["argmin", "argmax", "random"])
def test_replacement_rule_when_full(mode):
    m = _mgr(f"replay.exp_select_mode={mode}", "replay.max_trajectories_per_task=2")
    m.store([_traj("t", 1, 0.5, "a"), _traj("t", 1, 0.2, "b")])
    m.store([_traj("t", 1, 0.3, "c")])
    ids = [t.id for t in m.stored["t"]]
    if mode == "argmin":  # lower than the highest (0.5): replaces it in place
        assert ids == ["c", "b"]
        m.store([_traj("t", 1, 0.9, "d")])  # higher than all: ignored
        assert [t.id for t in m.stored["t"]] == ["c", "b"]
    elif mode == "argmax":  # higher than the lowest (0.2): replaces it
        assert ids == ["a", "c"]
        m.store([_traj("t", 1, 0.1, "d")])  # lower than all: ignored
        assert [t.id for t in m.stored["t"]] == ["a", "c"]
    else:  # FIFO
        assert ids == ["b", "c"]


@pytest.mark.parametrize("mode,expected", [("argmin", ["b", "c"]), ("argmax", ["a", "c"])])
def test_replayed_trajectories_follow_the_mode(mode, expected):
    m = _mgr(f"replay.exp_select_mode={mode}")
    m.store([_traj("t", 1, 0.5, "a"), _traj("t", 1, 0.1, "b"), _traj("t", 1, 0.3, "c")])
    out = m.stored_copies("t", 2, group_id="G")
    assert sorted(t.metadata["replay_of"] for t in out) == sorted(expected)
    assert all(t.is_replay and t.group_id == "G" for t in out)
    assert [t.id for t in m.stored["t"]] == ["a", "b", "c"]  # the store is untouched


def test_gaussian_bucket_weight_peaks_at_half():
    m = _mgr("replay.bucket_sampling=gaussian", "replay.bucket_sigma=0.25")
    w = [m.bucket_weight(s) for s in range(5)]
    assert w[2] == 1.0 and w[1] == w[3] == pytest.approx(math.exp(-0.0625 / 0.125)) and w[0] < w[1]


# ---------------------------------------------------------------------------- batch mix
def test_batch_mix_with_a_short_pool():
    m = _mgr("replay.exp_ratio=0.5", "replay.offpolicy_trajectories_per_task=1", "replay.replay_start_ratio=0.5")
    _update(m, {"p": _group("p", 2), "q": _group("q", 1)})
    assert m.assign(8, version=4) == []  # progress 0.4 < 0.5: not started (the pool still fills)
    got = m.assign(8, version=5)
    # 4 wanted (exp_ratio 0.5 of 8), the pool has 2: two replay tasks, the other 6 credits stay fresh
    assert sorted(a["task"]["id"] for a in got) == ["p", "q"]
    assert all(a["n"] == 3 and a["k"] == 1 for a in got)  # n - k fresh + k replayed = n
    assert m.assign(8, version=5) == []  # both are already out with an actor
    # the fraction carries over between grants: 0.5 per credit gives 0, 1, 0, 1, ...
    m2 = _mgr("replay.replay_start_ratio=0")
    _update(m2, {f"t{i}": _group(f"t{i}", 2) for i in range(6)})
    assert [len(m2.assign(1, version=0)) for _ in range(4)] == [0, 1, 0, 1]


def test_solve_rate_trigger():
    m = _mgr("replay.start=solve_rate", "replay.start_solve_rate=0.6")
    assert not m.maybe_activate(9, solve_rate=0.5)
    assert m.maybe_activate(0, solve_rate=0.7) and m.maybe_activate(1, solve_rate=0.0)  # latched


def test_k_must_leave_a_fresh_rollout():
    with pytest.raises(ConfigError, match="offpolicy_trajectories_per_task .4. must be below sampling.n"):
        _cfg("replay.offpolicy_trajectories_per_task=4")


# ---------------------------------------------------------------------------- log-prob alignment
def test_logprob_alignment_longer_shorter_missing():
    mask = np.array([0, 0, 1, 1, 0, 1])  # generated tokens at 2, 3 and 5 (e.g. two assistant turns)
    exact = align_recorded_logprobs([-0.1, -0.2, -0.3], mask)
    assert exact[[2, 3, 5]].tolist() == pytest.approx([-0.1, -0.2, -0.3]) and exact[[0, 1, 4]].tolist() == [0, 0, 0]
    longer = align_recorded_logprobs([-0.1, -0.2, -0.3, -0.4, -0.5], mask)  # truncated
    assert np.array_equal(longer, exact)
    shorter = align_recorded_logprobs([-0.1], mask)  # the rest has no recorded value
    assert shorter[2] == pytest.approx(-0.1) and np.isnan(shorter[[3, 5]]).all() and shorter[4] == 0
    missing = align_recorded_logprobs(None, mask)
    assert np.isnan(missing[[2, 3, 5]]).all()
    assert compact_logprobs(exact, mask).tolist() == pytest.approx([-0.1, -0.2, -0.3])
    # in the batch: recorded_mask marks the recorded ones; elsewhere the trainer keeps the current
    trajs = [
        Trajectory(
            token_ids=np.arange(6),
            loss_mask=mask,
            behavior_logprobs=np.zeros(6),
            policy_version=0,
            is_replay=True,
            recorded_logprobs=r,
            exp_mask=mask,
        )
        for r in (exact, shorter, missing)
    ]
    b = collate(trajs, torch.zeros(3), pad_id=0)
    assert b.exp_mask.tolist() == [[0, 1, 1, 0, 1]] * 3  # target positions: token j + 1
    assert (b.recorded_mask * b.exp_mask).tolist() == [[0, 1, 1, 0, 1], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert b.recorded_logprobs[1].tolist() == pytest.approx([0, -0.1, 0, 0, 0])
    assert torch.isfinite(b.recorded_logprobs).all()


# ---------------------------------------------------------------------------- multi-turn exp_mask
def test_exp_mask_on_a_multi_turn_replay():
    tok, env, task, c, engine = scripted_conversation(
        ["env.type=calculator", "env.max_turns=3"], "12+34=", 46, [("calc:12+34", True), ("46", True)], max_turns=3
    )
    assert tok.decode(c.token_ids, skip_special_tokens=False) == (
        "<|user|>12+34=<|end|><|assistant|>calc:12+34<|end|><|user|>46<|end|><|assistant|>46<|end|>"
    )
    traj = c.to_trajectory(engine.version, env.evaluate(task, c.history))
    assert traj.reward == 1.0 and traj.scores["tool_calls"] == 1.0
    # by hand: prompt "<|user|>" "12+34=" "<|end|>" "<|assistant|>" = 1 + 6 + 1 + 1 = 9 tokens; the
    # call "calc:12+34" + EOS = 11 tokens (9..19); tool turn "<|user|>" "46" "<|end|>" "<|assistant|>"
    # = 5 tokens (20..24); the answer "46" + EOS = 3 tokens (25..27)
    expected = list(range(9, 20)) + list(range(25, 28))
    assert np.flatnonzero(traj.loss_mask).tolist() == expected and len(traj.token_ids) == 28
    rec = align_recorded_logprobs(compact_logprobs(traj.behavior_logprobs, traj.loss_mask), traj.loss_mask)
    stored = msgspec.structs.replace(traj, recorded_logprobs=rec)
    replay = make_replay_trajectory(stored, group_id="g")
    assert replay.is_replay and np.flatnonzero(replay.exp_mask).tolist() == expected
    fresh = Trajectory(
        token_ids=traj.token_ids,
        loss_mask=traj.loss_mask,
        behavior_logprobs=traj.behavior_logprobs,
        policy_version=7,
        group_id="g",
    )
    batch = collate([fresh, replay], torch.zeros(2), pad_id=0)
    # target position j scores token j + 1: the replayed tokens sit at positions expected - 1
    assert torch.nonzero(batch.exp_mask[1]).flatten().tolist() == [j - 1 for j in expected]
    assert batch.exp_mask[0].sum() == 0  # the tool result and prompts are never off-policy, fresh rows neither
    assert torch.equal(batch.exp_mask[1], batch.response_mask[1])


# ---------------------------------------------------------------------------- loss, by hand
@pytest.fixture(scope="module")
def tiny_policy(tiny_overrides):
    torch.set_num_threads(1)
    cfg = load_config(None, tiny_overrides)
    model, tok, _ = load_policy(cfg.model, cfg.seed)
    return model, tok, tiny_overrides


def _two_rows(tok):
    ids = tok("<|user|>1+2=<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    out = []
    for reply in ("4", "3"):
        gen = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((ids + gen, [0] * len(ids) + [1] * len(gen)))
    return out


@pytest.mark.parametrize("off_clip", [1.0, 0.5])
def test_loss_by_hand_replayed_vs_fresh(tiny_policy, off_clip):
    model, tok, over = tiny_policy
    cfg = load_config(
        None,
        [
            *over,
            "replay.enabled=true",
            f"replay.off_cliprange_high={off_clip}",
            "train.advantage.norm_by_std=false",
            "train.lr=1e-9",
        ],
    )
    (ids_a, m_a), (ids_b, m_b) = _two_rows(tok)
    fresh = Trajectory(
        token_ids=ids_a,
        loss_mask=m_a,
        behavior_logprobs=np.zeros(len(ids_a)),
        policy_version=0,
        reward=0.0,
        group_id="g",
        task_id="t",
    )
    replay = Trajectory(
        token_ids=ids_b,
        loss_mask=m_b,
        behavior_logprobs=np.zeros(len(ids_b)),
        policy_version=0,
        reward=1.0,
        group_id="g",
        task_id="t",
        is_replay=True,
        exp_mask=m_b,
    )
    with torch.no_grad():
        cur, _ = compute_logprobs(model, collate([fresh, replay], torch.zeros(2), 0))
    # behaviour = current for the fresh row (no staleness: weight 1); recorded = current - log 2.5 for the
    # replayed row, so its importance ratio is exactly 2.5
    fresh.behavior_logprobs = np.concatenate([[0.0], cur[0, : len(ids_a) - 1].numpy()]) * np.asarray(m_a)
    rec = np.concatenate([[0.0], cur[1, : len(ids_b) - 1].numpy() - math.log(2.5)]) * np.asarray(m_b)
    replay.recorded_logprobs = np.where(np.asarray(m_b) > 0, rec, 0.0)
    trainer = PolicyTrainer(model, tok, cfg.train, 1.0, loss_cfg=LossConfig.from_config(cfg.train, cfg.replay))
    ep = Episode(trajectories=[fresh, replay])
    adv = trajectory_advantages(ep.trajectories, cfg.train.advantage)
    assert adv.tolist() == pytest.approx([-0.5, 0.5])  # the replayed one shares the group: non-zero
    result = trainer.step(trainer.make_batch([ep]), keep_rows=True)
    hook = ReplayHook(_mgr(), state_event_every=1, event=lambda *a, **k: None)  # reports replay/* names
    stats = {**result.stats, **hook.after_step([ep], result, version=0)}
    n_on, n_off = sum(m_a), sum(m_b)
    on_tok = 0.5  # A = -0.5, r = 1: max(0.5, 0.5 * clip(1)) = 0.5, dual clip min(0.5, 1.5) = 0.5
    off_tok = -0.5 * min(2.5, 1 + off_clip)  # A = +0.5, r = 2.5 clipped at 1 + off_cliprange_high
    assert stats["pg_loss"] == pytest.approx((n_on * on_tok + n_off * off_tok) / (n_on + n_off), rel=1e-4)
    assert stats["replay/on_pg_loss"] == pytest.approx(on_tok, rel=1e-4)
    assert stats["replay/off_pg_loss"] == pytest.approx(off_tok, rel=1e-4)
    assert stats["replay/ratio_mean"] == pytest.approx(2.5, rel=1e-4)
    assert stats["replay/ratio_min"] == pytest.approx(2.5, rel=1e-4)
    assert stats["replay/off_clipfrac"] == 1.0 and stats["replay/on_clipfrac"] == 0.0
    assert stats["replay/off_token_ratio"] == pytest.approx(n_off / (n_on + n_off))
    assert stats["replay/recorded_vs_current_logprob_diff"] == pytest.approx(math.log(2.5), rel=1e-4)
    # not the on-policy bound: with clip_high 0.28 the replayed tokens would give -0.5 * 1.28
    assert off_tok != pytest.approx(-0.5 * 1.28)


def test_isolated_replay_groups_train_the_replayed_success_with_its_reward():
    """A fresh failure (R = 0) and a replayed success (R = 1), Dr.GRPO advantages by hand: together in the
    task's group, mean 0.5, so -0.5 and +0.5; isolated, each is a group of one, whose rule then follows the
    reference design (``singleton`` becomes verl: A = R), so 0 and 1, not the 0 and 0 that trained nothing."""
    for isolate, expected in ((False, [-0.5, 0.5]), (True, [0.0, 1.0])):
        over = [f"replay.isolate_replay_groups={str(isolate).lower()}", "train.advantage.norm_by_std=false"]
        m = _mgr(*over)
        m.store([_traj("t", 1.0, 0.1, "s")])
        fresh = _traj("t", 0.0, tid="f")
        ep = Episode(trajectories=[fresh], decision={"replay": {"k": 1}})
        assert m.attach([ep]) == 1
        adv = trajectory_advantages(ep.trajectories, _cfg(*over).train.advantage)
        assert adv.tolist() == pytest.approx(expected)
    assert _cfg("replay.isolate_replay_groups=true").train.advantage.singleton == "verl"
    assert _cfg("replay.isolate_replay_groups=false").train.advantage.singleton == "zero"
    with pytest.raises(ConfigError, match="replay would train nothing"):
        _cfg("replay.isolate_replay_groups=true", "train.advantage.singleton=zero")


# ---------------------------------------------------------------------------- n - k plus k, real model
def test_replay_group_has_n_minus_k_fresh_plus_k_replayed(tiny_policy):
    model, tok, over = tiny_policy
    cfg = load_config(
        None,
        [
            *over,
            "replay.enabled=true",
            "sampling.n=4",
            "replay.offpolicy_trajectories_per_task=2",
            "sampling.max_new_tokens=3",
            "env.reward=tests.support.plugins:short_reply_reward",
        ],
    )
    m = ExperiencePool(cfg.replay, n=4, total_steps=10, staleness=StalenessPolicy.from_config(cfg), seed=0)
    tasks = [
        Task("arith:1+2", [{"role": "user", "content": "1+2="}], 3),
        Task("arith:3+4", [{"role": "user", "content": "3+4="}], 7),
    ]
    m.tasks["arith:1+2"] = msgspec.to_builtins(tasks[0])
    m.store([_traj("arith:1+2", 1.0, 0.3, "old1"), _traj("arith:1+2", 1.0, 0.2, "old2")])
    m.move_to_bucket("arith:1+2", 2)
    assign = m.assign(4, version=10)
    assert assign == [{"task": msgspec.to_builtins(tasks[0]), "n": 2, "k": 2}]
    ctx = RolloutContext(HFEngine(model, tok), tok, make_env(cfg.env), cfg, "a", seed=1)
    eps = GRPOWorkflow(cfg).rollout(tasks, ctx, counts=[2, 4])
    assert [len(e.trajectories) for e in eps] == [2, 4]
    eps[0].decision["replay"] = {"k": 2, "fresh": 2}
    assert m.attach(eps) == 2
    assert [len(e.trajectories) for e in eps] == [4, 4]  # every group has n
    g = eps[0].trajectories
    assert [t.is_replay for t in g] == [False, False, True, True]
    assert len({t.group_id for t in g}) == 1 and g[0].group_id == eps[0].id
    assert not any(t.is_replay for t in eps[1].trajectories)


# ---------------------------------------------------------------------------- recording, real model
def test_record_stores_the_learners_logprobs_and_entropy(tiny_policy):
    model, tok, over = tiny_policy
    cfg = load_config(
        None,
        [
            *over,
            "replay.enabled=true",
            "sampling.n=4",
            "sampling.max_new_tokens=5",
            "env.type=calculator",
            "env.max_turns=2",
            "env.kwargs.tool_prefix=",
            "env.reward=tests.support.plugins:short_reply_reward",
            "train.lr=1e-9",
        ],
    )
    m = ExperiencePool(cfg.replay, n=4, total_steps=10, staleness=StalenessPolicy.from_config(cfg), seed=0)
    trainer = PolicyTrainer(model, tok, cfg.train, 1.0, loss_cfg=LossConfig.from_config(cfg.train, cfg.replay))
    rng = random.Random(0)
    tasks = [
        Task(f"arith:{a}+{b}", [{"role": "user", "content": f"{a}+{b}="}], a + b)
        for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(6))
    ]
    ctx = RolloutContext(HFEngine(model, tok), tok, make_env(cfg.env), cfg, "a", seed=3)
    eps = GRPOWorkflow(cfg).rollout(tasks, ctx)
    trajs = [t for e in eps for t in e.trajectories]
    assert all(t.metadata["turns"] == 2 for t in trajs)  # multi-turn: call, tool result, answer
    with torch.no_grad():
        before, ent = compute_logprobs(model, collate(trajs, torch.zeros(len(trajs)), 0), with_entropy=True)
    result = trainer.step(trainer.make_batch(eps), keep_rows=True)
    logp, entropy = result.row_logprobs, result.row_entropy
    valid = collate(
        trajs, torch.zeros(len(trajs)), 0
    ).response_mask.bool()  # (the learner computes trained tokens only)
    assert torch.allclose(logp[valid], before[valid], atol=1e-5)  # recorded before the update
    m.record(eps, logp.numpy(), entropy.numpy(), version=5)
    assert m.stored, "no task had a partial success; pick another seed"
    for tid, stored in m.stored.items():
        s = stored[0]
        i = next(i for i, t in enumerate(trajs) if t.id == s.id)
        gen = np.flatnonzero(s.loss_mask)
        assert np.allclose(s.recorded_logprobs[gen], before[i, gen - 1].numpy(), atol=1e-5)
        assert s.metadata["entropy"] == pytest.approx(float(ent[i, gen - 1].mean()), rel=1e-4)
        assert s.metadata["recorded_version"] == 5 and s.reward == 1.0
        assert m.bucket_of(tid) is not None and m.tasks[tid]["id"] == tid
    ms = m.metrics()
    assert ms["replay/pool_tasks"] == len(m.stored)
    assert sum(ms[f"replay/bucket_{d}"] for d in range(5)) == len(m.stored)


# ---------------------------------------------------------------------------- persistence
def test_state_survives_save_and_load(tmp_path):
    m = _mgr("replay.replay_start_ratio=0")
    _update(m, {"a": _group("a", 2), "b": _group("b", 1), "c": _group("c", 4), "d": _group("d", 3)})
    m.stored["a"][0].recorded_logprobs = align_recorded_logprobs([-0.5], m.stored["a"][0].loss_mask)
    m.maybe_activate(0)
    m.save(tmp_path)
    saved = m.digest()
    m2 = _mgr("replay.replay_start_ratio=0")
    assert m2.load(tmp_path)
    assert m2.digest() == m.digest()
    assert m2.buckets == m.buckets and m2.solved == m.solved == {"c"}
    assert {k: [t.id for t in v] for k, v in m2.stored.items()} == {k: [t.id for t in v] for k, v in m.stored.items()}
    r1, r2 = m.stored["a"][0].recorded_logprobs, m2.stored["a"][0].recorded_logprobs
    assert np.array_equal(np.isnan(r1), np.isnan(r2)) and np.allclose(r1[~np.isnan(r1)], r2[~np.isnan(r2)])
    assert m2.active and m2.assign(4, 0) == m.assign(4, 0)  # the RNG goes on identically
    assert not _mgr().load(tmp_path / "nothing")
    # a checkpoint written under the reference design's names loads the same
    old = {
        {"buckets": "difficulty2task_dict", "stored": "task2trajectories", "solved": "skip_uid_set"}.get(k, k): v
        for k, v in json.loads((tmp_path / "replay.json").read_text()).items()
    }
    (tmp_path / "replay.json").write_text(json.dumps(old))
    m3 = _mgr("replay.replay_start_ratio=0")
    assert m3.load(tmp_path) and m3.digest() == saved
