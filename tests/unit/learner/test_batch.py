"""Collation alignment (position j scores token j+1) and the learner's log-prob forward."""

import numpy as np
import pytest
import torch

from asyncrl.learner.training.batch import TrainBatch, collate, compute_logprobs
from asyncrl.types import Trajectory

PAD = 0


def _two():
    a = Trajectory(
        token_ids=[5, 6, 7, 8, 9],
        loss_mask=[0, 0, 1, 1, 1],
        behavior_logprobs=[0, 0, -0.5, -0.25, -1.0],
        policy_version=3,
        reward=1.0,
        sample_type="solver",
        group_id="g1",
    )
    b = Trajectory(
        token_ids=[5, 6, 10],
        loss_mask=[0, 1, 1],
        behavior_logprobs=[0, -2.0, -0.1],
        policy_version=2,
        reward=0.0,
        sample_type="proposer",
        group_id="g2",
        is_replay=True,
        recorded_logprobs=[0, -1.5, -0.2],
        exp_mask=[0, 1, 1],
    )
    return [a, b]


def test_collate_every_element_shifted_by_one():
    batch = collate(_two(), torch.tensor([0.5, -0.5]), pad_id=PAD)
    # T = 5 (longest), targets T - 1 = 4; row j of a [B, 4] tensor refers to token j + 1
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, PAD, PAD]]
    assert batch.input_ids.dtype == torch.long
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # a: loss_mask[1:5] = [0, 1, 1, 1]; b: loss_mask[1:3] = [1, 1] then padding
    assert batch.response_mask.tolist() == [[0, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.response_mask.dtype == torch.float32
    assert batch.behavior_logprobs[0].tolist() == [0, -0.5, -0.25, -1.0]
    assert batch.behavior_logprobs[1].tolist() == pytest.approx([-2.0, -0.1, 0, 0])
    assert torch.equal(batch.old_logprobs, batch.behavior_logprobs)
    assert batch.old_logprobs.data_ptr() != batch.behavior_logprobs.data_ptr()
    # advantage on response targets only: a -> 0.5 on [1, 2, 3]; b -> -0.5 on [0, 1]
    assert batch.advantages.tolist() == [[0, 0.5, 0.5, 0.5], [-0.5, -0.5, 0, 0]]
    assert batch.exp_mask.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]
    assert batch.recorded_logprobs[0].tolist() == [0, 0, 0, 0]
    assert batch.recorded_logprobs[1].tolist() == pytest.approx([-1.5, -0.2, 0, 0])
    assert batch.rewards.tolist() == [1.0, 0.0]
    assert batch.policy_versions.tolist() == [3, 2] and batch.policy_versions.dtype == torch.long
    assert batch.sample_types == ["solver", "proposer"] and batch.group_ids == ["g1", "g2"]
    assert batch.num_tokens == 5


def test_replay_without_exp_mask_is_off_policy_on_generated_tokens():
    traj = Trajectory(
        token_ids=[1, 2, 3], loss_mask=[0, 1, 1], behavior_logprobs=[0, -1, -1], policy_version=0, is_replay=True
    )
    assert collate([traj], torch.zeros(1), pad_id=PAD).exp_mask.tolist() == [[1, 1]]
    with pytest.raises(ValueError, match="advantages"):
        collate([traj], torch.zeros(2), pad_id=PAD)


def _many(n):
    return [
        Trajectory(
            token_ids=list(range(1, 3 + i)),
            loss_mask=[0] + [1] * (1 + i),
            behavior_logprobs=np.zeros(2 + i),
            policy_version=i,
            group_id=str(i),
        )
        for i in range(n)
    ]


def test_split_even_and_ordered():
    batch = collate(_many(5), torch.arange(5, dtype=torch.float32), pad_id=PAD)
    parts = batch.split(2)
    assert [p.batch_size for p in parts] == [3, 2]
    assert [p.batch_size for p in batch.split(3)] == [2, 2, 1]
    assert parts[1].group_ids == ["3", "4"] and parts[1].policy_versions.tolist() == [3, 4]
    assert torch.equal(parts[1].advantages, batch.advantages[3:])
    assert all(isinstance(p, TrainBatch) for p in parts)
    with pytest.raises(ValueError):
        batch.split(6)
    moved = batch.to("cpu")
    assert moved.input_ids.device.type == "cpu" and moved.group_ids == batch.group_ids


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=20,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(cfg).eval()


def test_compute_logprobs_matches_manual_gather():
    model = _tiny_llama()
    batch = collate(_two(), torch.zeros(2), pad_id=PAD)
    temp = 0.7
    with torch.no_grad():
        lp, ent = compute_logprobs(model, batch, temp, with_entropy=True)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logsm = torch.log_softmax(logits[:, :-1] / temp, dim=-1)
        manual = logsm.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        manual_ent = -(logsm.exp() * logsm).sum(-1)
        # the padded row's real targets equal those of the same sequence alone (right padding)
        alone = model(input_ids=torch.tensor([[5, 6, 10]])).logits[0, :-1] / temp
        alone_lp = torch.log_softmax(alone, -1)[[0, 1], [6, 10]]
    assert lp.shape == (2, 4) and ent.shape == (2, 4)
    assert torch.allclose(lp, manual, atol=1e-6)
    assert torch.allclose(ent, manual_ent, atol=1e-5)
    assert torch.allclose(lp[1, :2], alone_lp, atol=1e-5)
    assert compute_logprobs(model, batch, temp)[1] is None


def test_compute_logprobs_has_grad():
    model = _tiny_llama().train()
    batch = collate(_two(), torch.zeros(2), pad_id=PAD)
    lp, _ = compute_logprobs(model, batch, 1.0)
    (lp * batch.response_mask).sum().backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_mismatch_stats_count_only_tokens_made_with_the_current_weights():
    import math

    from asyncrl.learner.training.trainer import mismatch_stats

    rows = [
        Trajectory(
            np.array([5, 6, 7, 8], np.int32),
            np.array([0, 0, 1, 1], np.uint8),
            np.array([0, 0, -1.0, -2.0], np.float32),
            policy_version=v,
        )
        for v in (3, 2)
    ]
    batch = collate(rows, torch.zeros(2), pad_id=0)
    learner = batch.behavior_logprobs.clone()
    learner[0, 1] += 0.5  # row 0 (version 3) differs by +0.5 and -0.5 on its two generated tokens
    learner[0, 2] -= 0.5
    learner[1, 1:] += 9.0  # row 1 is stale (version 2): never counted
    s = mismatch_stats(learner, batch, version=3)
    assert s["mismatch/tokens"] == 2 and s["mismatch/logprob_abs_diff_mean"] == pytest.approx(0.5)
    assert s["mismatch/logprob_abs_diff_max"] == pytest.approx(0.5)
    # k3: mean(r - log r - 1) over log r = +0.5 and -0.5
    expected = ((math.exp(0.5) - 0.5 - 1) + (math.exp(-0.5) + 0.5 - 1)) / 2
    assert s["mismatch/kl"] == pytest.approx(expected, rel=1e-5)
    assert mismatch_stats(learner, batch, version=7) == {}  # no row from the current weights


def test_rows_restored_from_the_wal_collate_without_a_warning():
    """64.9: rows decoded from the WAL on a resume are read-only views of its bytes; collating them gave
    torch's "NumPy array is not writable" UserWarning on every resume."""
    import warnings

    from asyncrl.types import Episode
    from asyncrl.wire.codec import decode, decode_episode, encode_episode

    frames = [bytes(memoryview(f).cast("B")) for f in encode_episode(Episode(trajectories=_two(), actor_id="a"))]
    restored = decode_episode(decode(frames, kinds=("episode",)), copy=False).trajectories
    assert not restored[0].token_ids.flags.writeable  # (what a resume reads)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = collate(restored, torch.tensor([0.5, -0.5]), pad_id=PAD)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, PAD, PAD]]
