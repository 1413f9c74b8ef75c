"""End to end over real processes and real loopback ZeroMQ sockets."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from safetensors.torch import load_file

from asyncrl.wire.codec import SCHEMA_VERSION
from tests.conftest import SMALL_RUN, initial_weights, read_jsonl, run_cli, start_cli, stop_processes, wait_for_file

pytestmark = pytest.mark.slow

COMMON = SMALL_RUN


def _start(args, log_path):
    return start_cli(*args, log=log_path)


_stop = stop_processes  # SIGTERM each, then kill what is left of every process tree


def test_learner_and_two_actors(tmp_path, tiny_overrides, model_cache):
    steps, max_staleness = 10, 1
    overrides = [
        *tiny_overrides,
        *COMMON,
        f"run_root={tmp_path}",
        "name=e2e",
        f"train.total_steps={steps}",
        f"buffer.max_staleness={max_staleness}",
        "train.min_actors=2",
    ]
    run_dir = tmp_path / "e2e"
    learner = _start(["learn", *overrides], tmp_path / "learner.log")
    procs = [learner]
    try:
        addrs = wait_for_file(run_dir / "addresses.json", learner)
        for i in range(2):
            procs.append(
                _start(
                    ["serve", *overrides, "--connect", addrs["control"], "--actor-id", f"actor-{i}", "--index", str(i)],
                    tmp_path / f"actor-{i}.log",
                )
            )
        learner.wait(timeout=240)
        assert learner.returncode == 0, (tmp_path / "learner.log").read_text()[-3000:]
        for p in procs[1:]:
            p.wait(timeout=30)  # the learner's stop message ends the actors
            assert p.returncode == 0
    finally:
        _stop(procs)

    for i in range(2):  # 64.6: asyncrl serve says what it does (it printed nothing for its whole life)
        said = (tmp_path / f"actor-{i}.log").read_text()
        for line in (f"[actor-{i}] connected to the learner", "applied; generating", f"[actor-{i}] stopping: "):
            assert line in said, (line, said[-2000:])
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert max(m["staleness_max"] for m in metrics) <= max_staleness

    events = read_jsonl(run_dir / "events.jsonl")
    episodes = [e for e in events if e["kind"] == "episode"]
    assert {e["actor_id"] for e in episodes} == {"actor-0", "actor-1"}
    assert all(e["staleness"] <= max_staleness for e in episodes)
    for actor in ("actor-0", "actor-1"):
        # evidence that each actor applied published weights: it trained on episodes generated with a
        # version >= 1. Credits are shared round-robin and carry the least version to generate with,
        # so after the first step every actor must load new weights to get its work trained.
        versions = [e["policy_version"] for e in episodes if e["actor_id"] == actor]
        assert max(versions) >= 1, f"{actor} never generated with new weights: versions {versions}"

    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    trained = load_file(ckpt / "model" / "model.safetensors")
    initial = initial_weights(tiny_overrides)
    changed = [k for k in initial if not np.allclose(initial[k].numpy(), trained[k].numpy())]
    assert len(changed) == len(initial), f"unchanged parameters: {set(initial) - set(changed)}"


def test_bad_messages_do_not_stop_the_learner(tmp_path, tiny_overrides):
    overrides = [*tiny_overrides, *COMMON, f"run_root={tmp_path}", "name=bad", "train.total_steps=3"]
    run_dir = tmp_path / "bad"
    learner = _start(["learn", *overrides], tmp_path / "learner.log")
    procs = [learner]
    ctx = zmq.Context.instance()
    try:
        addrs = wait_for_file(run_dir / "addresses.json", learner)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(addrs["episodes"])
        push.send_multipart([b"\x00not msgpack at all"])  # malformed
        import msgpack

        header = {"schema": 99, "kind": "episode", "body": {}, "arrays": []}
        push.send_multipart([msgpack.packb(header)])  # wrong schema version
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 1000)
        dealer.connect(addrs["control"])
        dealer.send_multipart([b"garbage", b"more garbage"])  # malformed control message
        time.sleep(1.0)
        assert learner.poll() is None, "the learner died on a bad message"
        procs.append(_start(["serve", *overrides, "--connect", addrs["control"]], tmp_path / "actor.log"))
        learner.wait(timeout=240)
        assert learner.returncode == 0
        push.close()
        dealer.close()
    finally:
        _stop(procs)
    bad = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "bad_message"]
    errors = " | ".join(e["error"] for e in bad)
    assert len(bad) >= 3, errors
    assert "schema version 99" in errors and f"speaks {SCHEMA_VERSION}" in errors
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert metrics[-1]["version"] == 3  # and it went on to train after the bad messages


def test_unknown_config_key_is_a_clear_error(tmp_path):
    res = run_cli("learn", "-c", "configs/quickstart.yaml", "train.learning_rate=1e-5", timeout=120)
    assert res.returncode == 2
    assert "unknown key 'train.learning_rate'" in res.stderr
    assert "lr" in res.stderr  # the allowed keys are listed


def test_filesystem_weight_sync(tmp_path, tiny_overrides):
    overrides = [
        *tiny_overrides,
        *COMMON,
        f"run_root={tmp_path}",
        "name=fs",
        "train.total_steps=4",
        "sync.type=filesystem",
        "sync.keep=2",
    ]
    res = run_cli("run", *overrides, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    files = sorted((tmp_path / "fs" / "weights").glob("weights-*.safetensors"))
    assert [f.name for f in files] == ["weights-00000003.safetensors", "weights-00000004.safetensors"]
    # credits granted after step 1 require version >= 1, so steps 3 and 4 must train on episodes the
    # actor generated after loading weights from the files
    episodes = [e for e in read_jsonl(tmp_path / "fs" / "events.jsonl") if e["kind"] == "episode"]
    assert max(e["policy_version"] for e in episodes) >= 1, [e["policy_version"] for e in episodes]
