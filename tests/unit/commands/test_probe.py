"""``asyncrl probe``: the model sampled on training tasks as an actor samples them, and greedily; the share of
groups whose rewards differ (what GRPO learns from) is what it reports. A real subprocess, a real model."""

from __future__ import annotations

import json

from tests.conftest import ROOT, run_cli


def test_probe_reports_the_signal_a_run_would_have(tiny_overrides):
    done = run_cli(
        "probe",
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        "--tasks",
        "6",
        "--json",
        "sampling.n=4",
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tasks"] == 6 and result["samples"] == 24
    assert 0.0 <= result["groups_with_signal"] <= 1.0 and 0.0 <= result["greedy_accuracy"] <= 1.0
    assert result["pass@4"] >= result["sampled_accuracy"]  # a group with one right reply passes
    assert "groups whose 4 rewards differ" in done.stdout and "[probe]" in done.stdout


def test_probe_says_when_every_group_is_the_same(tiny_overrides):
    """A reward that is constant: no group differs, and the probe says there is little to learn."""
    done = run_cli(
        "probe",
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        "--tasks",
        "4",
        "--json",
        "sampling.n=2",
        "env.reward=tests.support.plugins:constant_reward",
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["groups_with_signal"] == 0.0
    assert "little to learn from" in done.stdout
