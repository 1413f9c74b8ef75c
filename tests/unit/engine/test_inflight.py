"""In-flight weight updates (``actor.weight_update: inflight``): continuous generation on the HF
engine, per-token policy versions through the data model, the wire and the learner, and the rule for
rows whose tokens span too many versions. (vLLM's partial rollouts: tests/unit/engine/test_engine_vllm.py.)"""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest
import torch

from asyncrl.config import SamplingConfig, load_config
from asyncrl.engine.continuous import EngineStopped
from asyncrl.engine.hf import HFEngine
from asyncrl.learner.ingest.buffer import EpisodeQueue
from asyncrl.learner.ingest.peers import EpisodeValidator
from asyncrl.learner.ingest.staleness import StalenessPolicy
from asyncrl.learner.training.batch import collate
from asyncrl.learner.training.trainer import mismatch_stats, token_lag_stats
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.objectives.corrections import CorrectionConfig, behavior_weights
from asyncrl.objectives.losses import LossConfig, PolicyLossInputs, compute_policy_loss
from asyncrl.types import Episode, Trajectory, row_versions
from asyncrl.wire.codec import decode, decode_episode, encode_episode
from tests.conftest import read_jsonl, run_cli
from tests.unit.engine.test_engine_hf import _model, _prompts, _reference_logprobs


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _serve(engine: HFEngine, calls: list[tuple[int, list, SamplingConfig]], on_step=None, timeout: float = 120):
    """Run ``engine.step()`` on this thread while each call ``(start step, prompts, sampling)`` is
    made from a thread of its own once that many steps have run; ``on_step(k)`` after step k.
    Returns each call's generations and the step at which it came back."""
    results: dict[int, list] = {}
    finished_at: dict[int, int] = {}
    threads: dict[int, threading.Thread] = {}
    steps, deadline = 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, (start, prompts, sp) in enumerate(calls):
            if i not in threads and steps >= start:
                threads[i] = threading.Thread(
                    target=lambda i=i, p=prompts, s=sp: results.__setitem__(i, engine.generate(p, s))
                )
                threads[i].start()
                while not engine.batcher.num_pending() and threads[i].is_alive():
                    time.sleep(0.001)  # (queued before the next step)
        for i, t in threads.items():
            if i not in finished_at and not t.is_alive():
                finished_at[i] = steps
        if len(finished_at) == len(calls):
            return results, finished_at
        if engine.step():
            steps += 1
            if on_step is not None:
                on_step(steps)
        else:
            engine.batcher.wait_for_work(0.005)
    raise AssertionError(f"calls not done after {timeout} s ({steps} steps)")


def _expected(models: dict[int, torch.nn.Module], prompt, gen, temperature: float = 1.0) -> np.ndarray:
    """Each token's log-prob under the weights of its own version (unpadded full forward)."""
    per_version = {v: _reference_logprobs(m, prompt, gen.token_ids, temperature) for v, m in models.items()}
    return np.array([per_version[int(v)][j] for j, v in enumerate(gen.versions)])


def test_continuous_generation_serves_threads_without_waiting_for_the_longest(tokenizer):
    """A call made while another is in flight joins the running batch and comes back before the
    first call's long rows finish; finished rows leave the batch; every token's log-prob is what a
    full forward with the same weights gives."""
    engine = HFEngine(_model(tokenizer, 0), tokenizer)
    engine.start_continuous()
    long_call = (0, _prompts(tokenizer, 6), SamplingConfig(max_new_tokens=30))
    short_call = (3, _prompts(tokenizer, 10)[4:], SamplingConfig(max_new_tokens=4, temperature=0.7))
    seen: dict[str, list[int]] = {"short": [], "long": []}  # steps at which each call had rows in the batch

    def watch(k):  # the engine's own state after step k (no thread timing involved)
        for row in engine._live:  # (a row that finished at step k leaves the batch at step k + 1)
            seen["short" if row.sampling.max_new_tokens == 4 else "long"].append(k)

    results, _ = _serve(engine, [long_call, short_call], on_step=watch)
    admitted, done = min(seen["short"]), max(seen["short"])
    assert done - admitted <= 3  # 4 tokens at most: the first from the step that admitted them
    assert max(seen["long"]) > done  # ... while the long call's rows were still being generated,
    # and then they left the batch: later steps computed the long rows only
    for (_, prompts, sp), gens in ((long_call, results[0]), (short_call, results[1])):
        assert len(gens) == len(prompts)
        for prompt, g in zip(prompts, gens):
            assert len(g.token_ids) <= sp.max_new_tokens and set(g.versions.tolist()) == {0}
            assert g.text == tokenizer.decode(g.token_ids.tolist(), skip_special_tokens=True)
            np.testing.assert_allclose(
                g.logprobs, _reference_logprobs(engine.model, prompt, g.token_ids, sp.temperature), atol=1e-5
            )
    assert engine.in_flight == 0 and not engine.step()


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_tokens_after_an_inflight_update_carry_the_new_version(tokenizer, kv):
    """Weights change between two decode steps: tokens before carry version 0, after it version 1.
    With kv_on_update=recompute every behaviour log-prob equals a recomputation with its own
    version's weights within 1e-5; with keep, the tokens after the update were computed over keys and
    values of the old weights, and the gap is measured (docs/design/inflight.md)."""
    a, b = _model(tokenizer, 0), _model(tokenizer, 1)
    engine = HFEngine(_model(tokenizer, 0), tokenizer)
    engine.start_continuous(kv)
    prompts = _prompts(tokenizer, 8)
    new_weights = {n: p.detach().clone() for n, p in b.named_parameters()}

    def update(k):
        if k == 4:
            engine.update_weights(new_weights, version=1)

    results, _ = _serve(engine, [(0, prompts, SamplingConfig(max_new_tokens=12))], on_step=update)
    mixed = [(p, g) for p, g in zip(prompts, results[0]) if set(g.versions.tolist()) == {0, 1}]
    assert mixed, "no row spans the update"
    for g in results[0]:
        assert np.all(np.diff(g.versions) >= 0) and np.all(g.versions[:4] == 0)
    gaps = []
    for prompt, g in mixed:
        exp = _expected({0: a, 1: b}, prompt, g)
        before = g.versions == 0
        np.testing.assert_allclose(g.logprobs[before], exp[before], atol=1e-5)  # untouched by the update
        gaps.append(np.abs(g.logprobs[~before] - exp[~before]).max())
    gap = max(gaps)
    print(f"kv_on_update={kv}: max |behaviour - own version's recomputation| after the update = {gap:.3g}")
    if kv == "recompute":
        assert gap < 1e-5
    else:
        assert gap > 1e-3  # the old keys and values show (these two random models differ a lot)


def test_stopping_the_engine_fails_waiting_calls(tokenizer):
    engine = HFEngine(_model(tokenizer, 0), tokenizer)
    engine.start_continuous()
    errors = []

    def call():
        try:
            engine.generate(_prompts(tokenizer, 4), SamplingConfig(max_new_tokens=20))
        except EngineStopped as e:
            errors.append(str(e))

    t = threading.Thread(target=call)
    t.start()
    while not engine.batcher.num_pending():
        time.sleep(0.001)
    engine.step()
    engine.stop_continuous("the actor is stopping")
    t.join(timeout=30)
    assert errors == ["the actor is stopping"]
    late = threading.Thread(target=call)  # a call after the stop fails at once
    late.start()
    late.join(timeout=30)
    assert errors == ["the actor is stopping"] * 2


# --- per-token versions in the data model -------------------------------------------------------


def _mixed_row() -> Trajectory:
    """prompt (3 tokens) + 5 generated: versions 4, 4, 5, 5, 6."""
    versions = [-1, -1, -1, 4, 4, 5, 5, 6]
    mask = [0, 0, 0, 1, 1, 1, 1, 1]
    pv, tv = row_versions(versions, mask, fallback=9)
    return Trajectory(
        token_ids=np.arange(8),
        loss_mask=np.array(mask),
        behavior_logprobs=-0.1 * np.arange(8),
        policy_version=pv,
        token_versions=tv,
        reward=1.0,
        group_id="g",
    )


def test_row_versions_keeps_the_array_only_for_mixed_rows():
    assert row_versions([-1, 3, 3], [0, 1, 1], fallback=0) == (3, None)
    assert row_versions([-1, -1], [0, 0], fallback=7) == (7, None)
    t = _mixed_row()
    assert t.policy_version == 4 and t.version_range() == (4, 6)
    assert t.token_versions.tolist() == [4, 4, 4, 4, 4, 5, 5, 6]
    assert t.versions_per_token().tolist() == [4, 4, 4, 4, 4, 5, 5, 6]
    ep = Episode(trajectories=[t, Trajectory(np.arange(3), np.array([0, 1, 1]), np.zeros(3), 7)])
    assert ep.policy_version == 4 and ep.newest_version == 7


def test_per_token_versions_survive_the_wire_and_old_records_still_load():
    t = _mixed_row()
    plain = Trajectory(np.arange(4), np.array([0, 1, 1, 1]), np.zeros(4), 5)
    ep = Episode(trajectories=[t, plain], actor_id="a")
    back = decode_episode(decode(encode_episode(ep)), copy=True)
    assert back.trajectories[0].token_versions.tolist() == t.token_versions.tolist()
    assert back.trajectories[1].token_versions is None and back.trajectories[0].policy_version == 4
    # an episode written before the field existed: no has_token_versions column, no array frame
    frames = encode_episode(Episode(trajectories=[plain], actor_id="a"))
    header = msgspec.msgpack.decode(frames[0])
    del header["body"]["trajectories"]["has_token_versions"]
    old = decode_episode(decode([msgspec.msgpack.encode(header), *frames[1:]]))
    assert old.trajectories[0].token_versions is None and old.trajectories[0].policy_version == 5


def test_the_wal_and_a_restore_keep_per_token_versions(tmp_path):
    q = EpisodeQueue(tmp_path / "buffer", capacity=16)
    q.open_wal(0)
    ep = Episode(trajectories=[_mixed_row()], actor_id="a")
    frames = encode_episode(ep)
    q.add(decode_episode(decode(frames)), frames)
    q.sync()
    q.close()
    fresh = EpisodeQueue(tmp_path / "buffer", capacity=16)
    report = fresh.restore(None, set())
    assert report.recovered == 1
    (restored,) = fresh.take(1, version=6, staleness=StalenessPolicy(2, "drop"))
    assert restored.trajectories[0].token_versions.tolist() == [4, 4, 4, 4, 4, 5, 5, 6]


def test_take_judges_by_the_oldest_or_the_newest_token(tmp_path):
    q = EpisodeQueue(tmp_path, capacity=16)
    ep = Episode(trajectories=[_mixed_row()], actor_id="a")  # tokens of versions 4..6
    q.episodes[ep.id] = (ep, [])
    assert q.take(1, version=7, staleness=StalenessPolicy(1, "keep")) == [ep]  # newest 6: lag 1
    q.episodes[ep.id] = (ep, [])
    assert (
        q.take(1, version=7, staleness=StalenessPolicy(1, "drop")) is None and q.dropped_stale == 1
    )  # oldest 4: lag 3


def test_mixed_rows_through_collate_the_corrections_and_the_truncate_rule():
    """Hand-computed: per-token versions shifted like the targets, lag metrics per token, the
    decoupled-PPO weight per token from each token's own behaviour log-prob, truncation masking
    exactly the tokens older than the bound."""
    t = _mixed_row()
    other = Trajectory(np.arange(5), np.array([0, 0, 1, 1, 1]), np.array([0, 0, -0.2, -0.3, -0.4]), 6, group_id="g")
    batch = collate([t, other], torch.tensor([1.0, -1.0]), pad_id=0)
    # targets are tokens 1..n-1: row 0's versions [4,4,4,4,5,5,6], row 1's [6,6,6,6] + padding
    assert batch.token_versions[0].tolist() == [4, 4, 4, 4, 5, 5, 6]
    assert batch.token_versions[1, :4].tolist() == [6, 6, 6, 6]
    lag = token_lag_stats(batch, version=7, staleness=StalenessPolicy(max_staleness=1))
    # generated targets: row 0 lags 3,3,2,2,1 ; row 1 lags 1,1,1
    assert lag["staleness/token_lag_mean"] == pytest.approx((3 + 3 + 2 + 2 + 1 + 1 + 1 + 1) / 8)
    assert lag["staleness/token_lag_max"] == 3
    assert lag["staleness/token_frac_past_bound"] == pytest.approx(4 / 8)
    assert lag["staleness/token_lag_frac_1"] == pytest.approx(4 / 8)
    # the decoupled-PPO weight min(exp(prox - behaviour), cap), per token with its own behaviour log-prob
    prox = batch.behavior_logprobs + 0.05 * torch.arange(7.0)
    w = behavior_weights(prox, batch.behavior_logprobs, batch.response_mask, CorrectionConfig(cap=1.2)).weight
    on = batch.response_mask[0] > 0
    expected = torch.clamp(torch.exp(0.05 * torch.arange(7.0)), max=1.2)
    torch.testing.assert_close(w[0][on], expected[on])
    # the token-mean PPO loss with those weights: current = proximal, so r = 1 and L_t = -A_t w_t
    loss, _ = compute_policy_loss(
        PolicyLossInputs(prox, prox, batch.advantages, batch.response_mask, w), LossConfig(loss_agg_mode="token-mean")
    )
    m = batch.response_mask
    hand = float((-batch.advantages * w * m).sum() / m.sum())
    assert float(loss) == pytest.approx(hand, rel=1e-6)
    # the learner's mismatch statistics count only tokens made by the learner's own version
    mm = mismatch_stats(batch.behavior_logprobs.clone(), batch, version=6)
    assert mm["mismatch/tokens"] == 1 + 3  # row 0's last token and row 1's three
    masked = batch.truncate_stale(version=7, max_staleness=1)
    assert masked == 4  # lags 3, 3, 2, 2
    assert batch.response_mask[0].tolist() == [0, 0, 0, 0, 0, 0, 1]
    assert batch.advantages[0].tolist() == [0, 0, 0, 0, 0, 0, 1.0]
    assert batch.response_mask[1, :4].tolist() == [0, 1, 1, 1]


def test_a_peer_cannot_lie_about_token_versions():
    t = _mixed_row()
    assert EpisodeValidator._check_versions([t], version=6) is None
    assert EpisodeValidator._check_versions([t], version=5)[0] == "future_version"
    liar = msgspec.structs.replace(t, policy_version=5)  # not the oldest token's version
    assert EpisodeValidator._check_versions([liar], version=6)[0] == "version"


def test_inflight_config_keys():
    cfg = load_config(None, ["actor.weight_update=inflight", "actor.kv_on_update=keep", "buffer.stale_tokens=truncate"])
    assert (cfg.actor.weight_update, cfg.actor.kv_on_update, cfg.buffer.stale_tokens) == (
        "inflight",
        "keep",
        "truncate",
    )
    with pytest.raises(Exception, match="weight_update"):
        load_config(None, ["actor.weight_update=sometimes"])


@pytest.mark.slow
def test_an_inflight_run_trains_on_rows_made_across_updates(tmp_path, tiny_overrides):
    """``asyncrl run`` with actor.weight_update=inflight (learner and actor processes): the actor
    applies weights in the middle of its rows, so some trained rows carry tokens of two versions
    (their episode events say so), the per-token staleness metrics are logged, and the run learns."""
    run = tmp_path / "inflight"
    proc = run_cli(
        "run",
        "-c",
        "configs/quickstart.yaml",
        *tiny_overrides,
        "actor.weight_update=inflight",
        "train.total_steps=40",
        "eval.every=0",
        "checkpoint.every=0",
        "log.episode_events=all",
        "log.progress=false",
        f"run_root={tmp_path}",
        "name=inflight",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_jsonl(run / "metrics.jsonl")
    assert len([m for m in metrics if "batch_trajectories" in m]) == 40
    assert all(
        "staleness/token_lag_mean" in m and "staleness/token_frac_past_bound" in m
        for m in metrics
        if "batch_trajectories" in m
    )
    rows = [
        (e["step"], t) for e in read_jsonl(run / "events.jsonl") if e["kind"] == "episode" for t in e["trajectories"]
    ]
    mixed = [(step, t) for step, t in rows if t.get("newest_version", t["policy_version"]) > t["policy_version"]]
    assert mixed, f"none of {len(rows)} trained rows spans an update"
    assert all(t["newest_version"] <= step for step, t in mixed)  # no token newer than the learner
