"""The objectives menu in real runs (learner and actor processes over loopback ZeroMQ): dynamic
sampling drops the groups with equal rewards, counts and acknowledges each, and never trains one;
its bound stops a run in which no group is informative; pass@k and avg@k come with the evaluation."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import SMALL_RUN, read_jsonl, run_cli

pytestmark = pytest.mark.slow


def test_dynamic_sampling_trains_full_batches_of_informative_groups_and_accounts_for_every_drop(
    tmp_path, tiny_overrides
):
    steps = 6
    res = run_cli(
        "run",
        *tiny_overrides,
        *SMALL_RUN,
        f"run_root={tmp_path}",
        "name=ds",
        f"train.total_steps={steps}",
        "env.reward=tests.support.plugins:half_constant_reward",
        "buffer.filter_groups=true",
        "train.advantage.estimator=rloo",
        "train.policy_loss=gspo",
        "train.overlong_buffer=2",
        "eval.k=4",
        "eval.size=6",
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    run = tmp_path / "ds"
    metrics = read_jsonl(run / "metrics.jsonl")
    events = read_jsonl(run / "events.jsonl")
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["batch_trajectories"] == 4 * 4 for m in metrics)  # always full: 4 informative groups of 4
    trained = [e for e in events if e["kind"] == "episode"]
    assert len(trained) == 4 * steps
    for e in trained:  # every trained episode has a group with two different rewards
        assert len({t["reward"] for t in e["trajectories"]}) > 1, e["trajectories"]
    filtered = [i for e in events if e["kind"] == "groups_filtered" for i in e["episode_ids"]]
    assert filtered, "half the tasks have a constant reward: some groups must have been dropped"
    assert len(filtered) == len(set(filtered)) and not set(filtered) & {e["episode_id"] for e in trained}
    last = metrics[-1]
    assert (
        last["dynamic_sampling/dropped_total"] == len(filtered) == sum(m["dynamic_sampling/dropped"] for m in metrics)
    )
    # every acknowledged episode is trained, dropped by dynamic sampling, dropped as stale, or still waiting
    dupes = last.get("ledger/duplicates_total", 0)  # (the task ledger's: acknowledged, not trained)
    assert last["episodes_acked"] == 4 * steps + len(filtered) + last["dropped_stale"] + last["buffer_size"] + dupes
    assert all(0 <= m["dynamic_sampling/dropped_share"] < 1 for m in metrics)
    assert all(m["overlong/penalty_mean"] <= 0 for m in metrics) and "behavior_clipfrac" in last
    evals = [e for e in events if e["kind"] == "eval"]
    for e in evals:  # pass@j for j = 1, 2, 4 and avg@4 beside the greedy accuracy
        assert {"accuracy", "pass@1", "pass@2", "pass@4", "avg@4"} <= set(e), sorted(e)
        assert e["pass@1"] == pytest.approx(e["avg@4"]) and e["pass@1"] <= e["pass@2"] <= e["pass@4"] <= 1
    from asyncrl.analysis.metric_series import chart_data, runs_table
    from asyncrl.analysis.store import load_run

    store = load_run(run)  # the dashboard's runs table and eval charts show them beside the greedy accuracy
    row = runs_table({"ds": store}).iloc[0]
    assert row["eval/pass@4"] == pytest.approx(evals[-1]["pass@4"]) and "eval/accuracy" in row
    charts = {c["metric"] for g in chart_data({"ds": store})["groups"] for c in g["charts"]}
    flat = {f["metric"] for g in chart_data({"ds": store})["groups"] for f in g.get("flat", [])}
    assert {"eval/pass@1", "eval/avg@4"} <= charts | flat


def test_dynamic_sampling_stops_in_one_line_when_no_group_is_informative(tmp_path, tiny_overrides):
    res = run_cli(
        "run",
        *tiny_overrides,
        *SMALL_RUN,
        f"run_root={tmp_path}",
        "name=flat",
        "train.total_steps=5",
        "env.reward=tests.support.plugins:constant_reward",
        "buffer.filter_groups=true",
        "buffer.filter_groups_max_batches=2",
        timeout=600,
    )
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "dynamic sampling (buffer.filter_groups) dropped" in out and "no informative group" in out, out[-3000:]
    stop = [e for e in read_jsonl(tmp_path / "flat" / "events.jsonl") if e["kind"] == "learner_stop"][-1]
    assert "more than buffer.filter_groups_max_batches=2 x train.batch_tasks=4" in json.dumps(stop)
    assert not (tmp_path / "flat" / "metrics.jsonl").exists() or not read_jsonl(tmp_path / "flat" / "metrics.jsonl")


def test_a_mixture_of_experts_model_trains_with_its_sampled_routing_replayed(tmp_path, tiny_overrides):
    """Routing replay (R3) in a real run: a tiny randomly initialised Qwen2-MoE from transformers (with
    the embedded model's character tokenizer) as model.path; the actor's HF engine records every
    token's experts, the routes travel with the episodes, and every trained token's input position is
    replayed in the learner's forward."""
    from asyncrl.models.tokenizer import build_char_tokenizer
    from tests.unit.engine.test_routing_replay import _moe

    model_dir = tmp_path / "moe"
    _moe().save_pretrained(model_dir)
    build_char_tokenizer().save_pretrained(model_dir)
    steps = 3
    res = run_cli(
        "run",
        *tiny_overrides,
        *SMALL_RUN,
        f"run_root={tmp_path}",
        "name=r3",
        f"model.path={model_dir}",
        "model.routing_replay=true",
        "log.sample_every=1",  # the sample and token-trace events of rows that carry routes, every step
        f"train.total_steps={steps}",
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    events = read_jsonl(tmp_path / "r3" / "events.jsonl")
    assert {"sample", "token_trace"} <= {e["kind"] for e in events}
    metrics = read_jsonl(tmp_path / "r3" / "metrics.jsonl")
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["routing/replayed_share"] == 1.0 for m in metrics), [m.get("routing/replayed_share") for m in metrics]
    # the engine's log-probs against the learner's forward on the same float32 weights (this step's, or a
    # version kept for the lagged measure), with the sampled routes
    gaps = [
        m[k]
        for m in metrics
        for k in ("mismatch/logprob_abs_diff_max", "mismatch/lagged_logprob_abs_diff_max")
        if k in m
    ]
    assert gaps and max(gaps) < 1e-3, metrics


def test_on_policy_distillation_trains_on_the_teachers_per_token_signal(tmp_path, tiny_overrides):
    """A run with train.distill.teacher (a model directory with the student's vocabulary) and no task
    reward logs the reverse KL on the tokens it trains, step after step."""
    from transformers import LlamaForCausalLM

    from asyncrl.config import EmbeddedModelConfig
    from asyncrl.models.tiny import embedded_llama_config
    from asyncrl.models.tokenizer import build_char_tokenizer

    teacher = tmp_path / "teacher"
    cfg = EmbeddedModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    LlamaForCausalLM(embedded_llama_config(cfg, len(build_char_tokenizer()))).save_pretrained(teacher)
    steps = 3
    res = run_cli(
        "run",
        *tiny_overrides,
        *SMALL_RUN,
        f"run_root={tmp_path}",
        "name=distill",
        f"train.distill.teacher={teacher}",
        "train.distill.task_coef=0",
        f"train.total_steps={steps}",
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    metrics = read_jsonl(tmp_path / "distill" / "metrics.jsonl")
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        assert m["distill/tokens"] > 0 and math.isfinite(m["distill/reverse_kl"]), m
        assert m["distill/teacher_logprob_mean"] < 0
