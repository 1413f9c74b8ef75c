"""Choosing the sandbox's isolation: an Absolute Zero run with a code-executing domain refuses to
start where bwrap does not work (with how to install it), unless ``sandbox.isolation: none`` is set
explicitly, which is then warned about on every start: printed, logged as a ``warning`` event and
shown by the UI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from asyncrl.config import ConfigError, config_from_dict, load_config
from tests.conftest import ROOT, read_jsonl

pytestmark = pytest.mark.bwrap  # (make test-fast leaves these out)

# Runs in a process whose PATH holds no bwrap: what a machine without bubblewrap sees.
WITHOUT_BWRAP = r"""
import json
from asyncrl.rollout import get_workflow
from asyncrl.config import ConfigError, config_from_dict
from asyncrl.sandbox.python import SandboxLimits, isolation_problem, run_python
out = {"problem": isolation_problem(SandboxLimits()),
       "run": run_python("print(1)").reason,
       "none_ok": run_python("print(1)", SandboxLimits(isolation="none")).output}
for domain, isolation in (("code_o", "bwrap"), ("code_o", "none"), ("arithmetic", "bwrap")):
    cfg = config_from_dict({"algorithm": "absolute_zero", "algo": {"domain": domain, "sandbox": {"isolation": isolation}}})
    try:
        out[f"{domain}/{isolation}"] = get_workflow("absolute_zero", cfg).warnings
    except ConfigError as e:
        out[f"{domain}/{isolation}"] = str(e)
print(json.dumps(out))
"""


def _workflow(**algo):
    from asyncrl.rollout import get_workflow

    return get_workflow("absolute_zero", config_from_dict({"algorithm": "absolute_zero", "algo": algo}))


def test_without_bwrap_a_code_run_refuses_to_start_and_says_how_to_install_it(tmp_path):
    env = {"PATH": str(tmp_path), "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}  # an empty PATH dir
    res = subprocess.run(
        [sys.executable, "-c", WITHOUT_BWRAP], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert "bwrap is not installed" in out["problem"] and "apt-get install bubblewrap" in out["problem"]
    assert "sandbox unavailable" in out["run"] and "apt-get install bubblewrap" in out["run"]
    assert out["none_ok"] == "1"  # explicit isolation: none still runs
    refused = out["code_o/bwrap"]
    assert isinstance(refused, str) and "algo" in refused and "apt-get install bubblewrap" in refused
    assert "sandbox.isolation: none" in refused  # the way out is named
    assert out["code_o/none"] and "isolation is 'none'" in out["code_o/none"][0]
    assert out["arithmetic/bwrap"] == []  # no code runs: bwrap is not needed
    assert "WARNING: sandbox.isolation is 'none'" in res.stderr  # printed on start


def test_isolation_none_is_warned_about_and_bwrap_is_not(capsys):
    assert _workflow(domain="code_o").warnings == []
    assert _workflow(domain="arithmetic", sandbox={"isolation": "none"}).warnings == []
    wf = _workflow(domain="code_o", sandbox={"isolation": "none"})
    assert len(wf.warnings) == 1 and "no" in wf.warnings[0].lower() and "bwrap" in wf.warnings[0]
    assert f"[asyncrl] WARNING: {wf.warnings[0]}" in capsys.readouterr().err


def test_unknown_isolation_is_a_config_error():
    with pytest.raises(ConfigError, match="algo.sandbox.isolation"):
        _workflow(domain="code_o", sandbox={"isolation": "docker"})


def test_the_learner_logs_the_warning_and_the_ui_shows_it(tmp_path, tiny_overrides):
    from asyncrl.analysis import RunStore
    from asyncrl.app.views import overview_html
    from asyncrl.learner.learner import Learner

    cfg = load_config(
        str(ROOT / "configs" / "absolute_zero.yaml"),
        [
            *tiny_overrides,
            "model.embedded.warmstart_formats=[arithmetic]",
            f"run_root={tmp_path}",
            "name=none",
            "eval.size=4",
            "eval.every=0",
            "log.progress=false",
            "algo.domain=code_o",
            "algo.sandbox.isolation=none",
        ],
    )
    learner = Learner(cfg)  # the warning is logged while it starts
    learner.net.close()
    learner.log.close()
    warnings = [e for e in read_jsonl(tmp_path / "none" / "events.jsonl") if e["kind"] == "warning"]
    assert len(warnings) == 1 and "isolation is 'none'" in warnings[0]["message"]
    assert warnings[0]["source"] == "absolute_zero"
    store = RunStore()
    store.add_events(read_jsonl(tmp_path / "none" / "events.jsonl"))
    assert "Warning: sandbox.isolation is &#x27;none&#x27;" in overview_html(store)


def test_bwrap_probe_result_is_reused():
    from asyncrl.sandbox import bwrap
    from asyncrl.sandbox.python import ALLOWED_IMPORTS

    first = bwrap.probe(ALLOWED_IMPORTS)
    assert bwrap.probe(ALLOWED_IMPORTS) is first  # probed once per process
    assert os.path.isabs(first.bwrap) or first.reason
