"""The code_o checker: a prediction is correct only when it is exactly the printed value, types
included, and a program that prints nothing is not a task."""

from __future__ import annotations

import pytest

from asyncrl.algos.absolute_zero.code_o import CodeOutputDomain, same_output
from asyncrl.sandbox.python import SandboxLimits
from asyncrl.types import Task


@pytest.mark.parametrize(
    "prediction,gold",
    [
        ("True", "1"),
        ("1", "True"),
        ("1.0", "1"),
        ("1", "1.0"),
        ("False", "0"),
        ("0", "False"),
        ("[True, 2.0]", "[1, 2]"),
        ("[1, 2]", "[1, 2.0]"),
        ("(1, 2)", "[1, 2]"),
        ("{1: True}", "{1: 1}"),
        ("{True: 'a'}", "{1: 'a'}"),
        ("{1, 2.0}", "{1, 2}"),
        ("'1'", "1"),
        ("None", "0"),
        ("[[1]]", "[[True]]"),
        ("1", "'1'"),
        ("b'a'", "'a'"),
    ],
)
def test_equal_values_of_other_types_are_not_correct(prediction, gold):
    well_formed, correct = same_output(prediction, gold)
    assert well_formed and not correct


@pytest.mark.parametrize(
    "prediction,gold",
    [
        ("1", "1"),
        ("True", "True"),
        ("2.5", "2.5"),
        ("[True, 2.0]", "[True, 2.0]"),
        ("{'b': 2, 'a': 1}", "{'a': 1, 'b': 2}"),
        ("{3, 1, 2}", "{1, 2, 3}"),
        ("(1, (2.0, 'x'))", "(1, (2.0, 'x'))"),
        ("```\n[1, 2]\n```", "[1, 2]"),
        ("-0.0", "0.0"),
        ("'a'", '"a"'),
    ],
)
def test_the_exact_value_is_correct(prediction, gold):
    assert same_output(prediction, gold) == (True, True)


def test_non_literal_gold_is_compared_as_text():
    assert same_output("inf", "inf") == (False, True)
    assert same_output("nan", "inf") == (False, False)


@pytest.mark.parametrize(
    "code",
    [
        "def f(x):\n    raise SystemExit(0)",
        "print = lambda *a, **k: None\ndef f(x):\n    return x",
        "def f(x):\n    return x\ndef print(*a):\n    return None",
    ],
)
@pytest.mark.bwrap  # (the OS sandbox: make test-fast leaves it out)
def test_a_program_that_prints_nothing_is_not_a_task(code):
    domain = CodeOutputDomain(SandboxLimits(timeout_s=5.0))
    got = domain.parse(f"```python\n{code}\n```\n```input\n3\n```", Task(id="seed", prompt=[]), "q0")
    assert not got.valid and got.task is None
    assert got.reason == "the program printed nothing: no output to predict"


@pytest.mark.bwrap  # (the OS sandbox: make test-fast leaves it out)
def test_a_program_that_prints_a_value_is_a_task():
    domain = CodeOutputDomain(SandboxLimits(timeout_s=5.0))
    got = domain.parse(
        "```python\ndef f(x):\n    return x > 2\n```\n```input\n3\n```", Task(id="seed", prompt=[]), "q0"
    )
    assert got.valid and got.gold == "True" and got.task.answer == "True"
    assert same_output("True", got.gold)[1] and not same_output("1", got.gold)[1]
