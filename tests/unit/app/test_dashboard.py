"""Issue 11 ("trust what you see"), without processes: what the run loader, the views and the
learner's per-step figures claim. The browser and end-to-end checks are in tests/e2e/test_ui.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from asyncrl.analysis import (
    NA,
    RunReader,
    RunStore,
    calibration_summary,
    chart_data,
    curves_frame,
    eval_series,
    list_runs,
    metric_columns,
    metric_group,
    run_state,
    runs_table,
    smooth,
    tag,
)


def _event(kind: str, step: int, t: float, **fields) -> dict:
    return {"schema": 1, "kind": kind, "t": t, "step": step, **fields}


def _write_run(run_dir, steps: int = 100, eval_every: int = 25, stop: dict | None = None, pid: int | None = None):
    """A run directory as the learner writes it: metrics every step, eval/* every ``eval_every``
    steps (and an ``eval`` event at version 0 too), learner_start, optionally learner_stop and the
    pid file of a learner."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            rec = {
                "step": s,
                "t": 1000.0 + s,
                "version": s,
                "reward_mean": s / steps,
                "loss": 1.0 / s,
                "entropy": 2.0 - s / steps,
                "unified_filter/learnable_ratio": 0.5,
                "dropped_stale": 0,
            }
            if s % eval_every == 0:
                rec["eval/accuracy"] = 0.2 + s / (2 * steps)
            f.write(json.dumps(rec) + "\n")
    events = [_event("learner_start", 0, 1000.0, total_steps=steps, pid=pid)]
    events += [
        _event("eval", v, 1000.0 + v, version=v, accuracy=0.2 + v / (2 * steps), size=8)
        for v in range(0, steps + 1, eval_every)
    ]
    if stop is not None:
        events.append(_event("learner_stop", steps, 2000.0, **stop))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "config.yaml").write_text(f"name: {run_dir.name}\nalgorithm: grpo\ntrain:\n  total_steps: {steps}\n")
    if pid is not None:
        (run_dir / "learner.pid").write_text(f"{pid}\n")
    return run_dir


def _load(run_dir) -> RunStore:
    store = RunStore()
    RunReader(run_dir, store).poll()
    return store


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ------------------------------------------------------------------------------------- item 3
def test_heldout_accuracy_is_one_connected_series_over_its_evaluations(tmp_path):
    store = _load(_write_run(tmp_path / "r", steps=100, eval_every=25, stop={"interrupted": False}))
    assert eval_series(store)["step"].tolist() == [0, 25, 50, 75, 100]  # the evaluation before training too
    charts = {c["metric"]: c for g in chart_data({"r": store})["groups"] for c in g["charts"]}
    held = charts["eval/accuracy"]["series"][0]
    assert held["step"] == [0, 25, 50, 75, 100] and None not in held["y"]  # no gap breaks the line
    assert len(charts["reward_mean"]["series"][0]["y"]) == 100
    # the explorer's long frame for notebooks draws it the same way (eval/* from the eval events)
    frame = curves_frame({"r": store}, ["eval/accuracy"])
    assert frame["step"].tolist() == [0, 25, 50, 75, 100] and frame["value"].notna().all()


def test_every_metric_is_its_own_chart_grouped_with_three_x_axes(tmp_path):
    """Issue 29 item 1: one chart per metric, grouped by section; a metric that never changed is
    listed with its value instead of drawn as a flat line; x = step, wall time, samples."""
    run = _write_run(tmp_path / "a", steps=30, eval_every=10)
    with open(run / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    with open(run / "metrics.jsonl", "w") as f:
        for r in recs:
            f.write(
                json.dumps(
                    {
                        **r,
                        "grad_norm": 18.0 - r["step"] / 2,
                        "batch_trajectories": 8,
                        "sync/bytes_sent": 1000 * r["step"],
                    }
                )
                + "\n"
            )
    data = chart_data({"a": _load(run)}, pinned=["grad_norm", "nope"])
    groups = [g["name"] for g in data["groups"]]
    assert groups[:3] == ["pinned", "reward", "eval"] and "policy" in groups and "sync" in groups
    assert groups.index("policy") < groups.index("sync") < groups.index("unified_filter")  # unknown sections last
    by = {c["metric"]: (g["name"], c) for g in data["groups"] for c in g["charts"]}
    assert by["grad_norm"][0] == "pinned" and by["loss"][0] == "policy" and by["entropy"][0] == "policy"
    flat = {f["metric"]: f["why"] for g in data["groups"] for f in g["flat"]}
    assert flat["dropped_stale"].startswith("0.0 at every logged step (30 steps)")
    assert flat["unified_filter/learnable_ratio"].startswith("0.5 at every")
    assert "eval/version" not in by and "eval/version" not in flat  # the x axis itself is not a chart
    s = by["grad_norm"][1]["series"][0]
    assert s["step"][:3] == [1, 2, 3] and s["y"][:2] == [17.5, 17.0]
    assert s["time"][:3] == [1, 2, 3]  # seconds since learner_start at t=1000
    assert s["samples"][:3] == [8, 16, 24]  # trajectories trained on so far
    held = by["eval/accuracy"][1]["series"][0]
    assert held["step"] == [0, 10, 20, 30] and held["samples"] == [0, 80, 160, 240] and held["time"][0] == 0
    assert [metric_group(m) for m in ("loss", "tokens_per_s", "eval/accuracy", "mystery")] == [
        "policy",
        "throughput",
        "eval",
        "other",
    ]
    assert tag("loss") == "policy/loss" and tag("eval/accuracy") == "eval/accuracy"


def test_the_runs_table_has_final_figures_and_the_config_keys_that_differ(tmp_path):
    a = _write_run(tmp_path / "a", steps=30, eval_every=10, stop={"interrupted": False})
    b = _write_run(tmp_path / "b", steps=20, eval_every=10)
    (b / "config.yaml").write_text("name: b\nalgorithm: grpo\ntrain:\n  total_steps: 20\n  lr: 0.001\n")
    df = runs_table({"a": _load(a), "b": _load(b)})
    assert df["run"].tolist() == ["a", "b"] and df["steps"].tolist() == [30, 20]
    assert df["state"].tolist()[0] == "finished"
    assert df["eval/accuracy"].tolist() == [pytest.approx(0.2 + 30 / 60), pytest.approx(0.2 + 20 / 40)]
    assert df["wall time (s)"].tolist() == [30, 20]
    assert df["train.total_steps"].tolist() == [30, 20] and df["train.lr"].tolist() == ["-", 0.001]
    assert "algorithm" in df and "name" not in df  # the same in both (and the name is the run's)


# ------------------------------------------------------------------------------------- item 4
def test_run_state_finished_interrupted_crashed_running(tmp_path):
    assert run_state(_load(_write_run(tmp_path / "a", stop={"interrupted": False}))).state == "finished"
    interrupted = run_state(_load(_write_run(tmp_path / "b", stop={"interrupted": True})))
    assert interrupted.state == "interrupted" and "before total_steps" in interrupted.reason
    killed = run_state(_load(_write_run(tmp_path / "c", pid=(dead := _dead_pid()))))
    assert killed.state == "crashed" and f"pid {dead}" in killed.reason
    no_pid = run_state(_load(_write_run(tmp_path / "d")))  # exited without its orderly stop
    assert no_pid.state == "crashed" and "no learner_stop" in no_pid.reason
    assert run_state(_load(_write_run(tmp_path / "e", pid=os.getpid()))).state == "running"
    # a resumed run: the earlier segment's learner_stop does not make the new segment finished
    resumed = _load(_write_run(tmp_path / "f", stop={"interrupted": True}, pid=os.getpid()))
    resumed.add_events([_event("learner_start", 100, 3000.0, total_steps=200)])
    assert run_state(resumed).state == "running"
    (tmp_path / "g").mkdir()
    assert run_state(_load(tmp_path / "g")).state == "waiting"
    # 64.7: an asyncrl replay's output (metrics and its own end record, no learner) was shown as crashed
    replay = _load(_replay_dir(tmp_path / "r"))
    state = run_state(replay)
    assert state.state == "finished" and "a replay of" in state.reason, state


def test_overview_shows_the_run_state_and_a_finished_run_has_no_actor_lag(tmp_path):
    from asyncrl.app import views as V

    store = _load(_write_run(tmp_path / "r", pid=_dead_pid()))
    store.add_events(
        [_event("actor_status", 90, 1090.0, actor_id="actor-0", version=88, batches=3, unacked=8, credits=4)]
    )
    html = V.overview_html(store)
    assert 'id="run-status" class="arl-state-crashed"' in html and "no learner_stop event" in html
    actors = V.actors_html(store)
    assert "run crashed" in actors and ">12<" not in actors
    row = actors[actors.index('class="arl-row"') :]
    assert "<td>-</td>" in row  # the lag cell: blank once the run is over
    cells = row[: row.index("</tr>")]
    assert ">8<" not in cells and ">4<" not in cells  # 64.7: nor its last unacked count and credits
    assert "last status (s ago)" in actors and "last_status_s_ago" not in actors  # headers in words
    assert "versions behind the learner" in actors and "buffer.max_staleness bounds something else" in actors


def test_summary_prints_no_learning_summary_for_a_run_that_trained_nothing(capsys):
    from asyncrl.learner.progress import summary_table

    out = summary_table(
        [],
        [{"accuracy": 1.0, "version": 0}],
        trained_steps=0,
        total_steps=50,
        stopped="stopped by a stop signal at step 0",
        heldout="held-out: 8 tasks",
    )
    printed = capsys.readouterr().out
    assert "no learning summary: this run trained 0 steps (stopped by a stop signal at step 0)" in printed
    assert "held-out accuracy" not in printed and "1.000" not in printed and "held-out: 8 tasks" in printed
    assert out["steps_trained"] == 0 and "eval_accuracy_start" not in out


# ------------------------------------------------------------------------------------- items 5 and 6
def test_rlcr_summary_has_ece_and_brier_and_na_over_zero_parsed_confidences(capsys):
    from asyncrl.learner.progress import summary_table

    start = {"version": 0, "accuracy": 0.0, "ece": 0.0, "brier": 0.0, "size": 32, "confidence_parse_fail": 1.0}
    end = {"version": 4, "accuracy": 0.25, "ece": 0.125, "brier": 0.1875, "size": 32, "confidence_parse_fail": 0.25}
    out = summary_table([0.0, 0.5], [start, end], trained_steps=2, total_steps=2)
    printed = capsys.readouterr().out
    assert out["eval_ece_start"] is None and out["eval_ece_end"] == 0.125
    assert out["eval_brier_start"] is None and out["eval_brier_end"] == 0.1875
    assert out["confidences_parsed_start"] == 0 and out["confidences_parsed_end"] == 24
    for row in ("held-out ECE", "held-out Brier score", "0/32", "24/32"):
        assert row in printed
    assert "n/a" in printed
    assert calibration_summary(start)["ece"] is None and calibration_summary(end)["brier"] == 0.1875


def test_calibration_figure_says_how_many_confidences_it_rests_on():
    from asyncrl.algos.rlcr.ui import calibration_figure
    from asyncrl.app import views as V

    bins = [
        {
            "lo": b / 10,
            "hi": (b + 1) / 10,
            "count": 32 if b == 0 else 0,
            "confidence": 0.0 if b == 0 else None,
            "accuracy": 0.0 if b == 0 else None,
        }
        for b in range(10)
    ]
    store = RunStore()
    store.add_events(
        [
            _event(
                "eval",
                v,
                float(v),
                version=v,
                accuracy=0.0,
                ece=0.0,
                brier=0.0,
                size=32,
                confidence_parse_fail=1.0,
                reliability=bins,
            )
            for v in (0, 2)
        ]
    )
    fig = calibration_figure(store)
    title = fig.axes[0].get_title()
    assert "ECE n/a" in title and "Brier n/a" in title and "0 of 32 confidences parsed" in title
    assert V.fmt(float("nan")) == NA and V.fmt(None) == "-"


# ------------------------------------------------------------------------------------- item 9
def test_batch_metrics_response_length_identical_groups_and_named_scores():
    from asyncrl.learner.training.batch_stats import batch_metrics
    from asyncrl.types import Episode, Trajectory

    def traj(group: str, reward: float, generated: int, **scores) -> Trajectory:
        n = 3 + generated
        return Trajectory(
            token_ids=np.arange(n),
            loss_mask=np.r_[np.zeros(3), np.ones(generated)],
            behavior_logprobs=np.zeros(n),
            policy_version=0,
            reward=reward,
            group_id=group,
            scores={"reward": reward, **scores},
        )

    episodes = [
        Episode(trajectories=[traj("a", 1.0, 2, format=1.0), traj("a", 1.0, 4, format=0.0)]),  # no signal
        Episode(trajectories=[traj("b", 0.0, 6, format=1.0), traj("b", 1.0, 8, format=1.0)]),  # signal
        Episode(trajectories=[traj("c", 0.0, 1)]),
    ]  # a group of one: not a group
    m = batch_metrics(episodes)
    assert m["response_length_mean"] == pytest.approx((2 + 4 + 6 + 8 + 1) / 5) and m["response_length_max"] == 8
    assert m["groups/count"] == 2 and m["groups/identical_reward_share"] == 0.5
    assert m["score/format"] == pytest.approx(3 / 4) and "score/reward" not in m


def test_trainer_logs_the_exact_per_token_entropy_every_step(tiny_overrides):
    from asyncrl.config import load_config
    from asyncrl.learner.training.batch import compute_logprobs
    from asyncrl.learner.training.trainer import PolicyTrainer
    from asyncrl.models.loading import load_policy
    from asyncrl.objectives.logprobs import entropy_from_logits
    from asyncrl.types import Trajectory

    cfg = load_config(None, [*tiny_overrides, "train.entropy_coef=0", "train.lr=1e-9"])
    model, tok, _ = load_policy(cfg.model, cfg.seed)
    rng = np.random.default_rng(0)
    trajs = [
        Trajectory(
            token_ids=rng.integers(4, len(tok), 9),
            loss_mask=np.r_[np.zeros(4), np.ones(5)],
            behavior_logprobs=np.zeros(9),
            policy_version=0,
            reward=float(i % 2),
            group_id="g",
        )
        for i in range(4)
    ]
    trainer = PolicyTrainer(model, tok, cfg.train, 1.0)
    batch = trainer.make_batch([type("E", (), {"trajectories": trajs})()])
    with torch.no_grad():  # the expected figure, computed here from the model's own logits
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        ent = entropy_from_logits(logits.float())
        expected = float((ent * batch.response_mask).sum() / batch.response_mask.sum())
    stats = trainer.step(batch).stats
    assert stats["entropy"] == pytest.approx(expected, rel=1e-4)
    _, no_graph = compute_logprobs(model, batch, 1.0, with_entropy=True, entropy_grad=False)
    assert not no_graph.requires_grad  # for the metric only: no graph is kept


def test_metric_columns_smoothing_and_overlaid_runs(tmp_path):
    a = _load(_write_run(tmp_path / "sync", steps=40, eval_every=10))
    b = _load(_write_run(tmp_path / "async", steps=20, eval_every=10))
    cols = metric_columns(a.metrics)
    assert {
        "reward_mean",
        "loss",
        "entropy",
        "eval/accuracy",
        "unified_filter/learnable_ratio",
        "dropped_stale",
    } <= set(cols)
    assert not {"step", "t", "version"} & set(cols)
    frame = curves_frame({"sync": a, "async": b}, ["reward_mean", "eval/accuracy"], smoothing=0.0)
    assert set(frame["series"]) == {
        "sync · reward_mean",
        "async · reward_mean",
        "sync · eval/accuracy",
        "async · eval/accuracy",
    }
    assert len(frame[frame["series"] == "async · reward_mean"]) == 20
    s = smooth(pd.Series([0.0, 1.0, np.nan, 1.0]), 0.5)
    assert s.iloc[0] == 0.0 and s.iloc[1] == pytest.approx(2 / 3) and math.isnan(s.iloc[2])
    with pytest.raises(ValueError, match="smoothing weight"):
        smooth(pd.Series([1.0]), 1.0)
    assert [p.name for p in list_runs(tmp_path)] == ["async", "sync"]


def test_config_view_shows_every_snapshot(tmp_path):
    from asyncrl.app import views as V

    run = _write_run(tmp_path / "r")
    (run / "config.resume-50.yaml").write_text("name: r\ntrain:\n  lr: 0.5\n")
    html = V.config_html(_load(run))
    assert "config.yaml (the run&#x27;s first segment)" in html and "total_steps: 100" in html
    assert "config.resume-50.yaml (the segment resumed at step 50)" in html and "lr: 0.5" in html
    assert "No config snapshot" in V.config_html(RunStore())


# ------------------------------------------------------------------------------------- item 11
def test_a_missing_tracker_library_is_one_line_naming_the_pip_package(monkeypatch):
    from asyncrl.config import ConfigError
    from asyncrl.rundir import runlog

    monkeypatch.setitem(runlog.TRACKERS, "wandb", ("asyncrl_no_such_module", "wandb"))
    with pytest.raises(ConfigError) as err:
        runlog.check_trackers(["tensorboard", "wandb"])
    msg = str(err.value)
    assert "\n" not in msg and "log.trackers: wandb needs the 'wandb' package" in msg and "pip install wandb" in msg
    with pytest.raises(ConfigError, match="unknown tracker 'mlflow'"):
        runlog.check_trackers(["mlflow"])


def _wandb_history(path) -> list[tuple[int, dict]]:
    """The history records of an offline W&B run file, decoded with W&B's own protobuf classes.
    The file is W&B's transaction log: a 7-byte header, then 32 KiB blocks of records framed as in
    LevelDB's log format (crc32c u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, pending, out = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and n == 0:
            break
        pending += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            if rec.WhichOneof("record_type") == "history":
                out.append(
                    (
                        rec.history.step.num,
                        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item},
                    )
                )
    return out


def test_metrics_reach_tensorboard_wandb_and_trackio(tmp_path, monkeypatch):
    """The three trackers through their own client libraries, read back with those libraries'
    readers (W&B offline, Trackio in a local directory)."""
    from asyncrl.rundir.runlog import RunLog, open_trackers

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    run_dir = tmp_path / "run"
    sinks = open_trackers(["tensorboard", "wandb", "trackio"], run_dir, "t11", "asyncrl-test", {"seed": 0})
    log = RunLog(run_dir, trackers=sinks)
    for step in (1, 2, 3):
        log.metric(step, {"reward_mean": step / 10, "eval/accuracy": float("nan"), "note": "x", "flag": True})
    log.close()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/reward_mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert "eval/accuracy" not in acc.Tags()["scalars"]  # NaN is not a value (and eval/* go with the eval event)

    logs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    assert [(s, h["reward/reward_mean"]) for s, h in _wandb_history(logs[0])] == [(1, 0.1), (2, 0.2), (3, 0.3)]

    import sqlite3

    dbs = list((tmp_path / "trackio").glob("*.db"))
    assert dbs, f"no trackio database in {tmp_path / 'trackio'}"
    with sqlite3.connect(dbs[0]) as con:
        rows = con.execute("SELECT step, metrics FROM metrics ORDER BY step").fetchall()
    assert [(s, json.loads(m)["reward/reward_mean"]) for s, m in rows] == [(1, 0.1), (2, 0.2), (3, 0.3)]


# ------------------------------------------------------------------------------------- item 12
def test_small_fixes_cards_counts_headers_and_replay_plots(tmp_path):
    from asyncrl.app import views as V

    assert V.fmt_rate(1234.5678) == "1,235" and V.fmt_rate(56.789) == "56.8" and V.fmt_rate(0.123456) == "0.123"
    store = RunStore(max_events_per_kind=5)
    store.add_events([_event("episode", s, float(s), episode_id=f"e{s}") for s in range(12)])
    html = V.overview_html(store)
    assert "12 <small>(latest 5 kept)</small>" in html  # a count, not the cap
    q = pd.DataFrame({"window:completion": ["<0.5 in [0.3, 0.7]"], "window:safety": [">0.5 in [0.3, 0.7]"]})
    from asyncrl.algos.absolute_zero.ui import ratio_header

    assert ratio_header(q, "completion") == "share completion<0.5 (pass [0.3, 0.7])"  # i.e. the wrong answers
    assert ratio_header(q, "safety") == "share safety>0.5 (pass [0.3, 0.7])"
    fig = V.replay_figure(RunStore())
    w, h = fig.get_size_inches()
    assert w / h < 2.5  # three panels a row: readable at the page's width (was 5 in one strip, 8:1)
    assert "white-space:nowrap" in V.CSS and "word-break:keep-all" in V.CSS


# ------------------------------------------------------------------------------------- item 6 (CLI)
RLCR_SMALL_MODEL = [
    "model.embedded.hidden_size=32",
    "model.embedded.num_layers=2",
    "model.embedded.num_heads=2",
    "model.embedded.intermediate_size=64",
    "model.embedded.warmup_steps=120",
    "model.embedded.warmup_batch_size=16",
    "model.embedded.warmup_lr=5e-3",
]


@pytest.mark.slow
def test_init_model_prints_the_accuracy_of_the_format_it_was_warm_started_for(model_cache, tiny_overrides):
    """An RLCR model answers in tags: its plain-arithmetic accuracy says nothing (0.000 for a model
    that is right in its own format). init-model measures it as the run does: answers and
    confidences parsed from the tags, calibration beside the accuracy."""
    import re

    from tests.conftest import ROOT, run_cli

    res = run_cli(
        "init-model",
        "-c",
        str(ROOT / "configs" / "rlcr.yaml"),
        f"model.embedded.cache_dir={model_cache}",
        *RLCR_SMALL_MODEL,
        "log.progress=false",
        "eval.size=50",
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    m = re.search(
        r"held-out accuracy as a rlcr run measures it \(50 tasks, T=1\): (\d\.\d{3}); ECE (\S+), Brier (\S+) "
        r"\((\d+) of 50 confidences parsed; answer format failures (\d+)%\)",
        res.stdout,
    )
    assert m, res.stdout
    assert int(m.group(4)) > 0 and int(m.group(5)) < 100  # the tag format was measured: tags were found
    assert "plain arithmetic" not in res.stdout  # not warm-started for it: no misleading 0.000
    # a plain-arithmetic model still prints its build-time figures, and only those
    res = run_cli("init-model", *tiny_overrides, "log.progress=false", timeout=300)
    assert res.returncode == 0 and "held-out accuracy, plain arithmetic (a+b=): sampled (T=1)" in res.stdout
    assert "as a grpo run measures it" not in res.stdout


def test_a_folder_of_runs_shows_every_run_unless_some_are_picked(tmp_path):
    """The app's own handlers: with no run picked, a folder of runs charts all of them (up to
    MAX_DEFAULT_RUNS) and lists them; picking narrows it."""
    from asyncrl.app.live import RunCatalog
    from asyncrl.app.main import build_app

    for name, written in (("a", 2000.0), ("b", 1000.0)):  # a written to last
        run = _write_run(tmp_path / name, steps=30 if name == "a" else 20, eval_every=10)
        for f in run.iterdir():
            os.utime(f, (written, written))
    catalog = RunCatalog(folder=tmp_path)
    try:
        fn = next(f for f in build_app(catalog, title="t").fns.values() if f.name == "heavy")
        rest = [None] * (len(fn.inputs) - 3)  # the algorithms' views' inputs and the sample choice

        def heavy(sel, pins, focus=None):
            return fn.fn("", {"sel": sel, "focus": focus}, pins, *rest)

        out = heavy([], ["entropy"])
        runs_view, charts = out[0], json.loads(out[1])
        assert [r["name"] for r in charts["runs"]] == ["a", "b"] and 'id="runs-table"' in runs_view
        assert charts["groups"][0]["name"] == "pinned" and charts["groups"][0]["charts"][0]["metric"] == "entropy"
        assert len(charts["groups"][0]["charts"][0]["series"]) == 2  # both runs overlaid
        one = json.loads(heavy(["b"], [])[1])
        assert [r["name"] for r in one["runs"]] == ["b"]
        assert json.loads(heavy(["nope"], [])[1])["runs"] == []  # a run that is not in the folder

        # the run the cards and tabs show: the first picked, or the one named (issue 42.7)
        def focus_of(out):
            return next(
                o for o in out if isinstance(o, dict) and "choices" in o and "value" in o and o["value"] in ("a", "b")
            )["value"]

        assert focus_of(heavy([], [])) == "a" and focus_of(heavy([], [], focus="b")) == "b"
        assert focus_of(heavy(["a", "b"], [], focus="nope")) == "a"
        # 64.7: none picked shows the runs written to last, newest first (a demo run named later by name hid)
        for f in (tmp_path / "b").iterdir():
            os.utime(f, (3000.0, 3000.0))
        assert [r["name"] for r in json.loads(heavy([], [])[1])["runs"]] == ["b", "a"]
    finally:
        catalog.stop()


def test_wandb_without_a_login_is_one_line_before_the_run_starts(tmp_path):
    """64.3: ``log.trackers=[wandb]`` with no login gave a 30-line traceback from ``wandb.init`` in the
    learner; it is refused at start in one line saying what to do, and offline mode or a key passes."""
    import subprocess
    import sys

    from tests.conftest import ROOT, subprocess_env

    env = {k: v for k, v in subprocess_env().items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "netrc"))

    def dry_run(**extra) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "asyncrl",
                "run",
                "--dry-run",
                "-c",
                "configs/quickstart.yaml",
                "log.trackers=[wandb]",
                f"run_root={tmp_path / 'runs'}",
            ],
            cwd=ROOT,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=180,
        )

    res = dry_run()
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert "wandb has no login here" in lines[0] and "wandb login" in lines[0] and "WANDB_MODE=offline" in lines[0]
    assert dry_run(WANDB_MODE="offline").returncode == 0
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")
    os.chmod(tmp_path / "netrc", 0o600)
    assert dry_run().returncode == 0, dry_run().stderr[-2000:]


def test_a_run_whose_reward_raises_says_so_in_its_summary(capsys):
    """64.5: every reward call failed: the stop reason was centred and wrapped in the table's title, the
    table said "held-out accuracy 0.000" and an empty step counted as trained."""
    from asyncrl.learner.progress import summary_table

    reason = "the reward failed on 20 of 20 calls (env.max_failure_rate=0.5): KeyError: 'answer'"
    failed = {"version": 0, "accuracy": 0.0, "size": 200, "failures": 200}
    out = summary_table([], [failed], trained_steps=0, total_steps=50, stopped=reason, empty_steps=3)
    printed = capsys.readouterr().out
    assert f"[learner] stopped after 0 of 50 steps: {reason}\n" in printed  # one plain line, in full
    assert "3 step(s) had no trajectory to train on" in printed and out["empty_steps"] == 3
    out = summary_table([0.5, 0.5], [failed, {**failed, "version": 2}], trained_steps=2, total_steps=50, stopped=reason)
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if "held-out accuracy" in line)
    assert "0.000" not in row and "n/a" in row
    assert "held-out reward calls failed" in printed and "200 of 200" in printed
    title = next(line for line in printed.splitlines() if "asyncrl run summary" in line)
    assert "KeyError" not in title


def _replay_dir(path):
    """What asyncrl replay writes: metrics, then a replay event (no learner_start, no pid file)."""
    import json as _json

    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text(
        "".join(_json.dumps({"step": i, "t": 1000.0 + i, "version": i, "reward_mean": 0.5}) + "\n" for i in range(1, 4))
    )
    (path / "events.jsonl").write_text(
        _json.dumps(
            {"schema": 1, "kind": "replay", "t": 1004.0, "step": 3, "source": "runs/x", "steps": 3, "identical": True}
        )
        + "\n"
    )
    return path
