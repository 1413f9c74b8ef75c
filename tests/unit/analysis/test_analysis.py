"""``asyncrl.analysis``: reading run directories (finished, live, with truncated records)."""

from __future__ import annotations

import json
import signal
import time

import pandas as pd
import pytest

from asyncrl.analysis import (
    RunReader,
    RunStore,
    TruncatedRecordWarning,
    load_events,
    load_metrics,
    load_run,
    read_records,
    reliability_frame,
)
from tests.conftest import ROOT, cli
from tests.support.ui_runs import make_runs, start_logged, stop


@pytest.fixture(scope="session")
def demo_runs(tmp_path_factory, model_cache, tiny_overrides):
    return make_runs(tmp_path_factory, model_cache)


def _line(rec: dict) -> str:
    return json.dumps(rec) + "\n"


def _event(kind: str, step: int, t: float, **fields) -> dict:
    return {"schema": 1, "kind": kind, "t": t, "step": step, **fields}


def test_a_truncated_last_line_is_skipped_with_a_warning_then_read_once_complete(tmp_path):
    path = tmp_path / "events.jsonl"
    whole = _line(_event("weights_published", 1, 1.0, version=1))
    cut = _line(_event("weights_published", 2, 2.0, version=2))
    path.write_text(whole + cut[:25])  # the writer is in the middle of its second line
    with pytest.warns(TruncatedRecordWarning, match="unfinished last line"):
        records = read_records(path)
    assert [r["step"] for r in records] == [1]

    store = RunStore()
    reader = RunReader(tmp_path, store)
    assert reader.poll() == 1 and reader.partial_bytes == 25
    with open(path, "a") as f:  # the writer finishes the line, and writes a third
        f.write(cut[25:] + _line(_event("weights_published", 3, 3.0, version=3)))
    assert reader.poll() == 2 and reader.partial_bytes == 0
    assert [r["step"] for r in store.records("weights_published")] == [1, 2, 3]
    assert reader.poll() == 0 and store.version == 3


def test_a_corrupt_record_is_skipped_with_a_warning_not_a_crash(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        _line({"step": 1, "t": 1.0, "version": 1, "loss": 0.5})
        + '{"step": 2, "t": 2.0, "vers\n'
        + "[1, 2]\n"
        + _line({"step": 3, "t": 3.0, "version": 3, "loss": 0.25})
    )
    (tmp_path / "events.jsonl").write_text(
        _line(_event("eval", 1, 1.0, accuracy=0.5))
        + '{"schema": 1, "kind": "episode", "tr\n'
        + _line({"no": "kind"})
        + _line(_event("eval", 3, 3.0, accuracy=0.75))
    )
    with pytest.warns(TruncatedRecordWarning) as caught:
        m = load_metrics(tmp_path)
        ev = load_events(tmp_path)
    messages = " ".join(str(w.message) for w in caught)
    assert "line 2 is not valid JSON" in messages and "line 3 is a JSON list" in messages
    assert "without a 'kind'" in messages
    assert m["step"].tolist() == [1, 3] and m.loc[3, "loss"] == 0.25
    assert list(ev) == ["eval"] and ev["eval"]["accuracy"].tolist() == [0.5, 0.75]
    with pytest.warns(TruncatedRecordWarning):
        run = load_run(tmp_path)
    assert run.version == 3 and len(run.warnings) >= 3


def test_missing_run_directory_is_a_clear_error(tmp_path):
    for fn in (load_run, load_events, load_metrics):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            fn(tmp_path / "nope")
    with pytest.raises(ValueError, match="no 'reliability' bins"):
        reliability_frame({"accuracy": 0.5})


@pytest.mark.slow
def test_frames_of_real_runs(demo_runs):
    azr_dir, rlcr_dir = demo_runs["absolute_zero"], demo_runs["rlcr"]
    ev = load_events(azr_dir)
    assert {"learner_start", "episode", "eval", "weights_published", "actor_status", "sample", "learner_stop"} <= set(
        ev
    )
    assert all(isinstance(df, pd.DataFrame) and (df["kind"] == k).all() for k, df in ev.items())
    run = load_run(azr_dir)
    assert run.algorithm == "absolute_zero" and run.version == 3
    assert run.metrics["version"].tolist() == [1, 2, 3]
    assert len(run.episodes()) == len(ev["episode"]) == 12
    q = run.table("azr_questions")
    final = q[q["final"]]
    assert len(final) == 12 * 8  # every prompt's final group of 8 questions
    assert final.groupby("episode_id")["sampled"].sum().max() == 1
    assert {"ratio:safety", "ratio:completion", "passed:safety", "window:completion"} <= set(q.columns)
    groups = run.table("azr_groups")
    assert (groups["attempts"] == groups["repropose_attempts"] + 1).all()
    assert (groups["kept"] == (groups["final_status"] == "mixed")).all()
    samples = ev["sample"]
    assert samples["step"].tolist() == [1, 2, 3]  # log.sample_every=1
    s = samples.iloc[-1]
    n = len(s["tokens"])
    assert n == s["num_tokens"] and all(
        len(s[k]) == n for k in ("loss_mask", "exp_mask", "behavior_logprobs", "current_logprobs")
    )
    assert s["current_logprobs"][0] is None and sum(s["loss_mask"]) > 0
    # where the token was learned, the behaviour log-prob is a real (negative) log-prob
    assert all(b < 0 for b, m in zip(s["behavior_logprobs"], s["loss_mask"]) if m)

    rlcr = load_run(rlcr_dir)
    nodes = rlcr.table("rlcr_nodes")
    assert rlcr.algorithm == "rlcr" and len(nodes) == 6 * 2 * 2
    assert set(nodes["correct"]) <= {0.0, 1.0} and nodes["brier_reward"].between(0, 1).all()
    for turn in ("answer_tokens", "confidence_tokens"):  # generated (trained) tokens of each turn
        assert (nodes[turn] >= 1).all() and (nodes[turn] % 1 == 0).all(), nodes[turn]
    evals = rlcr.evals()
    assert evals["version"].tolist() == [0, 2, 3]
    assert reliability_frame(evals.iloc[-1].to_dict())["count"].sum() == 8


@pytest.mark.slow
def test_reads_a_run_while_it_is_being_written(tmp_path, tiny_overrides):
    overrides = [
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=live",
        "train.total_steps=100000",
        "train.batch_tasks=2",
        "actor.tasks_per_batch=2",
        "sampling.n=2",
        "eval.size=4",
        "eval.every=0",
        "log.progress=false",
        "checkpoint.every=0",
    ]
    proc, output = start_logged(cli("run", "-c", str(ROOT / "configs" / "quickstart.yaml"), *overrides))
    run_dir = tmp_path / "live"
    store = RunStore()
    seen_steps: list[int] = []
    polls_with_new_steps = 0
    try:
        deadline = time.time() + 180
        reader = None
        # until 4 steps were read over at least two reads that found new steps (the run is stopped)
        while time.time() < deadline and (len(seen_steps) < 4 or polls_with_new_steps < 2):
            assert proc.poll() is None, "".join(output.lines)[-3000:]
            if reader is None and run_dir.exists():
                reader = RunReader(run_dir, store)
            if reader is not None:
                before = len(store.metric_records())
                reader.poll()
                new = [m["step"] for m in store.metric_records()[before:]]
                seen_steps += new
                polls_with_new_steps += bool(new)
            time.sleep(0.2)
        assert len(seen_steps) >= 4 and polls_with_new_steps >= 2, f"only {seen_steps} after 180 s"
        assert proc.poll() is None  # all of it was read while the run was going
    finally:
        stop(proc, signal.SIGINT, timeout=120)
    assert seen_steps == sorted(set(seen_steps)) and seen_steps[0] == 1  # no step twice, none out of order
    assert store.records("learner_start") and store.records("episode")
    assert store.config.get("name") == "live"
    reader.poll()  # after the stop: everything the learner wrote, nothing twice
    final = load_run(run_dir)
    assert final.metrics["step"].tolist() == [m["step"] for m in store.metric_records()]
    assert len(final.records("episode")) == len(store.records("episode"))
