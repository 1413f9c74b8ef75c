"""The learner's step makes every tensor on the device of the tensors it works on, never on torch's
default device: on a GPU a tensor made without a device is a CPU tensor, and the first operation
mixing it with the model's fails ("Expected all tensors to be on the same device, ... cuda:0 and
cpu"). That is how the learner first failed on a GPU (an H200, issue 50: the off-policy correction's
flags); no GPU is needed to find such a tensor. Here the model and the batch are on the CPU and the
step runs under ``torch.set_default_device("meta")``: a tensor made without a device lands on the
meta device, and mixing it with the CPU's fails the same way."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncrl.config import load_config
from asyncrl.learner.training.trainer import PolicyTrainer
from asyncrl.objectives.corrections import OFF_POLICY_CORRECTIONS
from asyncrl.objectives.losses import POLICY_LOSSES
from asyncrl.types import Episode, Trajectory


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
    )


def _episodes(seed: int) -> list[Episode]:
    """Two groups of four rows sharing a prompt; rewards 0/1 (one group all 1: no advantage)."""
    rng = np.random.default_rng(seed)
    eps = []
    for g in range(2):
        prompt = rng.integers(3, 64, int(rng.integers(3, 8))).tolist()
        trajs = []
        for _ in range(4):
            n = int(rng.integers(2, 12))
            trajs.append(
                Trajectory(
                    token_ids=np.asarray(prompt + rng.integers(3, 64, n).tolist(), dtype=np.int32),
                    loss_mask=np.asarray([0] * len(prompt) + [1] * n, dtype=np.uint8),
                    behavior_logprobs=np.asarray(
                        [0.0] * len(prompt) + (-rng.exponential(1.0, n)).tolist(), dtype=np.float32
                    ),
                    policy_version=0,
                    reward=1.0 if g == 0 else float(rng.integers(0, 2)),
                    group_id=f"g{g}",
                )
            )
        eps.append(Episode(trajectories=trajs))
    return eps


CASES = (
    [[f"train.off_policy_correction={c}"] for c in OFF_POLICY_CORRECTIONS]
    + [[f"train.policy_loss={loss}"] for loss in POLICY_LOSSES]
    + [
        ["train.is_cap_mode=mask"],
        ["train.packing=false", "train.skip_zero_advantage=false"],
        ["train.kl_coef=0.1", "train.entropy_coef=0.01"],
        ["train.loss_agg_mode=seq-mean-token-sum"],
        ["train.mini_batches=2", "train.ppo_epochs=2"],
        ["train.advantage.estimator=rloo"],
        ["train.advantage.estimator=reinforce_pp"],
        ["train.advantage.estimator=gae"],
        ["train.overlong_buffer=4", "train.mask_truncated=true"],
    ]
)


@pytest.mark.parametrize("overrides", CASES, ids=[" ".join(c) for c in CASES])
def test_a_step_makes_no_tensor_on_the_default_device(overrides):
    cfg = load_config(None, [*overrides, "train.micro_batch_tokens=32"])
    trainer = PolicyTrainer(_model(), SimpleNamespace(pad_token_id=0), cfg.train, 1.0)
    for version in range(2):
        batch = trainer.make_batch(_episodes(version))
        torch.set_default_device("meta")
        try:
            stats = trainer.step(batch, version=version).stats
        finally:
            torch.set_default_device(None)
        assert np.isfinite(stats["loss"]), stats
