"""Fault injection for durability (issue 19 items 1, 3, 4, 5; issue 11 item 2): torn, garbage and
zero-filled WAL tails; failed writes; damaged checkpoints; a second learner; reused run names;
explicit resume. Each case that involves acknowledged episodes counts their ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from asyncrl.config import load_config
from asyncrl.learner.checkpoint import save_checkpoint
from asyncrl.learner.ingest.buffer import EpisodeQueue
from asyncrl.rundir.layout import MANIFEST, list_checkpoints, select_checkpoint, verify_checkpoint
from asyncrl.rundir.record_file import encode_record
from asyncrl.wire.codec import encode_episode
from tests.conftest import (
    ROOT,
    ResumableRun,
    checkpoint_buffer_ids,
    effective_training,
    read_jsonl,
    run_cli,
    subprocess_env,
    wal_ids,
)
from tests.conftest import SMALL_RUN as COMMON
from tests.support.ledger_checks import ledger_duplicates
from tests.support.wal import wal_episode


# -- a poisoned WAL record, end to end ----------------------------------------------------------
@pytest.mark.slow
def test_a_resume_with_a_poisoned_wal_record_trains_on(tmp_path, tiny_overrides):
    """25.5 end to end: a resume that restores a record with an impossible token id reports and
    quarantines it, and trains to the end instead of crashing at the step that took it."""
    overrides = [
        *tiny_overrides,
        *COMMON,
        f"run_root={tmp_path}",
        "name=poison",
        "checkpoint.every=2",
        "buffer.max_staleness=1000",
    ]
    res = _cli("run", *overrides, "train.total_steps=2")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    evil = wal_episode("evil", n=6)
    evil.trajectories[0].token_ids = np.array([1, 2, 10**6, 3, 4, 5])
    wal = sorted((tmp_path / "poison" / "buffer").glob("wal-*.bin"))[-1]
    with open(wal, "ab") as f:
        f.write(encode_record(encode_episode(evil)))
    res = _cli("run", *overrides, "train.total_steps=5", "--resume")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "episode evil fails the receipt checks (token_range" in res.stdout
    events = read_jsonl(tmp_path / "poison" / "events.jsonl")
    assert [e["episode_id"] for e in events if e["kind"] == "wal_quarantined"] == ["evil"]
    assert "evil" not in {e.get("episode_id") for e in events if e["kind"] == "episode"}
    assert [m["step"] for m in read_jsonl(tmp_path / "poison" / "metrics.jsonl")][-1] == 5


# -- checkpoints -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy(tiny_overrides):
    from asyncrl.models.loading import load_policy

    cfg = load_config(None, tiny_overrides)
    model, tokenizer, _ = load_policy(cfg.model, cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(8).unsqueeze(0)).logits.mean().backward()
    opt.step()  # a real optimizer state (exp_avg, exp_avg_sq per parameter)
    return model, tokenizer, opt


def _two_checkpoints(run_dir, policy) -> EpisodeQueue:
    model, tokenizer, opt = policy
    buf = EpisodeQueue(run_dir / "buffer", 1000)
    buf.open_wal(0)
    for step in (2, 4):
        for i in range(6):
            ep = wal_episode(f"s{step}-{i}", version=step)
            buf.add(ep, encode_episode(ep))
        save_checkpoint(run_dir, step, model, tokenizer, opt, buf, {}, keep=2)
    return buf


@pytest.mark.parametrize("victim", ["model/model.safetensors", "optimizer.pt", "state.json", "buffer.bin", MANIFEST])
def test_a_truncated_checkpoint_file_is_named_and_the_older_one_chosen(tmp_path, policy, victim):
    _two_checkpoints(tmp_path, policy)
    newest = tmp_path / "checkpoints" / "step_00000004"
    assert verify_checkpoint(newest) is None
    f = newest / victim
    os.truncate(f, f.stat().st_size // 2)
    chosen, damaged = select_checkpoint(tmp_path)
    assert chosen == tmp_path / "checkpoints" / "step_00000002"
    assert len(damaged) == 1 and damaged[0][0] == newest and str(f) in damaged[0][1], damaged
    assert len(checkpoint_buffer_ids(chosen)) == 6  # the older checkpoint's buffer reads whole


def test_a_failed_checkpoint_write_leaves_no_temp_dir(tmp_path, policy, tiny_overrides):
    _two_checkpoints(tmp_path, policy)
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from pathlib import Path
        from asyncrl.config import load_config
        from asyncrl.learner.ingest.buffer import EpisodeQueue
        from asyncrl.learner.checkpoint import save_checkpoint
        from asyncrl.models.loading import load_policy
        cfg = load_config(None, {tiny_overrides!r})
        model, tok, _ = load_policy(cfg.model, cfg.seed)
        opt = torch.optim.AdamW(model.parameters())
        buf = EpisodeQueue(Path(sys.argv[1]) / "buffer", 100)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
        try:
            save_checkpoint(Path(sys.argv[1]), 6, model, tok, opt, buf, {{}}, keep=2)
        except Exception as e:
            print("raised", type(e).__name__)
    """)
    weights = (tmp_path / "checkpoints" / "step_00000004" / "model" / "model.safetensors").stat().st_size
    res = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), str(weights // 2)],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "raised" in res.stdout, res.stdout[-1000:] + res.stderr[-2000:]  # SafetensorError (EFBIG)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]
    assert verify_checkpoint(root / "step_00000004") is None


# -- real processes --------------------------------------------------------------------------------
def _tree(run_dir) -> dict:
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*")}


def _cli(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=ROOT, timeout=timeout)


@pytest.mark.slow
def test_a_second_learner_is_refused_naming_the_first(tmp_path, tiny_overrides):
    overrides = [*tiny_overrides, *COMMON, "train.total_steps=50"]
    with ResumableRun(tmp_path, "one", overrides) as run:
        first = run.start_learner()
        addrs = run.addresses()
        before = _tree(run.dir)
        for command in (
            ["learn", *run.overrides, "--resume"],
            ["run", *run.overrides, "--resume"],
            ["learn", *run.overrides],
        ):
            res = _cli(*command, timeout=120)
            assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
            line = res.stderr.strip()
            assert "\n" not in line and f"in use by another learner (pid {first.pid})" in line, line
        assert first.poll() is None, "the first learner stopped"
        assert json.loads((run.dir / "addresses.json").read_text()) == addrs
        after = _tree(run.dir)
        assert {k: v for k, v in after.items() if k != "events.jsonl"} == {
            k: v for k, v in before.items() if k != "events.jsonl"
        }  # the first learner may log


@pytest.mark.slow
def test_a_reused_name_is_refused_with_nothing_written_and_overwrite_starts_fresh(tmp_path, tiny_overrides):
    overrides = [*tiny_overrides, *COMMON, f"run_root={tmp_path}", "name=reuse", "train.total_steps=3"]
    run_dir = tmp_path / "reuse"
    res = _cli("run", *overrides)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    old_ids = wal_ids(run_dir) | {
        e["episode_id"] for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "episode"
    }
    assert old_ids
    before = _tree(run_dir)
    for command in ("run", "learn"):
        res = _cli(command, *overrides, "train.lr=5e-4", timeout=120)
        assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
        line = res.stderr.strip()
        assert "\n" not in line and "already holds a run" in line
        assert "--resume" in line and "name=" in line and "--overwrite" in line
        assert _tree(run_dir) == before, f"asyncrl {command} wrote into the run dir before refusing"

    res = _cli("run", *overrides, "train.lr=5e-4", "--overwrite")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "--overwrite: removed" in res.stdout
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["kind"] for e in events].count("learner_start") == 1 and not any(e["kind"] == "resume" for e in events)
    trained = {e["episode_id"] for e in events if e["kind"] == "episode"}
    assert trained and not (trained & old_ids), "the fresh run trained the old run's episodes"
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert "lr: 0.0005" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
def test_resume_continues_steps_and_records_changed_config(tmp_path, tiny_overrides):
    overrides = [*tiny_overrides, *COMMON, f"run_root={tmp_path}", "name=cont", "checkpoint.every=2"]
    run_dir = tmp_path / "cont"
    res = _cli("run", *overrides, "train.total_steps=4")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    first_config = (run_dir / "config.yaml").read_text()
    res = _cli("run", *overrides, "train.total_steps=6", "train.lr=5e-4", "--resume")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "resumed from step 4" in res.stdout
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert (run_dir / "config.yaml").read_text() == first_config  # the first segment's snapshot
    assert "lr: 0.0005" in (run_dir / "config.resume-4.yaml").read_text()
    changed = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "config_changed"]
    assert len(changed) == 1 and {c["key"]: (c["old"], c["new"]) for c in changed[0]["changes"]} == {
        "train.lr": (0.001, 0.0005),
        "train.total_steps": (4, 6),
    }

    before = _tree(run_dir)
    res = _cli("run", *overrides, "train.total_steps=8", "model.embedded.hidden_size=64", "--resume", timeout=120)
    assert res.returncode == 2 and "model.embedded.hidden_size" in res.stderr, res.stderr[-2000:]
    assert _tree(run_dir) == before


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_keeping_the_wal(tmp_path, tiny_overrides):
    total = 9
    overrides = [
        *tiny_overrides,
        *COMMON,
        f"train.total_steps={total}",
        "checkpoint.every=2",
        "buffer.max_staleness=1000",
        "buffer.capacity=12",
    ]
    with ResumableRun(tmp_path, "dmg", overrides) as run:
        run.start_learner()
        run.start_actor()
        run.wait_version(5)  # checkpoints at steps 2 and 4
        run.kill_learner()
        older, newest = list_checkpoints(run.dir)[-2:]
        acked = run.wal_ids() | checkpoint_buffer_ids(older)  # the WAL is kept back to the older checkpoint
        victim = newest / "model" / "model.safetensors"
        os.truncate(victim, victim.stat().st_size // 2)
        run.resume()
        run.finish()
    events = run.events()
    damaged = [e for e in events if e["kind"] == "checkpoint_damaged"]
    assert len(damaged) == 1 and str(victim) in damaged[0]["problem"]
    assert str(victim) in run.log(2)
    resume = [e for e in events if e["kind"] == "resume"]
    assert len(resume) == 1 and resume[0]["checkpoint"] == str(older)
    trained = effective_training(events)
    assert len(trained) == len(set(trained))
    acknowledged = acked | {e["episode_id"] for e in events if e["kind"] == "episode"}
    lost = (
        acknowledged - set(trained) - checkpoint_buffer_ids(list_checkpoints(run.dir)[-1]) - ledger_duplicates(run.dir)
    )  # (duplicates: acknowledged, recorded, not trained)
    assert len(acknowledged) >= 20 and not lost, f"{len(lost)} of {len(acknowledged)} acknowledged episodes lost"
    assert [m["step"] for m in run.metrics()] == list(range(1, total + 1))


@pytest.mark.slow
def test_resume_without_a_checkpoint_after_trained_steps_is_refused(tmp_path, tiny_overrides):
    overrides = [*tiny_overrides, *COMMON, "train.total_steps=100"]
    with ResumableRun(tmp_path, "nock", overrides) as run:
        run.start_learner()  # checkpoint.every=0 (COMMON)
        run.start_actor()
        run.wait_version(2)
        run.kill_learner()
    before = _tree(run.dir)
    res = _cli("learn", *run.overrides, "--resume", timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "no intact checkpoint" in res.stderr and "--overwrite" in res.stderr
    assert _tree(run.dir) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs (a real full disk) needs root")
@pytest.mark.parametrize("fits", ["nothing", "weights"])  # the optimizer state (torch.save) is the one that fails
def test_a_full_disk_at_a_checkpoint_is_an_oserror_and_leaves_nothing(tmp_path, tiny_overrides, fits):
    """63.7: a checkpoint on a full disk (a real tmpfs, filled but ``free_kib``) raises an OSError (ENOSPC),
    whichever writer meets it (safetensors, torch.save: their own exception types before), which the
    learner turns into its one-line stop (``Learner._stop_on_write_error``); no partial checkpoint is left."""
    import errno

    import torch

    from asyncrl.config import load_config
    from asyncrl.learner.checkpoint import save_checkpoint
    from asyncrl.learner.ingest.buffer import EpisodeQueue
    from asyncrl.models.loading import load_policy

    cfg = load_config(None, tiny_overrides)
    model, tok, _ = load_policy(cfg.model, cfg.seed)
    opt = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()
    opt.step()  # (an optimizer state to save)
    probe = save_checkpoint(
        tmp_path / "probe", 2, model, tok, opt, EpisodeQueue(tmp_path / "probe" / "buffer", 100), {}, keep=2
    )
    model_bytes = sum(f.stat().st_size for f in (probe / "model").rglob("*") if f.is_file())
    assert (probe / "optimizer.pt").stat().st_size > 16 << 10
    free_kib = 8 if fits == "nothing" else model_bytes // 1024 + 16 + 4 * 4  # (tmpfs takes 4 KiB pages a file)
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        buf = EpisodeQueue(mnt / "run" / "buffer", 100)
        (mnt / "run" / "checkpoints").mkdir(parents=True)
        with open(mnt / "filler", "wb") as f:  # the disk full but free_kib
            f.write(b"\0" * (os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize - free_kib * 1024))
        with pytest.raises(OSError) as e:
            save_checkpoint(mnt / "run", 2, model, tok, opt, buf, {}, keep=2)
        assert e.value.errno == errno.ENOSPC, e.value
        assert list((mnt / "run" / "checkpoints").iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
