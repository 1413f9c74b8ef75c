"""The safe arithmetic evaluator: correct values, and hostile input refused with a reason."""

from __future__ import annotations

import time

import pytest

from asyncrl.sandbox.arith import ArithLimits, evaluate_expression, parse_int_reply


@pytest.mark.parametrize(
    "text,value",
    [
        ("12+34", 46),
        ("7*8-6", 50),
        ("(2+3)*4", 20),
        ("-5+2", -3),
        ("17//5", 3),
        ("17%5", 2),
        ("2**10", 1024),
        (" 1 + 1 ", 2),
        ("2**3**2", 512),  # right-associative: 2**9
    ],
)
def test_values(text, value):
    res = evaluate_expression(text)
    assert res.ok, res.reason
    assert res.value == value


@pytest.mark.parametrize(
    "text,reason",
    [
        ("9**9**9", "exponent 387420489 exceeds max_exponent 16"),
        ("(" * 10_000 + "1" + ")" * 10_000, "brackets nested 10000 deep"),
        ("4**16*4**16", "product needs more than max_bits 64 bits"),
        ("99**16", "99**16 needs more than max_bits 64 bits"),
        ("10**10**10", "exceeds max_exponent"),
        ("1//0", "division by zero"),
        ("2**-1", "negative exponent"),
        ("1.5+1", "character '.' is not allowed"),
        ("__import__('os')", "character '_' is not allowed"),
        ("1+", "not an expression"),
        ("42", "0 binary operators"),
        ("", "empty expression"),
        ("(1+2", "unbalanced brackets"),
        ("1)+(2", "unbalanced brackets"),
        ("1+" * 40 + "1", "characters long"),
        ("-" * 10 + "1", "10 operators (max_operators 8)"),
        ("-" * 20 + "1", "nested deeper than max_depth 16"),
    ],
)
def test_hostile_or_bad_input_is_rejected_with_a_reason(text, reason):
    t0 = time.perf_counter()
    res = evaluate_expression(text)
    assert not res.ok and res.value is None
    assert reason in res.reason
    assert time.perf_counter() - t0 < 0.5  # refused before any expensive work


def test_limits_are_configurable():
    lim = ArithLimits(max_exponent=2, min_operators=0, max_bits=8)
    assert evaluate_expression("3**2", lim).value == 9
    assert "exceeds max_exponent 2" in evaluate_expression("3**3", lim).reason
    assert evaluate_expression("7", lim).value == 7  # a bare number is allowed with min_operators 0
    assert "bits (max_bits 8)" in evaluate_expression("200+100", lim).reason


def test_parse_int_reply():
    assert parse_int_reply(" 46 ") == 46
    assert parse_int_reply("-3") == -3
    assert parse_int_reply("46 apples") is None
    assert parse_int_reply("") is None
    assert parse_int_reply("4 6") is None
