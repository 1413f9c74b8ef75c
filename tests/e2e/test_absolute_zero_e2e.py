"""Absolute Zero end to end: ``asyncrl run -c configs/absolute_zero.yaml`` over real processes,
and the learner's handling of episodes whose trajectories were all filtered out."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.learner.ingest.buffer import EpisodeQueue
from asyncrl.learner.ingest.staleness import StalenessPolicy
from asyncrl.types import Episode
from asyncrl.wire.codec import decode, decode_episode, encode_episode
from tests.conftest import ROOT, read_jsonl, run_cli

CONFIG = str(ROOT / "configs" / "absolute_zero.yaml")
SEED_METRICS = [
    "unified_filter/num_learnable",
    "unified_filter/num_total",
    "unified_filter/learnable_ratio",
    "unified_filter/num_sampled",
    "unified_filter/num_repropose",
    "repropose/total_attempts",
    "repropose/final_non_learnable",
    "proposer/num_trajectories",
    "proposer/num_integrated",
    "proposer/reward_mean",
    "joint/combined_reward_mean",
    "joint/proposer_solver_ratio",
    "harm/safety_score_mean",
    "harm/completion_score_mean",
    "harm/combined_reward_mean",
]
K, N = 8, 3  # questions per prompt, solver responses per question


def _e2e_overrides(tiny_overrides, tmp_path) -> list[str]:
    # The session's tiny model barely writes valid expressions; bare numbers count as questions and
    # the learnability windows are wide open, so a group is mixed when it holds a valid and an
    # invalid proposal. That exercises the whole path on a model this small.
    return [
        *tiny_overrides,
        "model.embedded.warmstart_formats=[arithmetic]",
        f"run_root={tmp_path}",
        "name=azr",
        "train.total_steps=3",
        "train.batch_tasks=4",
        "actor.tasks_per_batch=4",
        "train.lr=1e-3",
        "eval.size=8",
        "eval.every=0",
        "log.progress=false",
        "checkpoint.every=0",
        "actor.heartbeat_s=0.5",
        "algo.mode=joint",
        "algo.proposer_update=group",
        f"algo.questions_per_prompt={K}",
        f"algo.rollout_n={N}",
        "algo.max_repropose_attempts=5",
        "algo.arithmetic.min_operators=0",
        "algo.learnability.safety.min_ratio=0",
        "algo.learnability.completion.min_ratio=0",
        "algo.learnability.completion.max_ratio=1",
    ]


@pytest.mark.slow
def test_self_play_run_over_real_processes(tmp_path, tiny_overrides):
    res = run_cli("run", "-c", CONFIG, *_e2e_overrides(tiny_overrides, tmp_path), cwd=ROOT, timeout=300)
    run_dir = tmp_path / "azr"
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["version"] for m in metrics] == [1, 2, 3]
    written = set().union(*metrics)
    assert not [k for k in SEED_METRICS if k not in written], sorted(written)
    assert all(m["unified_filter/num_total"] == K for m in metrics)

    episodes = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "episode"]
    assert len(episodes) == 12  # 3 steps x 4 seed prompts, kept or not
    kept = [e for e in episodes if e["decision"]["kept"]]
    assert kept, "no prompt became mixed: the test model proposed nothing usable"
    for e in episodes:
        solver = [t for t in e["trajectories"] if t["sample_type"] == "solver"]
        proposer = [t for t in e["trajectories"] if t["sample_type"] == "proposer"]
        assert len(proposer) == K  # joint mode, group update: every question of the final group
        assert all(t["reward"] in (1.0, 0.0, -0.5) for t in proposer)
        if e["decision"]["kept"]:  # one question, rollout_n responses in one group
            assert len(solver) == N and len({t["group_id"] for t in solver}) == 1
            q = e["decision"]["attempts"][-1]["questions"][e["decision"]["sampled_index"]]
            assert q["learnable"] and len(q["responses"]) == N
        else:
            assert solver == [] and e["decision"]["final_status"] != "mixed"


def test_empty_episode_keeps_its_version_through_wire_and_buffer(tmp_path):
    ep = Episode(
        trajectories=[], decision={"policy_version": 5, "kept": False}, metrics={"unified_filter/num_sampled": 0}
    )
    back = decode_episode(decode(encode_episode(ep)))
    assert back.trajectories == [] and back.policy_version == 5
    buf = EpisodeQueue(tmp_path / "buf", capacity=8)
    buf.open_wal(0)
    buf.add(back, encode_episode(back))
    taken = buf.take(1, version=6, staleness=StalenessPolicy(1, "drop"))
    assert taken is not None and taken[0].id == ep.id and buf.dropped_stale == 0


def test_learner_steps_over_a_batch_with_no_trajectories(tmp_path, tiny_overrides):
    from asyncrl.learner.learner import Learner

    cfg = load_config(
        CONFIG,
        [
            *tiny_overrides,
            "model.embedded.warmstart_formats=[arithmetic]",
            f"run_root={tmp_path}",
            "name=empty",
            "eval.size=4",
            "eval.every=0",
            "log.progress=false",
        ],
    )
    learner = Learner(cfg)
    try:
        eps = [
            Episode(trajectories=[], decision={"policy_version": 0}, metrics={"unified_filter/learnable_ratio": r})
            for r in (0.25, 0.75)
        ]
        stats = learner.train_on(eps, wait_s=0.0)
    finally:
        learner.net.close()
        learner.log.close()
    assert learner.version == 1
    assert stats["batch_trajectories"] == 0 and stats["unified_filter/learnable_ratio"] == 0.5
