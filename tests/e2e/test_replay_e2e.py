"""Experience replay end to end: real learner and actor processes over loopback ZeroMQ, the multi-turn
calculator environment, a checkpoint, SIGKILL and resume with the pool, buckets and skip set intact."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.learner.experience import ExperiencePool
from asyncrl.learner.ingest.staleness import StalenessPolicy
from asyncrl.rundir.layout import latest_checkpoint
from tests.conftest import REPLAY_RUN, ResumableRun
from tests.conftest import SMALL_RUN as COMMON

pytestmark = pytest.mark.slow

REPLAY = REPLAY_RUN


def test_multi_turn_replay_survives_kill_and_resume(tmp_path, tiny_overrides):
    total = 12
    overrides = [
        *tiny_overrides,
        *COMMON,
        *REPLAY,
        f"train.total_steps={total}",
        "checkpoint.every=3",
        "buffer.max_staleness=2",
    ]
    with ResumableRun(tmp_path, "replay", overrides) as run:
        run.start_learner()
        run.start_actor()

        def checkpointed_and_past_it() -> bool:
            ck = [e["step"] for e in run.events("replay_state") if e.get("reason") == "checkpoint"]
            m = run.metrics()
            return bool(ck) and bool(m) and m[-1]["version"] > max(ck)

        run.wait_for(checkpointed_and_past_it, "a checkpoint and one more step")
        run.kill_learner()
        before = run.events()
        # read back the checkpoint the learner will resume from, in this process, before it is rotated
        cfg = load_config(None, run.overrides)
        from_files = ExperiencePool(
            cfg.replay, n=cfg.sampling.n, total_steps=total, staleness=StalenessPolicy.from_config(cfg)
        )
        ckpt = latest_checkpoint(run.dir)
        assert from_files.load(ckpt)
        run.resume()
        run.finish()

    # the state written at each checkpoint, as the learner had it in memory (digest covers the
    # buckets, the skip set, every stored trajectory with its recorded log-probs, and the task dicts)
    saved = {e["checkpoint"]: e for e in before if e["kind"] == "replay_state" and e.get("reason") == "checkpoint"}
    events = run.events()
    resume = [e for e in events if e["kind"] == "resume"][0]
    restored = [e for e in events if e["kind"] == "replay_state" and e.get("reason") == "resume"][0]
    at_ckpt = saved[resume["checkpoint"]]
    assert restored["digest"] == at_ckpt["digest"]
    for k in ("buckets", "pool_tasks", "skip_tasks", "pool_trajectories", "active"):
        assert restored[k] == at_ckpt[k], k
    # and read back from the files in this process: the same state, member by member
    assert str(ckpt) == resume["checkpoint"]
    m = from_files
    assert m.digest() == at_ckpt["digest"]
    assert m.bucket_sizes() == at_ckpt["buckets"] and len(m.solved) == at_ckpt["skip_tasks"]
    assert at_ckpt["pool_tasks"] + at_ckpt["skip_tasks"] > 0, "nothing to compare: empty pool and skip set"

    metrics = run.metrics()
    final = [x for x in metrics if x["version"] == total]
    assert final and {
        "replay/pool_tasks",
        "replay/skip_tasks",
        "replay/pool_trajectories",
        "replay/replayed_share",
        "replay/active",
        "replay/off_token_ratio",
    } <= set(final[0])
    # started once progress reached 0.1 * 12 steps: the step trained at version 2 (logged as 3) on
    active = {x["version"]: x["replay/active"] for x in metrics}
    assert active[1] == 0.0 and all(active[v] == 1.0 for v in range(3, total + 1))
    # replay really happened, on multi-turn trajectories: replayed rows in training, off-policy tokens
    replayed = [x for x in metrics if x.get("replay/replayed_trajectories", 0) > 0]
    assert replayed, "no replayed trajectory was ever trained"
    assert all(x["replay/off_token_ratio"] > 0 and x["replay/ratio_max"] > 0 for x in replayed)
    eps = [e for e in events if e["kind"] == "episode"]
    rep = [t for e in eps for t in e["trajectories"] if t["is_replay"]]
    assert rep and all(t["reward"] == 1.0 for t in rep)
    for e in eps:  # a replay group has n members: n - k fresh plus k replayed, in one group
        if e["decision"].get("replay"):
            assert len(e["trajectories"]) == cfg.sampling.n
            assert len({t["group_id"] for t in e["trajectories"]}) == 1
    states = [e for e in events if e["kind"] == "replay_state" and e.get("reason") == "step"]
    assert {"buckets", "pool_tasks", "skip_tasks", "pool_trajectories"} <= set(states[-1])
