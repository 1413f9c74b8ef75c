"""The multi-turn rollout loop (asyncrl.rollout.conversation) with a scripted engine: the exact
tokens, the loss mask over the assistant's turns only, the behaviour log-probs, the trajectory."""

from __future__ import annotations

import pytest

from tests.conftest import scripted_conversation


def test_multi_turn_masks_cover_only_assistant_turns():
    tok, env, task, c, engine = scripted_conversation(
        ["env.type=examples.countdown:RetryEnv", "env.reward=examples.countdown:reward"],
        "9-1=",
        8,
        [("7", True), ("8", True)],
        max_turns=2,
    )
    text = tok.decode(c.token_ids, skip_special_tokens=False)
    assert text == "<|user|>9-1=<|end|><|assistant|>7<|end|><|user|>try again<|end|><|assistant|>8<|end|>"
    p1 = len(tok("<|user|>9-1=<|end|><|assistant|>", add_special_tokens=False)["input_ids"])
    hint = len(tok("<|user|>try again<|end|><|assistant|>", add_special_tokens=False)["input_ids"])
    expected = [0] * p1 + [1, 1] + [0] * hint + [1, 1]
    assert c.loss_mask == expected
    assert c.logprobs[p1 : p1 + 2] == pytest.approx([-0.1, -0.2])
    traj = c.to_trajectory(engine.version, env.evaluate(task, c.history))
    assert traj.reward == 1.0 and traj.scores["turns"] == 2.0 and traj.policy_version == 7
