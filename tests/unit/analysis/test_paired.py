"""The held-out change, problem by problem (asyncrl.analysis.paired), and the run summary's row for it."""

from __future__ import annotations

import math

from asyncrl.analysis.paired import paired_change
from asyncrl.learner.progress import summary_table


def _eval(correct: list[bool], version: int) -> dict:
    return {
        "accuracy": sum(correct) / len(correct),
        "version": version,
        "samples": [{"task_id": f"t{i}", "correct": c} for i, c in enumerate(correct)],
    }


def test_the_paired_interval_of_a_change():
    before = _eval([False] * 60 + [True] * 40, 0)
    after = _eval([True] * 30 + [False] * 30 + [True] * 35 + [False] * 5, 10)  # 30 gained, 5 lost
    p = paired_change(before, after)
    assert (p["n"], p["gained"], p["lost"]) == (100, 30, 5)
    assert math.isclose(p["change"], 0.25) and math.isclose(p["after"] - p["before"], 0.25)
    d = [1] * 30 + [-1] * 5 + [0] * 65
    sd = math.sqrt(sum((x - 0.25) ** 2 for x in d) / 99)
    assert math.isclose(p["ci95"][0], 0.25 - 1.96 * sd / 10) and p["ci95"][0] > 0
    same = paired_change(before, _eval([True] * 5 + [False] * 55 + [True] * 35 + [False] * 5, 10))
    assert same["ci95"][0] < 0 < same["ci95"][1]  # 5 gained, 5 lost: no change shown
    assert paired_change({"samples": []}, after) is None


def test_the_run_summary_says_it(capsys):
    out = summary_table([0.1, 0.2], [_eval([False] * 50 + [True] * 50, 0), _eval([True] * 90 + [False] * 10, 2)])
    lo, hi = out["eval_accuracy_change_ci95"]
    assert 0 < lo < 0.4 < hi
    text = capsys.readouterr().out
    assert "paired 95% CI" in text and f"[{lo:+.3f}, {hi:+.3f}]" in text and "50 gained" in text and "10 lost" in text
