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
         "calibration": ("rlcr", 3)}


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
