"""The notebooks in notebooks/ run top to bottom (nbclient, a real kernel) on real runs and draw
their figures."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from ._ui_runs import make_runs
from .conftest import ROOT

NOTEBOOKS = ROOT / "notebooks"
# notebook -> (run it reads, figures it must draw)
CASES = {"run_overview": ("absolute_zero", 3), "self_play_curriculum": ("absolute_zero", 3),
         "calibration": ("rlcr", 4)}


@pytest.fixture(scope="session")
def demo_runs(tmp_path_factory, model_cache, tiny_overrides):
    return make_runs(tmp_path_factory, model_cache)


def _execute(name: str, run_dir) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    param = nb.cells[1]
    assert param.cell_type == "code" and param.source.strip().endswith("RUN_DIR = None"), \
        "the second cell of each notebook sets RUN_DIR (None: a demo run)"
    param.source = f"RUN_DIR = {str(run_dir)!r}"
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def _outputs(nb, kind: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if kind in o.get("data", {}) or o.get("output_type") == kind]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_notebook_runs_top_to_bottom_and_draws_its_figures(demo_runs, name):
    algorithm, figures = CASES[name]
    nb = _execute(name, demo_runs[algorithm])
    images = _outputs(nb, "image/png")
    assert len(images) >= figures, f"{name}: {len(images)} figures, expected {figures}"
    assert all(len(o["data"]["image/png"]) > 5000 for o in images)  # base64 PNGs with something drawn
    assert not _outputs(nb, "error")
    printed = "".join(o.get("text", "") for o in _outputs(nb, "stream"))
    assert f"algorithm {algorithm}" in printed and "3 steps logged" in printed


@pytest.mark.slow
def test_a_notebook_for_another_algorithm_says_so(demo_runs):
    with pytest.raises(CellExecutionError, match="this notebook needs an RLCR run"):
        _execute("calibration", demo_runs["absolute_zero"])


# the notebooks' default demos (RUN_DIR = None): the run each one makes, and what it must show
DEMOS = {"run_overview": "grpo", "calibration": "rlcr", "self_play_curriculum": "absolute_zero"}


def test_notebooks_make_their_demo_with_the_default_settings():
    for name, algorithm in DEMOS.items():
        source = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4).cells[2].source
        assert f"demo_run('{algorithm}', run_root=PROJECT / \"runs\")" in source, name  # no quick, no step cut


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "rlcr"])
def test_default_demos_learn(algorithm, model_cache, tmp_path):
    """The default demo runs show learning, not flat zero curves: GRPO's batch reward and held-out
    accuracy rise; RLCR's held-out ECE and Brier fall, over confidences that were parsed."""
    from asyncrl.analysis import load_run
    from asyncrl.demo import demo_run

    run = load_run(demo_run(algorithm, tmp_path, extra_overrides=[f"model.embedded.cache_dir={model_cache}"]))
    s = run.records("learner_stop")[-1]["summary"]
    assert s["steps_trained"] == len(run.metrics) > 0
    if algorithm == "grpo":
        assert s["reward_last_10pct"] > s["reward_first_10pct"] > 0, s
        assert s["eval_accuracy_end"] > s["eval_accuracy_start"] > 0, s
    else:
        assert s["confidences_parsed_start"] > 50 and s["confidences_parsed_end"] > 50, s  # of 100
        assert s["eval_ece_end"] < 0.75 * s["eval_ece_start"], s
        assert s["eval_brier_end"] < 0.75 * s["eval_brier_start"], s


@pytest.mark.slow
def test_demo_run_reuses_only_a_run_made_with_the_same_settings(tmp_path, tiny_overrides):
    """An old demo run (say a few steps of a tiny model) is never shown as the learning demo: a
    finished demo is reused only when it was made with the very same settings."""
    from asyncrl.analysis import load_run
    from asyncrl.demo import demo_run

    extra = [tiny_overrides[0]]
    first = demo_run("grpo", tmp_path, name="d", steps=2, quick=True, extra_overrides=extra)
    stamp = (first / "metrics.jsonl").stat().st_mtime_ns
    assert demo_run("grpo", tmp_path, name="d", steps=2, quick=True, extra_overrides=extra) == first
    assert (first / "metrics.jsonl").stat().st_mtime_ns == stamp  # reused as it was
    again = demo_run("grpo", tmp_path, name="d", steps=3, quick=True, extra_overrides=extra)
    assert again == first and len(load_run(again).metrics) == 3  # other settings: made afresh
