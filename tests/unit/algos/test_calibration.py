"""Calibration metrics against numbers computed by hand."""

from __future__ import annotations

import math

import pytest

from asyncrl.algos.rlcr.calibration import (
    auroc,
    bin_index,
    brier_score,
    calibration_report,
    expected_calibration_error,
    reliability_bins,
)

# confidence, correct
TABLE = [(0.9, 1), (0.8, 0), (0.3, 0), (0.6, 1), (0.1, 0), (0.95, 1)]
CONF = [c for c, _ in TABLE]
CORRECT = [y for _, y in TABLE]


def test_brier_by_hand():
    # (0.1^2 + 0.8^2 + 0.3^2 + 0.4^2 + 0.1^2 + 0.05^2) / 6 = (0.01+0.64+0.09+0.16+0.01+0.0025) / 6
    assert brier_score(CONF, CORRECT) == pytest.approx(0.9125 / 6)


def test_ece_by_hand():
    # bins: 9 -> {0.9, 0.95} acc 1 conf 0.925 | 8 -> 0.8 acc 0 | 6 -> 0.6 acc 1 | 3 -> 0.3 acc 0 | 1 -> 0.1 acc 0
    # ECE = (2 * 0.075 + 0.8 + 0.4 + 0.3 + 0.1) / 6
    assert expected_calibration_error(CONF, CORRECT) == pytest.approx(1.75 / 6)


def test_auroc_by_hand():
    # right: 0.9, 0.6, 0.95; wrong: 0.8, 0.3, 0.1 -> 0.9 beats 3, 0.6 beats 2, 0.95 beats 3: 8 of 9
    assert auroc(CONF, CORRECT) == pytest.approx(8 / 9)
    assert auroc([0.5, 0.5, 0.2], [1, 0, 0]) == pytest.approx((0.5 + 1) / 2)  # a tie counts one half
    assert math.isnan(auroc([0.2, 0.9], [1, 1]))  # undefined with one class


def test_reliability_bins():
    bins = reliability_bins(CONF, CORRECT)
    assert len(bins) == 10
    assert [b["count"] for b in bins] == [0, 1, 0, 1, 0, 0, 1, 0, 1, 2]
    assert bins[9]["confidence"] == pytest.approx(0.925) and bins[9]["accuracy"] == 1.0
    assert bins[8]["accuracy"] == 0.0 and bins[0]["confidence"] is None
    assert (bins[3]["lo"], bins[3]["hi"]) == (0.3, 0.4)


def test_bin_edges():
    # decimal edges go in the bin they name; 1.0 goes in the last bin
    assert bin_index([0.0, 0.1, 0.3, 0.7, 0.99, 1.0]).tolist() == [0, 1, 3, 7, 9, 9]


def test_perfect_and_constant_confidence():
    assert expected_calibration_error([1.0, 0.0], [1, 0]) == 0.0
    assert brier_score([1.0, 0.0], [1, 0]) == 0.0
    # always 0.9 at accuracy 0.5: ECE 0.4, Brier (0.01 + 0.81) / 2
    assert expected_calibration_error([0.9] * 4, [1, 0, 1, 0]) == pytest.approx(0.4)
    assert brier_score([0.9] * 4, [1, 0, 1, 0]) == pytest.approx(0.41)


def test_report_and_bad_input():
    report = calibration_report(CONF, CORRECT)
    assert report["accuracy"] == 0.5 and report["size"] == 6
    assert report["ece"] == pytest.approx(1.75 / 6) and len(report["reliability"]) == 10
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        brier_score([1.5], [1])
    with pytest.raises(ValueError, match="3 values"):
        brier_score([0.1, 0.2, 0.3], [1])
