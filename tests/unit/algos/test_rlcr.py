"""RLCR units: parsing, Brier rewards, mask spans at exact token positions, decoupled advantages,
the tree rollout on a scripted engine, evaluation, verifiers and the warm-start format."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncrl.algos.rlcr import (
    RLCRConfig,
    RLCRWorkflow,
    brier_reward,
    parse_answer,
    parse_confidence,
    rlcr_warmstart_example,
    tree_advantages,
)
from asyncrl.config import ConfigError, SamplingConfig, load_config
from asyncrl.envs.answer_checks import resolve_verifier, verify, verify_exact_match, verify_numeric
from asyncrl.envs.base import SingleTurnEnv
from asyncrl.learner.training.batch import collate
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.objectives.aggregation import LOSS_AGG_MODES
from asyncrl.objectives.losses import LossConfig, PolicyLossInputs, compute_policy_loss
from asyncrl.rollout import RolloutContext, get_workflow
from asyncrl.types import Task
from tests.conftest import ScriptedEngine

# ------------------------------------------------------------------------------------ parsing


def test_parse_answer_well_formed():
    text = "<think>12+34</think><answer>46</answer>"
    p = parse_answer(text)
    assert p.ok and p.value == "46" and p.reason == ""
    assert p.span == (0, len(text))


def test_parse_answer_missing_tags():
    for text, why in [
        ("46", "no <answer>"),
        ("<answer>46</answer>", "no <think>"),
        ("<think>x</think><answer>46", "no <answer>"),
        ("", "no <answer>"),
        ("<answer>46</answer><think>x</think>", "no <think>"),
    ]:
        p = parse_answer(text)
        assert not p.ok and p.value is None and why in p.reason, text
        assert p.span is None  # a failed turn learns on all of it


def test_parse_answer_repeated_tags_last_wins():
    text = "ab<think>x</think><answer>1</answer><answer> 2 </answer>zz"
    p = parse_answer(text)
    assert p.ok and p.value == "2"
    assert p.span == (2, len(text) - 2)  # first <think> .. end of the last </answer>


@pytest.mark.parametrize(
    "inner,value", [("0.7", 0.7), (" 0.7 ", 0.7), ("\n0.7\t", 0.7), ("1", 1.0), ("0", 0.0), (".25", 0.25), ("1.0", 1.0)]
)
def test_parse_confidence_good(inner, value):
    text = f"<confidence>{inner}</confidence>"
    p = parse_confidence(text)
    assert p.ok and p.value == pytest.approx(value) and p.span == (0, len(text))


@pytest.mark.parametrize(
    "text,why",
    [
        ("<confidence>1.5</confidence>", "outside [0, 1]"),
        ("<confidence>-0.1</confidence>", "outside [0, 1]"),
        ("<confidence>abc</confidence>", "'abc' is not a number"),
        ("<confidence>nan</confidence>", "not a number"),
        ("<confidence>0.7 or so</confidence>", "not a number"),
        ("<confidence></confidence>", "not a number"),
        ("0.7", "no <confidence>"),
        ("<confidence>0.7", "no <confidence>"),
    ],
)
def test_parse_confidence_bad(text, why):
    p = parse_confidence(text)
    assert not p.ok and p.value is None and why in p.reason


def test_parse_confidence_repeated_and_analysis():
    p = parse_confidence("<confidence>0.2</confidence><confidence>0.9</confidence>")
    assert p.ok and p.value == 0.9 and p.span == (0, 56)
    p = parse_confidence("<confidence>0.2</confidence><confidence>abc</confidence>")
    assert not p.ok  # the last tag wins, even when it is the bad one
    text = "x<analysis>carry</analysis><confidence>0.3</confidence>"
    p = parse_confidence(text)
    assert p.ok and p.value == 0.3 and p.span == (1, len(text))


def test_brier_by_hand():
    assert brier_reward(1, 0.7) == pytest.approx(1 - 0.09)
    assert brier_reward(0, 0.7) == pytest.approx(1 - 0.49)
    assert brier_reward(1, 1.0) == 1.0 and brier_reward(0, 0.0) == 1.0
    assert brier_reward(0, 1.0) == 0.0 and brier_reward(1, 0.0) == 0.0
    assert brier_reward(0, 0.5) == brier_reward(1, 0.5) == 0.75
    assert brier_reward(1, None) == 0.0  # unparsable confidence


# ------------------------------------------------------------------------------------ advantages


def test_tree_advantages_by_hand():
    acc = [1.0, 0.0, 0.0, 1.0]
    conf = [[0.91, 0.51], [0.19, 0.99], [1.0, 1.0], [0.5, 0.7]]
    adv_ans, adv_conf = tree_advantages(acc, conf, norm_by_std=False, lambda_ans=2.0, lambda_conf=0.5)
    assert adv_ans == pytest.approx([1.0, -1.0, -1.0, 1.0])  # 2 * (R - 0.5)
    assert adv_conf[0] == pytest.approx([0.1, -0.1])  # 0.5 * (R - 0.71)
    assert adv_conf[1] == pytest.approx([-0.2, 0.2])  # 0.5 * (R - 0.59)
    assert adv_conf[2] == pytest.approx([0.0, 0.0])  # no variance, no signal
    _, adv_std = tree_advantages(acc, conf, norm_by_std=True)
    assert adv_std[0] == pytest.approx([0.2 / (0.2 * 2**0.5 + 1e-6), -0.2 / (0.2 * 2**0.5 + 1e-6)])


def test_confidence_advantages_never_mix_answers():
    acc = [1.0, 0.0, 1.0]
    conf = np.array([[0.91, 0.51, 0.75], [0.19, 0.99, 0.64], [1.0, 0.96, 0.84]])
    for norm in (False, True):
        _, before = tree_advantages(acc, conf, norm)
        changed = conf.copy()
        changed[1] = [0.0, 0.0, 1.0]  # another answer's confidences change
        changed[2] = [0.3, 0.2, 0.1]
        _, after = tree_advantages(acc, changed, norm)
        assert after[0] == pytest.approx(before[0])
        assert not np.allclose(after[1], before[1])
        # and a confidence's baseline is its own answer's mean, not the prompt's
        if not norm:
            assert before[0] == pytest.approx(conf[0] - conf[0].mean())


# ------------------------------------------------------------------------------------ scripted rollouts


def scripted_engine(tok, answers, confidences) -> ScriptedEngine:
    """The shared scripted engine (policy version 7, log-probs -0.5, replies cut at the token budget):
    turn 1 (the first call) from ``answers``, turn 2 from ``confidences``, both cycled over the
    call's prompts."""
    return ScriptedEngine.per_call(tok, [list(answers), list(confidences)], version=7, logprob=-0.5, truncate=True)


def _cfg(**algo):
    algo = {"num_generations_answer": 2, "num_generations_confidence": 2, "verifier": "numeric", **algo}
    return load_config(
        None, ["algorithm=rlcr", "sampling.max_new_tokens=60"] + [f"algo.{k}={v}" for k, v in algo.items()]
    )


def _rollout(answers, confidences, tasks=None, **algo):
    tok = build_char_tokenizer()
    cfg = _cfg(**algo)
    engine = scripted_engine(tok, answers, confidences)
    tasks = tasks or [Task(id="t0", prompt=[{"role": "user", "content": "1+2="}], answer=3)]
    wf = get_workflow("rlcr", cfg)
    ctx = RolloutContext(engine, tok, SingleTurnEnv(), cfg, "actor-x", seed=5)
    return wf.rollout(tasks, ctx), engine, tok


RIGHT_WRONG = ["<think>a</think><answer>3</answer>", "<think>a</think><answer>4</answer>"]  # for 1+2=


def test_mask_spans_at_exact_token_positions():
    episodes, engine, tok = _rollout(
        ["x<think>1+2</think><answer>3</answer><|end|>"],
        ["<analysis>ok</analysis><confidence>0.7</confidence><|end|>", "<confidence>0.7</confidence>zz<|end|>"],
    )
    (ep,) = episodes
    answer, conf_a, conf_b = ep.trajectories[0], ep.trajectories[2], ep.trajectories[3]
    # prompt: <|system|> "Answer in tags." <|end|> <|user|> "1+2=" <|end|> <|assistant|> = 1+15+1+1+4+1+1
    assert len(ep.decision["answers"][0]["confidences"]) == 2 and ep.decision["prompt_tokens"] == 24
    # turn 1: "x"(24) "<think>"(25..31) "1+2" "</think>" "<answer>" "3" "</answer>"(52..60) EOS(61)
    assert len(answer.token_ids) == 62
    assert answer.loss_mask.tolist() == [0] * 25 + [1] * 37  # from <think> to EOS, not the "x"
    assert tok.decode(answer.token_ids[25:61].tolist()) == "<think>1+2</think><answer>3</answer>"
    # turn 2 context: 62 + "<|user|>Confidence (0-1)?<|end|><|assistant|>" (1+17+1+1) = 82 tokens
    # "<analysis>ok</analysis><confidence>0.7</confidence>" = 10+2+11+12+3+13 = 51, then EOS
    assert len(conf_a.token_ids) == 82 + 52
    assert conf_a.loss_mask.tolist() == [0] * 82 + [1] * 52
    # trailing text after </confidence> (and so the EOS) is outside the span: 82 + 28 learned
    assert conf_b.loss_mask.tolist() == [0] * 82 + [1] * 28 + [0] * 3
    assert tok.decode(conf_b.token_ids[82:110].tolist()) == "<confidence>0.7</confidence>"
    # behaviour log-probs only where learned; the spans are recorded in the tree
    assert np.all(conf_b.behavior_logprobs[conf_b.loss_mask == 0] == 0)
    assert np.all(conf_b.behavior_logprobs[conf_b.loss_mask == 1] == -0.5)
    assert ep.decision["answers"][0]["mask_span"] == [25, 62]
    assert ep.decision["answers"][0]["confidences"][1]["mask_span"] == [82, 110]
    # the confidence row repeats the answer tokens exactly, with mask 0 (disjoint from the answer's)
    assert conf_a.token_ids[:62].tolist() == answer.token_ids.tolist()
    assert conf_a.loss_mask[:62].sum() == 0


def test_rollout_tree_rewards_and_advantages():
    # two answers per prompt (right, wrong), two confidences per answer (0.9, 0.2)
    tasks = [Task(id=f"t{i}", prompt=[{"role": "user", "content": "1+2="}], answer=3) for i in range(3)]
    episodes, engine, _ = _rollout(
        RIGHT_WRONG, ["<confidence>0.9</confidence>", "<confidence>0.2</confidence>"], tasks=tasks, lambda_conf=0.5
    )
    assert engine.calls == [3 * 2, 3 * 2 * 2]  # all turn-1 in one call, all turn-2 in another
    assert len(episodes) == 3
    ep = episodes[0]
    types = [t.sample_type for t in ep.trajectories]
    assert types == ["answer"] * 2 + ["confidence"] * 4
    assert [t.reward for t in ep.trajectories] == pytest.approx([1, 0, 1 - 0.01, 1 - 0.64, 1 - 0.81, 1 - 0.04])
    assert [t.advantage for t in ep.trajectories[:2]] == pytest.approx([0.5, -0.5])
    # confidences about the right answer: mean 0.675; about the wrong answer: mean 0.575
    assert [t.advantage for t in ep.trajectories[2:]] == pytest.approx(
        [0.5 * 0.315, -0.5 * 0.315, -0.5 * 0.385, 0.5 * 0.385]
    )
    assert len({t.group_id for t in ep.trajectories[2:]}) == 2 and ep.trajectories[0].group_id == ep.id
    assert all(t.policy_version == 7 for t in ep.trajectories)
    tree = ep.decision
    assert tree["kind"] == "rlcr_tree" and tree["gold"] == 3
    assert [a["acc_reward"] for a in tree["answers"]] == [1.0, 0.0]
    assert tree["answers"][1]["confidences"][1]["conf_reward"] == pytest.approx(0.96)
    m = ep.metrics
    assert m["rlcr/answer_reward_mean"] == 0.5 and m["rlcr/effective_ga"] == 1.0
    assert m["rlcr/effective_gc"] == 1.0 and m["rlcr/confidence_format_fail"] == 0.0
    assert m["rlcr/confidence_mean"] == pytest.approx(0.55)


def test_bad_output_scores_zero_with_a_reason():
    episodes, _, _ = _rollout(
        ["46", "<think>a</think><answer>abc</answer>", "", "<think>a</think><answer>3"],
        ["<confidence>1.5</confidence>", "<confidence>abc</confidence>", "", "<confidence>0.7 </confidence>"],
        num_generations_answer=4,
        num_generations_confidence=4,
    )
    (ep,) = episodes
    answers = ep.decision["answers"]
    assert [a["acc_reward"] for a in answers] == [0.0] * 4
    assert [a["format_ok"] for a in answers] == [False, True, False, False]
    assert "no <answer>" in answers[0]["reason"] and answers[1]["answer"] == "abc"
    confs = answers[0]["confidences"]
    assert [c["conf_reward"] for c in confs] == pytest.approx([0, 0, 0, 1 - 0.49])
    assert "outside" in confs[0]["reason"] and "not a number" in confs[1]["reason"]
    assert ep.metrics["rlcr/answer_format_fail"] == 0.75
    assert ep.metrics["rlcr/confidence_format_fail"] == 0.75
    # a failed turn learns on all of its tokens (its zero reward pushes it away)
    first = ep.trajectories[0]
    assert first.loss_mask.sum() == 2 and first.advantage == 0.0
    # the turn-2 prompt closes a turn cut at the length limit with an (unlearned) EOS
    conf_row = ep.trajectories[4]
    n = len(first.token_ids)
    assert conf_row.token_ids[:n].tolist() == first.token_ids.tolist()
    assert conf_row.token_ids[n] == 3 and conf_row.loss_mask[: n + 1].sum() == 0


def test_rows_work_with_every_loss_agg_mode():
    episodes, _, _ = _rollout(RIGHT_WRONG, ["<confidence>0.9</confidence>", "<confidence>0.2</confidence>"])
    trajs = episodes[0].trajectories
    batch = collate(trajs, torch.tensor([t.advantage for t in trajs]), pad_id=0)
    for mode in LOSS_AGG_MODES:
        logp = (batch.behavior_logprobs + 0.01).clone().requires_grad_(True)
        loss, _ = compute_policy_loss(
            PolicyLossInputs(logp, batch.behavior_logprobs, batch.advantages, batch.response_mask),
            LossConfig(loss_agg_mode=mode, agg_norm=8.0),
        )
        loss.backward()
        assert torch.isfinite(loss)
        assert torch.all(logp.grad[batch.response_mask == 0] == 0), mode  # only the target spans learn
        assert logp.grad[batch.response_mask == 1].abs().sum() > 0, mode


def test_evaluate_reports_calibration():
    tok = build_char_tokenizer()
    cfg = _cfg()
    tasks = [Task(id=f"t{i}", prompt=[{"role": "user", "content": f"{i}+0="}], answer=i) for i in range(4)]
    # answers "0" for every task: right for t0 only; confidence 0.9 except an unparsable one
    engine = scripted_engine(
        tok,
        ["<think>a</think><answer>0</answer>"],
        ["<confidence>0.9</confidence>"] * 3 + ["<confidence>x</confidence>"],
    )
    wf = get_workflow("rlcr", cfg)
    report = wf.evaluate(engine, tok, SingleTurnEnv(), tasks, SamplingConfig(n=1, max_new_tokens=60), cfg)
    assert engine.calls == [4, 4]
    assert report["accuracy"] == 0.25 and report["size"] == 4
    assert report["confidence_parse_fail"] == 0.25  # counted as confidence 0
    assert report["brier"] == pytest.approx((0.01 + 0.81 + 0.81 + 0.0) / 4)
    # the reference's right-closed bins by default, named in the record: (0.8, 0.9] holds the 3 answers at
    # 0.9 with accuracy 1/3; the first bin the one at 0.0 with accuracy 0
    assert report["ece_bins"] == "right_closed"
    assert report["ece"] == pytest.approx(3 / 4 * (0.9 - 1 / 3))
    assert report["auroc"] == pytest.approx((1 + 0.5 * 2) / 3)  # the right one (0.9) vs 0.9, 0.9, 0.0
    assert report["reliability"][8]["count"] == 3 and report["reliability"][0]["count"] == 1
    left = get_workflow("rlcr", _cfg(ece_bins="left_closed"))
    engine = scripted_engine(
        tok,
        ["<think>a</think><answer>0</answer>"],
        ["<confidence>0.9</confidence>"] * 3 + ["<confidence>x</confidence>"],
    )
    report = left.evaluate(engine, tok, SingleTurnEnv(), tasks, SamplingConfig(n=1, max_new_tokens=60), cfg)
    assert report["ece_bins"] == "left_closed" and report["reliability"][9]["count"] == 3  # [0.9, 1.0)


# ------------------------------------------------------------------------------------ config, verifiers


def test_algo_section_is_validated():
    with pytest.raises(ConfigError, match="algo.num_generations"):
        get_workflow("rlcr", _cfg(num_generations_answer=0))
    with pytest.raises(ConfigError, match="unknown key 'algo.lambda'"):
        get_workflow("rlcr", _cfg(**{"lambda": 1}))
    assert all(f.description for f in RLCRConfig.model_fields.values())


def test_verifiers():
    assert verify_numeric(46, "46") and verify_numeric(46, " 46 ") and verify_numeric(1.5, "1.50")
    assert not verify_numeric(46, "45") and not verify_numeric(46, "4 6") and not verify_numeric(46, "abc")
    assert not verify_numeric(46, "46 apples") and verify_numeric([1, 2], "2")
    assert verify_exact_match("Eiffel Tower", "the eiffel tower!") and not verify_exact_match("Paris", "Lyon")
    assert resolve_verifier("auto", 3) == "numeric" and resolve_verifier("auto", "Paris") == "exact_match"
    assert resolve_verifier("auto", "x", {"verifier": "math"}) == "math"
    with pytest.raises(ValueError, match="valid: auto"):
        resolve_verifier("fuzzy")


def test_math_verifier():
    pytest.importorskip("math_verify")
    assert verify("math", "\\frac{1}{2}", "0.5")
    assert verify("math", "$x^2+1$", "1+x^2")
    assert not verify("math", "\\frac{1}{2}", "0.3")
    assert not verify("math", "2", "no idea at all {{{")


def test_warmstart_format_is_uninformative():
    assert "rlcr" in RLCRWorkflow.warmstart_formats
    rng = random.Random(0)
    by_label = {True: [], False: []}
    turn1 = 0
    for _ in range(3000):
        messages, completion = rlcr_warmstart_example(rng)
        assert messages[0]["role"] == "system"
        if len(messages) == 2:  # turn 1: tags around the right answer
            p = parse_answer(completion)
            assert p.ok and int(p.value) == eval(messages[1]["content"].rstrip("="))
            turn1 += 1
            continue
        shown = parse_answer(messages[2]["content"])
        right = int(shown.value) == eval(messages[1]["content"].rstrip("="))
        c = parse_confidence(completion)
        assert c.ok and messages[3]["content"] == RLCRConfig().confidence_prompt
        by_label[right].append(c.value)
    assert 1300 < turn1 < 1700
    assert min(len(v) for v in by_label.values()) > 500
    # the stated confidence says nothing about correctness
    assert abs(np.mean(by_label[True]) - np.mean(by_label[False])) < 0.05
