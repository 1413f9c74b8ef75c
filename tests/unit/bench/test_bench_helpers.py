"""The statistics the benchmark scripts report (bench/ is scripts, loaded here by path)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]  # tests/unit/<layer>/<this file>


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mean_ci_is_the_student_t_interval():
    st = _load("bench_staleness")
    mean, half = st.mean_ci([0.1, 0.2, 0.3])  # sd 0.1, t(2 df) = 4.303
    assert mean == pytest.approx(0.2) and half == pytest.approx(4.303 * 0.1 / 3**0.5)
    mean, half = st.mean_ci([0.5, 0.7, 0.4, 0.6, None, 0.8])  # None is a run without that value
    assert mean == pytest.approx(0.6) and half == pytest.approx(2.776 * 0.158113883 / 5**0.5)
    assert st.mean_ci([None]) is None


def test_paired_differences_are_taken_seed_by_seed(capsys):
    st = _load("bench_staleness")
    base = [{"eval_by_step": {"100": a}, "samples_per_step": 64} for a in (0.5, 0.6, 0.7)]
    other = [{"eval_by_step": {"100": a + d}, "samples_per_step": 64} for a, d in ((0.5, 0.1), (0.6, 0.1), (0.7, 0.1))]
    st.report_matched({"sync": base, "async": other})
    out = capsys.readouterr().out
    # the unpaired means differ by 0.1 with wide spreads; paired, every seed differs by exactly 0.1
    assert "| async | 0.100 ± 0.000 |" in out
    assert "step 100 (6.4k samples)" in out
