"""The notebooks in notebooks/ run top to bottom (nbclient, a real kernel) on real runs and draw
their figures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from tests.conftest import ROOT
from tests.support.ui_runs import make_runs

NOTEBOOKS = ROOT / "notebooks"
# notebook -> (run it reads, figures it must draw)
CASES = {"run_overview": ("absolute_zero", 3), "self_play_curriculum": ("absolute_zero", 3), "calibration": ("rlcr", 4)}


@pytest.fixture(scope="session")
def demo_runs(tmp_path_factory, model_cache, tiny_overrides):
    return make_runs(tmp_path_factory, model_cache)


def _execute(name: str, run_dir) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    param = nb.cells[1]
    assert param.cell_type == "code" and param.source.strip().endswith("RUN_DIR = None"), (
        "the second cell of each notebook sets RUN_DIR (None: a demo run)"
    )
    param.source = f"RUN_DIR = {str(run_dir)!r}"
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def _outputs(nb, kind: str) -> list:
    return [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if kind in o.get("data", {}) or o.get("output_type") == kind
    ]


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
    import inspect

    from asyncrl.analysis.demo_runs import notebook_run

    for name, algorithm in DEMOS.items():
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        assert f"notebook_run('{algorithm}', RUN_DIR)" in nb.cells[2].source, name
        assert nb.cells[1].metadata.get("tags") == ["parameters"], name  # papermill -p RUN_DIR ...
    assert 'return demo_run(algorithm, run_root=PROJECT / "runs")' in inspect.getsource(
        notebook_run
    )  # no quick, no cut


def test_the_run_a_notebook_reads_comes_from_its_cell_the_environment_or_the_project_root(tmp_path, monkeypatch):
    from asyncrl.analysis.demo_runs import PROJECT, RUN_ENV, notebook_run

    run = tmp_path / "r"
    run.mkdir()
    relative = os.path.relpath(run, PROJECT)
    assert notebook_run("grpo", relative) == run.resolve()  # from the project root, not notebooks/
    monkeypatch.setenv(RUN_ENV, str(run))
    assert notebook_run("grpo", None) == run.resolve()
    monkeypatch.setenv(RUN_ENV, "runs/no-such-run")
    assert notebook_run("grpo", relative) == run.resolve()  # the cell wins over the environment
    monkeypatch.setenv(RUN_ENV, "runs/no-such-run")
    with pytest.raises(FileNotFoundError, match=r"ASYNCRL_RUN='runs/no-such-run': no run directory at .*project root"):
        notebook_run("grpo", None)


@pytest.mark.slow
def test_jupyter_nbconvert_executes_a_notebook_on_the_run_named_in_the_environment(demo_runs, tmp_path):
    """Item 9: ``ASYNCRL_RUN=<relative path> jupyter nbconvert --execute`` (what ``make notebook``
    runs), from another directory: the notebook reads that run, the page shows its figures."""
    import subprocess

    from tests.conftest import subprocess_env

    run = demo_runs["absolute_zero"]
    env = {**subprocess_env(), "ASYNCRL_RUN": os.path.relpath(run, ROOT)}
    jupyter = Path(sys.executable).parent / "jupyter"
    res = subprocess.run(
        [
            str(jupyter),
            "nbconvert",
            "--to",
            "html",
            "--execute",
            str(NOTEBOOKS / "run_overview.ipynb"),
            "--output-dir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    page = (tmp_path / "run_overview.html").read_text()
    assert f"{run.resolve()}: algorithm absolute_zero, 3 steps logged" in page, page[-3000:]
    assert page.count("data:image/png;base64") >= 3
    assert "run finished" in page and "silent" not in page  # the actors table speaks the UI's words


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "rlcr"])
def test_default_demos_learn(algorithm, model_cache, tmp_path):
    """The default demo runs show learning, not flat zero curves: GRPO's batch reward and held-out
    accuracy rise; RLCR's held-out ECE and Brier fall, over confidences that were parsed."""
    from asyncrl.analysis import load_run
    from asyncrl.analysis.demo_runs import demo_run

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
    from asyncrl.analysis.demo_runs import demo_run

    extra = [tiny_overrides[0]]
    first = demo_run("grpo", tmp_path, name="d", steps=2, quick=True, extra_overrides=extra)
    stamp = (first / "metrics.jsonl").stat().st_mtime_ns
    assert demo_run("grpo", tmp_path, name="d", steps=2, quick=True, extra_overrides=extra) == first
    assert (first / "metrics.jsonl").stat().st_mtime_ns == stamp  # reused as it was
    again = demo_run("grpo", tmp_path, name="d", steps=3, quick=True, extra_overrides=extra)
    assert again == first and len(load_run(again).metrics) == 3  # other settings: made afresh
