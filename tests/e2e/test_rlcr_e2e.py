"""RLCR end to end: ``asyncrl run -c configs/rlcr.yaml`` over real processes for a few steps."""

from __future__ import annotations

import pytest

from tests.conftest import read_jsonl, run_cli

pytestmark = pytest.mark.slow


def test_rlcr_run_trains_both_sample_types(tmp_path, tiny_overrides):
    steps, tasks, g_a, g_c = 3, 2, 2, 2
    # the tags-only warm start is a model of its own: keep its build short (its quality is not tested)
    overrides = [
        *tiny_overrides,
        "model.embedded.warmup_steps=5",
        "model.embedded.warmup_batch_size=8",
        f"run_root={tmp_path}",
        "name=rlcr",
        f"train.total_steps={steps}",
        f"actor.tasks_per_batch={tasks}",
        f"train.batch_tasks={tasks}",
        "eval.size=4",
        "eval.every=2",
        f"algo.num_generations_answer={g_a}",
        f"algo.num_generations_confidence={g_c}",
        "algo.answer_max_new_tokens=24",
        "algo.confidence_max_new_tokens=16",
        "log.progress=false",
        "checkpoint.every=0",
        "actor.heartbeat_s=0.2",
    ]
    res = run_cli("run", "-c", "configs/rlcr.yaml", *overrides, timeout=300)
    run_dir = tmp_path / "rlcr"
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["batch_trajectories"] == tasks * (g_a + g_a * g_c) for m in metrics)
    for key in (
        "rlcr/answer_reward_mean",
        "rlcr/confidence_reward_std",
        "rlcr/effective_gc",
        "rlcr/answer_format_fail",
        "rlcr/confidence_tokens_mean",
    ):
        assert key in metrics[-1], key

    events = read_jsonl(run_dir / "events.jsonl")
    episodes = [e for e in events if e["kind"] == "episode"]  # logged after they were trained on
    assert len(episodes) == steps * tasks
    for ep in episodes:
        types = [t["sample_type"] for t in ep["trajectories"]]
        assert types.count("answer") == g_a and types.count("confidence") == g_a * g_c
        tree = ep["decision"]
        assert tree["kind"] == "rlcr_tree" and len(tree["answers"]) == g_a
        for a in tree["answers"]:
            start, end = a["mask_span"]
            assert tree["prompt_tokens"] <= start < end <= a["num_tokens"]
            for c in a["confidences"]:
                # the confidence row holds the answer's tokens with mask 0, then learns after them
                c_start, c_end = c["mask_span"]
                assert a["num_tokens"] < c_start < c_end <= c["num_tokens"]
    evals = [e for e in events if e["kind"] == "eval"]
    assert [e["version"] for e in evals] == [0, 2, 3]  # start, every 2 steps, end
    for ev in evals:
        assert {"accuracy", "brier", "ece", "auroc", "reliability"} <= set(ev)
        assert len(ev["reliability"]) == 10 and sum(b["count"] for b in ev["reliability"]) == 4
    assert "eval/ece" in metrics[1] and "eval/brier" in metrics[1] and "eval/accuracy" in metrics[1]
