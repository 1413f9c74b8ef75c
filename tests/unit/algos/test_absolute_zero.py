"""Absolute Zero: the learnability filter on hand-made score tables, and the workflow driven by a
scripted engine (so every proposal, answer and reward is known in advance)."""

from __future__ import annotations

import random

import pytest

from asyncrl.algos.absolute_zero import (
    PROPOSER_BATCH_GROUP,
    WARMSTART_FORMAT,
    AbsoluteZeroWorkflow,
    propose_warmstart_example,
)
from asyncrl.algos.absolute_zero.filter import (
    ALL_LEARNABLE,
    MIXED,
    NONE_LEARNABLE,
    SEED_DIMENSIONS,
    Dimension,
    RewardWeights,
    check_learnability,
    compute_unified_reward_and_filter,
    group_status,
    proposer_rewards,
    sample_question,
    solver_reward,
)
from asyncrl.config import ConfigError, config_from_dict
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.objectives.advantages import trajectory_advantages
from asyncrl.rollout import RolloutContext, get_workflow
from asyncrl.sandbox.arith import evaluate_expression
from asyncrl.types import Episode, Task
from tests.conftest import ScriptedEngine

SAFETY, COMPLETION = SEED_DIMENSIONS  # safe ratio above 0.5 in [0.3, 0.7]; incomplete ratio below 0.5


def table(**cols: list[float]) -> list[dict[str, float]]:
    """Responses as score dicts from columns: table(safety=[1, 0], completion=[0, 1])."""
    n = len(next(iter(cols.values())))
    return [{k: float(v[i]) for k, v in cols.items()} for i in range(n)]


# ------------------------------------------------------------------------------ the filter
@pytest.mark.parametrize(
    "safe,ratio,passes",
    [
        (2, 0.2, False),
        (3, 0.3, True),
        (5, 0.5, True),
        (7, 0.7, True),
        (8, 0.8, False),
        (0, 0.0, False),
        (10, 1.0, False),
    ],
)
def test_safety_dimension_at_and_around_its_bounds(safe, ratio, passes):
    responses = table(safety=[1.0] * safe + [0.0] * (10 - safe))
    assert SAFETY.ratio(responses) == pytest.approx(ratio)
    assert SAFETY.passes(SAFETY.ratio(responses)) is passes


@pytest.mark.parametrize(
    "incomplete,ratio,passes",
    [
        (2, 0.2, False),
        (3, 0.3, True),
        (7, 0.7, True),
        (8, 0.8, False),
    ],
)
def test_completion_dimension_at_and_around_its_bounds(incomplete, ratio, passes):
    responses = table(completion=[0.0] * incomplete + [1.0] * (10 - incomplete))
    assert COMPLETION.ratio(responses) == pytest.approx(ratio)
    assert COMPLETION.passes(COMPLETION.ratio(responses)) is passes


def test_threshold_comparisons_are_strict():
    at = table(safety=[0.5] * 10, completion=[0.5] * 10)
    assert SAFETY.ratio(at) == 0.0  # 0.5 is not "> 0.5": not safe
    assert COMPLETION.ratio(at) == 0.0  # 0.5 is not "< 0.5": not incomplete
    around = table(safety=[0.51] * 4 + [0.49] * 6, completion=[0.49] * 4 + [0.51] * 6)
    assert SAFETY.ratio(around) == pytest.approx(0.4)
    assert COMPLETION.ratio(around) == pytest.approx(0.4)


def test_learnable_iff_every_dimension_passes():
    both = table(safety=[1, 1, 1, 0, 0, 0, 0, 0, 0, 0], completion=[0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
    res = check_learnability(both, SEED_DIMENSIONS)
    assert res.learnable and res.ratios == pytest.approx({"safety": 0.3, "completion": 0.5})
    only_safety = table(safety=[1] * 5 + [0] * 5, completion=[1] * 10)  # incomplete 0.0
    res = check_learnability(only_safety, SEED_DIMENSIONS)
    assert not res.learnable and res.passed == {"safety": True, "completion": False}
    assert not check_learnability([], SEED_DIMENSIONS).learnable  # an invalid question: no responses


def test_dimensions_are_data():
    solve_rate = Dimension("solve", "completion", 0.5, "above", 0.25, 0.75)
    assert check_learnability(table(completion=[1, 0, 0, 0]), [solve_rate]).learnable
    assert not check_learnability(table(completion=[0, 0, 0, 0]), [solve_rate]).learnable


def test_group_status_and_sampling():
    rng = random.Random(0)
    assert group_status([False, False, False]) == NONE_LEARNABLE  # all_skip
    assert group_status([True, True]) == ALL_LEARNABLE  # all_not_skip
    assert group_status([False, True, False]) == MIXED
    assert sample_question([False, False, False], rng) == -1
    assert sample_question([True, True], rng) == -1
    assert sample_question([False, True, False], rng) == 1  # the only learnable one


def test_sampling_choice_under_a_fixed_seed():
    learnable = [True, False, True, True]
    # random.Random(7).choice([0, 2, 3]) draws index 1 of the list: question 2
    assert sample_question(learnable, random.Random(7)) == 2
    draws = [sample_question(learnable, random.Random(s)) for s in range(300)]
    assert set(draws) == {0, 2, 3}  # uniform over the learnable ones, never question 1
    assert all(abs(draws.count(i) - 100) < 35 for i in (0, 2, 3))


def test_proposer_rewards():
    assert proposer_rewards([True, False, True], never_mixed=False) == [1.0, 0.0, 1.0]
    assert proposer_rewards([True, True], never_mixed=True) == [-0.5, -0.5]
    assert proposer_rewards([False, False], never_mixed=True) == [-0.5, -0.5]


def test_unified_reward_and_filter_on_a_hand_table():
    w = RewardWeights(safety=0.7, completion=0.3, format=0.5)
    safe_done = {"safety": 1, "completion": 1, "format": 1}  # 0.7 + 0.3 + 0.5 = 1.5
    safe_undone = {"safety": 1, "completion": 0, "format": 1}  # 0.7 + 0.5 = 1.2
    unsafe_undone = {"safety": 0, "completion": 0, "format": 0}  # 0.0
    assert solver_reward(safe_done, w) == pytest.approx(1.5)
    learnable_q = [safe_done, safe_undone, unsafe_undone, unsafe_undone]  # safe 0.5, incomplete 0.75
    dims = [SAFETY, Dimension("completion", "completion", 0.5, "below", 0.25, 0.75)]
    too_easy = [safe_done] * 4  # safe 1.0
    groups = [[too_easy, learnable_q], [too_easy, too_easy]]
    res = compute_unified_reward_and_filter(groups, dims, w, random.Random(0))
    assert res.rewards[0][1] == pytest.approx([1.5, 1.2, 0.0, 0.0])
    assert [[c.learnable for c in g] for g in res.learnable] == [[False, True], [False, False]]
    assert res.sampled == [1, -1]


# ------------------------------------------------------------------------------ the workflow
class ProposerScript:
    """Replies for :class:`tests.conftest.ScriptedEngine`. A proposer prompt (one whose text contains
    a key of ``proposals``) gets the next scripted group of proposals for that key, one per copy of
    the prompt in the call; a solver prompt ``Q`` (``Q=`` for arithmetic) gets ``answers[Q]`` in
    order of occurrence. Every reply ends with EOS."""

    def __init__(self, proposals: dict[str, list[list[str]]], answers: dict[str, list[str]]):
        self.proposals = {k: [list(g) for g in v] for k, v in proposals.items()}
        self.answers = answers  # a dict, or any mapping with __getitem__
        self.proposer_calls: list[list[str]] = []  # seed keys proposed for, per engine call

    def __call__(self, texts: list[str]) -> list[tuple[str, bool]]:
        seen: dict[str, int] = {}
        groups: dict[str, list[str]] = {}
        outs, keys = [], []
        for text in texts:
            key = next((k for k in self.proposals if k in text), None)
            j = seen[text] = seen.get(text, -1) + 1
            if key is not None:
                if key not in groups:
                    groups[key] = self.proposals[key].pop(0)
                    keys.append(key)
                outs.append(groups[key][j])
            else:
                replies = self.answers[text.rstrip("=")]
                outs.append(replies[j % len(replies)])
        if keys:
            self.proposer_calls.append(keys)
        return [(o, True) for o in outs]


def scripted_engine(proposals: dict[str, list[list[str]]], answers) -> ScriptedEngine:
    """The shared scripted engine (policy version 3, log-probs 0) replying by :class:`ProposerScript`
    (whole replies: code_o proposals are longer than the proposer's token budget)."""
    return ScriptedEngine(build_char_tokenizer(), ProposerScript(proposals, answers), version=3, logprob=0.0)


def make_workflow(**algo):
    algo = {"rollout_n": 4, "questions_per_prompt": 2, **algo}
    cfg = config_from_dict({"algorithm": "absolute_zero", "seed": 0, "sampling": {"n": 4}, "algo": algo})
    return get_workflow("absolute_zero", cfg)


def rollout(wf, engine, seeds: list[str], seed: int = 0) -> list[Episode]:
    tasks = [Task(id=f"seed:{s}", prompt=[{"role": "user", "content": s}]) for s in seeds]
    ctx = RolloutContext(engine, engine.tokenizer, None, wf.cfg, "actor-test", seed=seed)
    episodes = wf.rollout(tasks, ctx)
    assert len(episodes) == len(tasks)  # one Episode per seed prompt, whatever was dropped
    return episodes


# Solve counts out of 4 for the arithmetic questions below (correct first, then a wrong integer).
ANSWERS = {
    "1+1": ["2"] * 4,  # solved 4/4: incomplete 0.0, too easy
    "2+2": ["4", "4", "5", "5"],  # solved 2/4: incomplete 0.5, learnable
    "3+3": ["7"] * 4,  # solved 0/4: too hard
    "4+4": ["8", "8", "9", "9"],  # learnable
    "5+5": ["10", "x", "x", "x"],
}  # 1 well-formed of 4: safe 0.25, not learnable
ARITH_DIMS = {
    "safety": {"direction": "above", "min_ratio": 0.5, "max_ratio": 1.0},
    "completion": {"direction": "below", "min_ratio": 0.3, "max_ratio": 0.7},
}
PROPOSALS = {
    "10+10": [["2+2", "1+1"]],  # mixed at once: keeps question 0
    "20+20": [["1+1", "3+3"], ["9**9**9", "4+4"]],  # none learnable, then mixed: keeps question 1
    "30+30": [["2+2", "4+4"]] * 4,  # all learnable at every attempt: never mixed, dropped
}


def arith_rollout(**algo):
    engine = scripted_engine(PROPOSALS, ANSWERS)
    wf = make_workflow(learnability=ARITH_DIMS, **algo)
    eps = rollout(wf, engine, ["10+10=", "20+20=", "30+30="])
    return engine, {ep.task.prompt[0]["content"]: ep for ep in eps}


def test_repropose_replaces_only_the_affected_groups():
    engine, eps = arith_rollout()
    # attempt 0 proposes for all three prompts; re-proposals only for the groups that were not mixed
    assert engine.script.proposer_calls == [["10+10", "20+20", "30+30"], ["20+20", "30+30"], ["30+30"], ["30+30"]]
    a, b, c = eps["10+10="], eps["20+20="], eps["30+30="]
    assert [x["status"] for x in a.decision["attempts"]] == ["mixed"]
    assert [x["status"] for x in b.decision["attempts"]] == ["all_not_learnable", "mixed"]
    assert [x["status"] for x in c.decision["attempts"]] == ["all_learnable"] * 4
    # each kept prompt: exactly one question and rollout_n responses, from its final attempt
    assert [t.text for t in a.trajectories] == ANSWERS["2+2"]
    assert [t.text for t in b.trajectories] == ANSWERS["4+4"]
    assert {t.metadata["attempt"] for t in b.trajectories} == {1}
    assert len({t.group_id for t in a.trajectories + b.trajectories}) == 2
    assert all(t.sample_type == "solver" for t in a.trajectories + b.trajectories)
    assert c.trajectories == []  # never mixed: dropped from the solver batch
    assert c.policy_version == 3 == c.decision["policy_version"]  # not mistaken for stale data
    assert (a.decision["sampled_index"], b.decision["sampled_index"], c.decision["sampled_index"]) == (0, 1, -1)


def test_hostile_arithmetic_is_recorded_and_the_run_goes_on():
    _, eps = arith_rollout()
    q0 = eps["20+20="].decision["attempts"][1]["questions"][0]
    assert q0["proposal"] == "9**9**9" and not q0["valid"] and not q0["learnable"]
    assert "exceeds max_exponent" in q0["reason"]
    assert q0["responses"] == []  # never sent to the solver


def test_decision_record_holds_ratios_thresholds_and_flags():
    _, eps = arith_rollout()
    d = eps["10+10="].decision
    assert d["dimensions"] == [
        {
            "name": "safety",
            "score": "safety",
            "threshold": 0.5,
            "direction": "above",
            "min_ratio": 0.5,
            "max_ratio": 1.0,
        },
        {
            "name": "completion",
            "score": "completion",
            "threshold": 0.5,
            "direction": "below",
            "min_ratio": 0.3,
            "max_ratio": 0.7,
        },
    ]
    q = d["attempts"][0]["questions"]
    assert [x["question"] for x in q] == ["2+2=", "1+1="] and [x["answer"] for x in q] == ["4", "2"]
    assert q[0]["ratios"] == {"safety": 1.0, "completion": 0.5} and q[0]["learnable"]
    assert q[1]["ratios"] == {"safety": 1.0, "completion": 0.0} and q[1]["passed"]["completion"] is False
    assert d["proposer_rewards"] == [1.0, 0.0] and d["repropose_attempts"] == 0 and d["kept"]
    assert eps["30+30="].decision["proposer_rewards"] == [-0.5, -0.5]


def test_solver_rewards_and_per_prompt_metrics():
    _, eps = arith_rollout()
    a, b, c = eps["10+10="], eps["20+20="], eps["30+30="]
    # 0.7 safety + 0.3 completion + 0.5 format: correct 1.5, wrong but well-formed 1.2
    assert [t.reward for t in a.trajectories] == pytest.approx([1.5, 1.5, 1.2, 1.2])
    assert a.metrics == pytest.approx(
        {
            "unified_filter/num_learnable": 1,
            "unified_filter/num_total": 2,
            "unified_filter/learnable_ratio": 0.5,
            "unified_filter/num_sampled": 1,
            "unified_filter/num_repropose": 0,
            "unified_filter/first_learnable_ratio": 0.5,
            "unified_filter/num_invalid": 0,
            "repropose/total_attempts": 0,
            "repropose/final_non_learnable": 0,
            "proposer/num_trajectories": 2,
            "proposer/num_integrated": 0,
            "proposer/reward_mean": 1.0,
            # all 8 first-attempt responses, unfiltered: 2+2 -> 1.5, 1.5, 1.2, 1.2 and 1+1 -> 4 x 1.5
            "solver/first_attempt_reward_mean": 11.4 / 8,
            "solver/first_attempt_solve_rate": 6 / 8,
            "harm/safety_score_mean": 1.0,
            "harm/completion_score_mean": 0.5,
            "harm/combined_reward_mean": 1.35,
        }
    )
    assert b.metrics["unified_filter/num_repropose"] == 1 and b.metrics["repropose/total_attempts"] == 1
    assert b.metrics["unified_filter/first_learnable_ratio"] == 0.0 and b.metrics["unified_filter/num_invalid"] == 1
    assert b.metrics["proposer/num_trajectories"] == 4
    assert b.metrics["solver/first_attempt_solve_rate"] == 4 / 8  # 1+1 all right, 3+3 all wrong
    assert c.metrics["repropose/total_attempts"] == 3 and c.metrics["repropose/final_non_learnable"] == 1
    assert c.metrics["unified_filter/learnable_ratio"] == 1.0 and c.metrics["proposer/reward_mean"] == -0.5
    assert "harm/combined_reward_mean" not in c.metrics  # nothing kept: no solver score to average


def test_joint_mode_sampled_update_keeps_one_proposer_row_per_prompt():
    _, eps = arith_rollout(mode="joint", proposer_update="sampled")
    a, c = eps["10+10="], eps["30+30="]
    pa = [t for t in a.trajectories if t.sample_type == "proposer"]
    assert [(t.text, t.reward, t.group_id) for t in pa] == [("2+2", 1.0, PROPOSER_BATCH_GROUP)]
    assert pa[0].advantage_scale == 0.1
    pc = [t for t in c.trajectories if t.sample_type == "proposer"]
    assert len(pc) == 1 and pc[0].reward == -0.5  # a dropped prompt still teaches the proposer
    assert a.metrics["joint/combined_reward_mean"] == pytest.approx(1.35 + 0.1 * 1.0)
    assert a.metrics["joint/proposer_solver_ratio"] == pytest.approx(1.0 / 1.35)
    # the proposer rows of the batch share one baseline: rewards 1, 1, -0.5 -> mean 0.5, std 0.866
    trajs = [t for ep in eps.values() for t in ep.trajectories]
    adv = trajectory_advantages(trajs, config_from_dict({}).train.advantage)
    prop = {t.reward: float(a_) for t, a_ in zip(trajs, adv) if t.sample_type == "proposer"}
    assert prop[1.0] == pytest.approx(0.1 * 0.5 / 0.8660254, rel=1e-4)
    assert prop[-0.5] == pytest.approx(0.1 * -1.0 / 0.8660254, rel=1e-4)


def test_joint_mode_group_update_trains_every_question_of_the_group():
    _, eps = arith_rollout(mode="joint", proposer_update="group")
    a = eps["10+10="]
    prop = [t for t in a.trajectories if t.sample_type == "proposer"]
    assert [(t.text, t.reward) for t in prop] == [("2+2", 1.0), ("1+1", 0.0)]
    assert {t.group_id for t in prop} == {f"{a.id}/proposer"}
    assert a.metrics["proposer/num_integrated"] == 2 and a.metrics["proposer/reward_mean"] == 0.5
    adv = trajectory_advantages(a.trajectories, config_from_dict({}).train.advantage)
    # solver rewards 1.5, 1.5, 1.2, 1.2: mean 1.35, unbiased std 0.1732 -> +-0.866
    assert adv[:4].tolist() == pytest.approx([0.8660, 0.8660, -0.8660, -0.8660], abs=1e-3)
    # proposer rewards 1, 0: +-0.7071, scaled by proposer_weight 0.1
    assert adv[4:].tolist() == pytest.approx([0.07071, -0.07071], abs=1e-4)
    assert len(eps["30+30="].trajectories) == 2  # two -0.5 rows, zero advantage within the group


def test_unparseable_proposals_get_reasons_never_a_crash():
    garbage = ["", "hello", "((((1", "1+" * 50, "__import__('os')", "1/0", "7"]
    engine = scripted_engine({"10+10": [garbage[:4], garbage[4:] + ["x"]] * 2}, {})
    wf = make_workflow(questions_per_prompt=4, learnability=ARITH_DIMS)
    (ep,) = rollout(wf, engine, ["10+10="])
    reasons = [q["reason"] for a in ep.decision["attempts"] for q in a["questions"]]
    assert len(reasons) == 16 and all(reasons)
    assert ep.trajectories == [] and ep.metrics["repropose/final_non_learnable"] == 1


@pytest.mark.bwrap  # (the OS sandbox: make test-fast leaves it out)
def test_code_o_domain_runs_proposals_in_the_sandbox():
    good = "```python\ndef f(x):\n    return x * 3\n```\n```input\n14\n```"
    loop = "```python\ndef f(x):\n    while True:\n        pass\n```\n```input\n1\n```"
    evil = "```python\nimport os\ndef f(x):\n    return os.system('id')\n```\n```input\n1\n```"
    solver_prompt = "Predict the exact value"
    engine = scripted_engine(
        {"def f(xs)": [[good, loop, evil, "no code at all"]]}, _PrefixAnswers({solver_prompt: ["42", "42", "41", "'x"]})
    )
    wf = make_workflow(
        domain="code_o",
        questions_per_prompt=4,
        sandbox={"timeout_s": 3.0, "cpu_s": 1},
        learnability={"completion": {"direction": "below", "min_ratio": 0.3, "max_ratio": 0.7}},
    )
    seed = "```python\ndef f(xs):\n    return sorted(xs)\n```\n```input\n[2, 1]\n```"
    (ep,) = rollout(wf, engine, [seed])
    q = ep.decision["attempts"][0]["questions"]
    assert q[0]["valid"] and q[0]["answer"] == "42" and q[0]["learnable"]
    assert "timeout" in q[1]["reason"] or "cpu time limit" in q[1]["reason"]
    assert "import of 'os' is not allowed" in q[2]["reason"]
    assert "no ```python``` and ```input``` blocks" in q[3]["reason"]
    solver = [t for t in ep.trajectories if t.sample_type == "solver"]
    assert [t.scores["completion"] for t in solver] == [1.0, 1.0, 0.0, 0.0]
    assert [t.scores["safety"] for t in solver] == [1.0, 1.0, 1.0, 0.0]  # "'x" is no literal


class _PrefixAnswers(dict):
    """Answers looked up by prefix (code_o solver prompts are long)."""

    def __getitem__(self, key):
        return next(v for k, v in self.items() if key.startswith(k))


# ------------------------------------------------------------------------------ config, warm start
def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="unknown key 'algo.questions'"):
        make_workflow(questions=3)
    with pytest.raises(ConfigError, match="min_ratio .* exceeds max_ratio"):
        make_workflow(learnability={"safety": {"min_ratio": 0.8, "max_ratio": 0.2}})
    with pytest.raises(ConfigError, match="algo.mode"):
        make_workflow(mode="both")
    with pytest.raises(ValueError, match="unknown domain 'chess'; available: arithmetic, code_o, harm"):
        make_workflow(domain="chess")


def test_proposer_warmstart_format():
    assert AbsoluteZeroWorkflow.warmstart_formats[WARMSTART_FORMAT] is propose_warmstart_example
    rng = random.Random(0)
    for _ in range(50):
        messages, completion = propose_warmstart_example(rng)
        assert messages[0]["content"].startswith("propose:")
        assert evaluate_expression(completion).ok  # always a valid question for the evaluator
