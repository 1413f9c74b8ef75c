"""Issue 29 item 4: what a real run exports to TensorBoard and Trackio, read back with their own
readers: the config, the held-out evaluation before training, every metric under a section tag,
completions tables and histograms; a resumed run continues the same Trackio run and W&B run id."""

from __future__ import annotations

import json
import sqlite3

import pytest

from tests.conftest import ROOT, run_cli, subprocess_env


def _run(tmp_path, tiny_overrides, steps: int, *extra: str):
    env = {
        **subprocess_env(),
        "TRACKIO_DIR": str(tmp_path / "trackio"),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }
    res = run_cli(
        "run",
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=tr",
        f"train.total_steps={steps}",
        "train.batch_tasks=2",
        "actor.tasks_per_batch=2",
        "sampling.n=4",
        "eval.size=4",
        "eval.every=2",
        "log.progress=false",
        "checkpoint.every=0",
        "log.trackers=[tensorboard,trackio,wandb]",
        "log.project=asyncrl-test",
        *extra,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.slow
def test_tensorboard_and_trackio_get_config_baseline_tags_tables_histograms_and_resume_continues(
    tmp_path, tiny_overrides
):
    _run(tmp_path, tiny_overrides, 3)
    _run(tmp_path, tiny_overrides, 5, "--resume")

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tr" / "tensorboard"), size_guidance={"tensors": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = tags["scalars"]
    assert all("/" in t for t in scalars), [t for t in scalars if "/" not in t]  # no metric is a section of its own
    assert {"reward/reward_mean", "policy/loss", "throughput/tokens_per_s", "eval/accuracy"} <= set(scalars)
    assert [e.step for e in acc.Scalars("eval/accuracy")][:2] == [0, 2]  # the baseline before training first
    assert sorted({e.step for e in acc.Scalars("reward/reward_mean")}) == [1, 2, 3, 4, 5]  # across the resume
    texts = set(tags["tensors"])  # add_text is stored as a tensor summary
    assert {"config/text_summary", "completions/text_summary", "eval/samples/text_summary"} <= texts, texts
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "total_steps: 3" in config and "algorithm: grpo" in config
    table = acc.Tensors("completions/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert (
        table.startswith("| step | prompt | completion | reward | advantage |") and table.count("\n") == 1 + 8
    )  # 2 groups of 4
    assert {"train/advantages", "train/rewards", "staleness/episodes"} <= set(tags["histograms"])
    assert len(acc.Histograms("train/advantages")) == 5

    dbs = list((tmp_path / "trackio").glob("*.db"))
    assert len(dbs) == 1, dbs
    with sqlite3.connect(dbs[0]) as con:
        runs = con.execute("SELECT DISTINCT run_id, run_name FROM metrics").fetchall()
        rows = con.execute("SELECT step, metrics FROM metrics ORDER BY step").fetchall()
    assert len(runs) == 1 and runs[0][1] == "tr", runs  # the resume continued the same run, not a second "tr"
    logged = [(s, json.loads(m)) for s, m in rows]
    assert sorted({s for s, m in logged if "reward/reward_mean" in m}) == [1, 2, 3, 4, 5]
    assert any(s == 0 and "eval/accuracy" in m for s, m in logged)
    completions = [m["completions"] for s, m in logged if "completions" in m]
    assert len(completions) == 5 and all(c.get("_type") == "trackio.table" for c in completions), completions[:1]
    assert any("train/advantages" in m for s, m in logged)

    # W&B (offline): the resumed segment logged to the run id the first one made (kept in trackers.json)
    run_id = json.loads((tmp_path / "tr" / "trackers.json").read_text())["wandb"]
    offline = sorted((tmp_path / "tr" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [p.name for p in offline] == [f"run-{run_id}.wandb"] * 2, offline

    # item 10: the resumed segment's summary starts at the run's start (version 0), not the resume point
    events = [json.loads(line) for line in (tmp_path / "tr" / "events.jsonl").read_text().splitlines()]
    first_eval = next(e for e in events if e["kind"] == "eval" and e["version"] == 0)
    stops = [e for e in events if e["kind"] == "learner_stop"]
    assert len(stops) == 2 and stops[1]["summary"]["eval_accuracy_start"] == first_eval["accuracy"]
    assert stops[1]["summary"]["steps"] == 5
