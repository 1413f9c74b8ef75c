"""Issue 15 end to end: the learner as a group of 2 processes (rank 0 owns the sockets, buffer, WAL
and checkpoints; rank 1 trains with it) with an actor over loopback.

One run, three learner lives (PPO with a critic: the critic's shards saved and loaded with the policy's): an FSDP2 group whose rank 0 is killed with SIGKILL (rank 1 notices and
exits on its own), one process resuming the group's checkpoint (killed with SIGKILL), an FSDP2 group
again resuming the one-process checkpoint and finishing. Versions advance, the actor applies the published weights, nothing acknowledged is lost,
no episode is trained twice and step numbers continue. ``asyncrl run --learner-procs 2`` (DDP)
finishes a short run with experience replay and its rank 1 exits 0.
"""

from __future__ import annotations

import signal

import pytest

from asyncrl.rundir.layout import list_checkpoints
from tests.conftest import REPLAY_RUN as REPLAY
from tests.conftest import SMALL_RUN as COMMON
from tests.conftest import ResumableRun, checkpoint_buffer_ids, effective_training, read_jsonl, run_cli
from tests.support.ledger_checks import ledger_duplicates

pytestmark = pytest.mark.slow


def test_group_killed_and_resumed_across_one_and_two_processes(tmp_path, tiny_overrides):
    total = 12
    overrides = [
        *tiny_overrides,
        *COMMON,
        f"train.total_steps={total}",
        "checkpoint.every=3",
        "train.distributed=fsdp2",
        "buffer.max_staleness=1000",
        "buffer.capacity=12",
        "train.advantage.estimator=gae",
    ]  # with a critic (issue 46): gathered, saved and loaded with the policy
    acked: set[str] = set()
    with ResumableRun(tmp_path, "group", overrides) as run:
        run.start_learner(procs=2)
        run.start_actor()
        run.wait_version(4)  # past the step-3 checkpoint, written from the two ranks' shards
        rank0, rank1 = run.group
        rank0.send_signal(signal.SIGKILL)  # rank 0 dies; rank 1 must notice and leave, not hang
        rank0.wait(timeout=10)
        assert rank1.wait(timeout=120) == 1
        assert "rank 0 is gone" in (tmp_path / "learner1-rank1.log").read_text()
        acked |= run.wal_ids()
        sharded = max(int(p.name.split("_")[1]) for p in list_checkpoints(run.dir))

        run.resume()  # one process, from the group's checkpoint
        run.wait_version(sharded + 4)
        run.kill_learner()
        acked |= run.wal_ids()
        single = max(int(p.name.split("_")[1]) for p in list_checkpoints(run.dir))
        assert single > sharded

        run.resume(procs=2)  # a group again, from the one-process checkpoint
        run.finish()
        rank1 = (tmp_path / "learner3-rank1.log").read_text()

    assert "ready (fsdp2, 2 ranks)" in (tmp_path / "learner1-rank1.log").read_text()
    assert "ready (fsdp2, 2 ranks)" in rank1 and f"stopping after {total - single} step(s)" in rank1, rank1
    assert "2 learner processes (fsdp2)" in run.log(3)
    assert f"resumed from step {sharded}" in run.log(2) and f"resumed from step {single}" in run.log(3)

    events = run.events()
    trained = effective_training(events)
    assert len(trained) == len(set(trained)), "an episode was trained twice in the surviving history"
    final_buffer = checkpoint_buffer_ids(list_checkpoints(run.dir)[-1])
    acknowledged = acked | {e["episode_id"] for e in events if e["kind"] == "episode"}
    lost = (
        acknowledged - set(trained) - final_buffer - ledger_duplicates(run.dir)
    )  # (duplicates: acknowledged, recorded, not trained)
    assert len(acknowledged) >= 30, f"only {len(acknowledged)} episodes: too few to test anything"
    assert not lost, f"{len(lost)} of {len(acknowledged)} acknowledged episodes were lost"

    metrics = run.metrics()
    assert [m["step"] for m in metrics] == list(range(1, total + 1)), "step numbers repeated or missing"
    assert all(m["grad_norm"] > 0 for m in metrics), "a step of the group trained nothing"
    # the critic trained in every life and came back from each checkpoint (the group's and the one process's)
    assert all(m["critic/grad_norm"] > 0 for m in metrics)
    assert not [e for e in events if e["kind"] == "critic_fresh"]
    # the actor generated with the weights the group published: its version follows the learner's
    held = [m["sync/actor_version_min"] for m in metrics if "sync/actor_version_min" in m]
    assert held and max(held) >= total - 2, held
    versions = {e["policy_version"] for e in events if e["kind"] == "episode"}
    assert max(versions) >= single, sorted(versions)


def test_run_with_two_learner_processes_and_replay(tmp_path, tiny_overrides):
    """``asyncrl run --learner-procs 2`` (DDP) with experience replay: rank 0's replay hook adds
    stored trajectories to batches that both ranks train on (replayed rows with recorded log-probs)."""
    total = 10
    out = run_cli(
        "run",
        "--learner-procs",
        "2",
        *tiny_overrides,
        *COMMON,
        *REPLAY,
        f"train.total_steps={total}",
        f"run_root={tmp_path}",
        "name=ddp",
        timeout=600,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "2 learner processes (ddp)" in out.stdout
    rank1 = (tmp_path / "ddp" / "learner-rank1.log").read_text()
    assert "ready (ddp, 2 ranks)" in rank1 and f"stopping after {total} step(s)" in rank1, rank1
    metrics = read_jsonl(tmp_path / "ddp" / "metrics.jsonl")
    assert [m["version"] for m in metrics] == list(range(1, total + 1))
    replayed = [m for m in metrics if m.get("replay/replayed_trajectories", 0) > 0]
    assert replayed, "no replayed trajectory was ever trained"
    assert all(m["replay/off_token_ratio"] > 0 for m in replayed)
