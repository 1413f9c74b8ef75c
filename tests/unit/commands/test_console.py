"""Issue 29, the terminal side: a closed output pipe never stops training, Ctrl-C checkpoints and
says how to resume (item 3)."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.rundir import layout
from tests.conftest import ROOT, cli, kill_tree, read_jsonl, subprocess_env


def _run_args(tmp_path, tiny_overrides, *extra: str) -> list[str]:
    return cli(
        "run",
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=tee",
        "train.total_steps=100000",
        "train.batch_tasks=2",
        "actor.tasks_per_batch=2",
        "sampling.n=2",
        "eval.size=4",
        "eval.every=0",
        "checkpoint.every=0",
        "log.progress=true",
        *extra,
    )


def _read_until(proc: subprocess.Popen, pattern: str, timeout: float = 240) -> str:
    """Read ``proc``'s output (a pipe) until ``pattern`` matches; returns what was read."""
    out, deadline, fd = "", time.time() + timeout, proc.stdout.fileno()
    poller = select.poll()  # (not select: a worker that ran the endpoint tests may hold descriptors past 1,023)
    poller.register(fd, select.POLLIN | select.POLLHUP)
    while time.time() < deadline:
        if re.search(pattern, out):
            return out
        if poller.poll(500):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out += chunk.decode(errors="replace")
    raise AssertionError(f"/{pattern}/ not in the output (exit code {proc.poll()}):\n{out[-3000:]}")


def _steps(run_dir) -> int:
    return len(read_jsonl(run_dir / "metrics.jsonl"))


def _wait_steps(run_dir, n: int, proc: subprocess.Popen, timeout: float = 240) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (k := _steps(run_dir)) >= n:
            return k
        assert proc.poll() is None, f"the run exited ({proc.returncode}) at {k} steps"
        time.sleep(0.3)
    raise AssertionError(f"fewer than {n} steps after {timeout:.0f}s")


@pytest.mark.slow
def test_a_closed_output_pipe_never_stops_training_and_ctrl_c_checkpoints_and_says_how_to_resume(
    tmp_path, tiny_overrides
):
    """``asyncrl run ... | tee log``, then Ctrl-C: tee goes first, so the learner's next progress
    line meets a closed pipe. Training goes on; Ctrl-C (SIGINT to the whole process group, as a
    terminal sends it) checkpoints at the step reached; a resumed run's Ctrl-C prints the checkpoint
    and the command that resumes."""
    run_dir = tmp_path / "tee"
    proc = subprocess.Popen(
        _run_args(tmp_path, tiny_overrides),
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _read_until(proc, r"\[asyncrl\] learner at ")
        _wait_steps(run_dir, 2, proc)
        proc.stdout.close()  # the reader (tee) is gone: every later write to the pipe fails with EPIPE
        closed_at = _steps(run_dir)
        _wait_steps(run_dir, closed_at + 4, proc)  # progress lines (every 0.5 s) met the closed pipe meanwhile
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=180)
    finally:
        kill_tree(proc)
    stops = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "learner_stop"]
    assert len(stops) == 1 and stops[0]["interrupted"], stops
    reason = stops[0]["reason"]
    assert reason.startswith("stopped by a stop signal at step") and "pipe" not in reason.lower(), reason
    reached = stops[0]["step"]
    assert reached >= closed_at + 4
    ckpt = layout.latest_checkpoint(run_dir)
    assert ckpt is not None and layout.checkpoint_step(ckpt) == reached  # nothing trained was lost

    proc = subprocess.Popen(
        _run_args(tmp_path, tiny_overrides, "--resume"),
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out = _read_until(proc, rf"\[learner\] resumed from step {reached}\b")
        _wait_steps(run_dir, reached + 2, proc)
        os.killpg(proc.pid, signal.SIGINT)
        out += _read_until(proc, r"Resume with:\n.*\n", timeout=180)
        proc.wait(timeout=60)
    finally:
        kill_tree(proc)
    ckpt = layout.latest_checkpoint(run_dir)
    m = re.search(
        r"\[asyncrl\] stopped; checkpoint at step (\d+) in (\S+)\. Resume with:\n  \S+ -m asyncrl (.*) --resume\n", out
    )  # (started here as `python -m asyncrl`: the hint says so)
    assert m, out[-3000:]
    assert int(m.group(1)) == layout.checkpoint_step(ckpt) > reached and m.group(2) == str(ckpt)
    assert m.group(3).startswith("run -c ") and "name=tee" in m.group(3) and "--resume --resume" not in out


def test_a_library_warning_repeated_a_thousand_times_is_shown_once(tmp_path):
    """Item 5: the hook asyncrl learn/serve/init-model install (asyncrl.lifecycle.warn_once_per_message),
    in a real process: a warning raised from many places with the same text, and transformers'
    own logger repeating a line, each appear once; distinct ones still all appear."""
    code = """
import logging, warnings
from asyncrl.lifecycle import warn_once_per_message
warn_once_per_message()
from transformers.utils import logging as hf_logging
log = hf_logging.get_logger("transformers.generation.utils")
for i in range(1000):
    exec("warnings.warn('past_key_values as a tuple is deprecated', FutureWarning)",
         {"warnings": warnings})  # a module of its own each time: Python's per-location registry repeats it
    log.warning("the same library log line")
for i in range(3):
    warnings.warn(f"distinct warning {i}", UserWarning)
    log.warning(f"distinct log line {i}")
"""
    res = subprocess.run(
        [os.sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=subprocess_env(), cwd=ROOT
    )
    assert res.returncode == 0, res.stderr[-2000:]
    err = res.stderr
    assert err.count("past_key_values as a tuple is deprecated") == 1, err[-2000:]
    assert err.count("the same library log line") == 1, err[-2000:]
    assert all(err.count(f"distinct warning {i}") == 1 and err.count(f"distinct log line {i}") == 1 for i in range(3))


def _cli_out(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout, env=subprocess_env(), cwd=ROOT)


def test_asyncrl_config_prints_every_key_with_its_description_and_the_diff(tmp_path):
    """Item 8: ``asyncrl config`` is the resolved config as YAML that loads back to the same config,
    every key with its description (the algorithm's own section too); ``--diff`` lists only what
    differs from the defaults; ``run --help`` says where the keys are."""
    import yaml

    from asyncrl.algos.rlcr.config import RLCRConfig
    from asyncrl.config import load_config, validate_section

    rlcr = str(ROOT / "configs" / "rlcr.yaml")
    res = _cli_out("config", "-c", rlcr, "train.lr=1e-4", "algo.lambda_conf=0.5")
    assert res.returncode == 0, res.stderr
    printed = yaml.safe_load(res.stdout)
    (tmp_path / "again.yaml").write_text(res.stdout)
    want, again = load_config(rlcr, ["train.lr=1e-4", "algo.lambda_conf=0.5"]), load_config(tmp_path / "again.yaml")
    assert again.model_dump(exclude={"algo"}) == want.model_dump(exclude={"algo"})
    assert validate_section(RLCRConfig, again.algo, "algo") == validate_section(RLCRConfig, want.algo, "algo")
    assert printed["train"]["lr"] == 1e-4 and printed["algo"]["lambda_conf"] == 0.5
    assert set(printed["algo"]) == set(RLCRConfig.model_fields)  # every key of the algorithm's own section
    lines = res.stdout.splitlines()
    assert "  lr: 0.0001  # AdamW learning rate (the peak, with a schedule)." in lines
    no_desc = [ln for ln in lines if "  # " not in ln and not ln.strip().startswith("- ")]
    assert not no_desc, no_desc[:5]  # every key says what it does

    diff = _cli_out("config", "-c", rlcr, "train.lr=1e-4", "--diff").stdout.splitlines()
    assert "train.lr: 0.0001  # default 2.0e-05. AdamW learning rate (the peak, with a schedule)." in diff
    assert all(re.match(r"[\w.]+: .*  # default ", ln) for ln in diff) and not any(
        ln.startswith("seed:") for ln in diff
    )
    assert _cli_out("config", "--diff").stdout.strip() == "# every key has its default value"
    assert "asyncrl config -c FILE" in _cli_out("run", "--help").stdout


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_the_diff_of_every_shipped_config_prints(config):
    """Issue 42.7: the UI's Config tab leads with ``--diff``; Absolute Zero's learnability dimensions
    (models inside a dict) made it fail with yaml's RepresenterError."""
    from asyncrl.analysis.config_view import show_config
    from asyncrl.config import load_config

    diff = show_config(load_config(ROOT / "configs" / config), diff=True).splitlines()
    assert diff and all(re.match(r"[\w.]+: .*  # default ", ln) for ln in diff), diff


def test_a_mistyped_key_suggests_the_nearest_and_nothing_starts(tmp_path):
    res = _cli_out("run", "-c", str(ROOT / "configs" / "quickstart.yaml"), f"run_root={tmp_path}", "train.lrr=1e-5")
    assert res.returncode == 2
    assert "unknown key 'train.lrr' (did you mean 'train.lr'?)" in res.stderr, res.stderr
    res = _cli_out("run", "-c", str(ROOT / "configs" / "rlcr.yaml"), f"run_root={tmp_path}", "algo.lamda_conf=1")
    assert res.returncode == 2 and "(did you mean 'algo.lambda_conf'?)" in res.stderr, res.stderr
    assert not any(tmp_path.iterdir())  # no run directory was made


def test_empty_prompts_in_a_task_file_are_reported_with_file_and_line(tmp_path, capsys):
    from asyncrl.config import load_config
    from asyncrl.envs.tasks import load_task_file

    path = tmp_path / "tasks.jsonl"
    path.write_text(
        '{"prompt": "1+1=", "answer": 2}\n{"prompt": "  ", "answer": 3}\n'
        '{"prompt": [{"role": "user", "content": ""}], "answer": 4}\n'
    )
    cfg = load_config(None, ["tasks.type=file", f"tasks.path={path}"])
    assert len(load_task_file(str(path), cfg.tasks)) == 3  # kept (a template-only prompt may be meant)
    err = capsys.readouterr().err
    assert f"2 empty prompt(s) in {path}" in err and f"{path}:2, {path}:3" in err


def test_a_refused_run_prints_the_refusal_and_nothing_before_it(tmp_path):
    """Item 10: no "held-out: ..." line before a refusal (a reused run name)."""
    run = tmp_path / "taken"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "t": 1.0}\n')
    (run / "config.yaml").write_text("name: taken\n")
    res = _cli_out("run", "-c", str(ROOT / "configs" / "quickstart.yaml"), f"run_root={tmp_path}", "name=taken")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "held-out" not in res.stdout and "--resume" in res.stderr + res.stdout, res.stdout + res.stderr


def test_the_resume_hint_of_an_overwritten_run_resumes_it(monkeypatch):
    """`asyncrl run ... --overwrite`, stopped: the hint is the same command with --resume, not beside
    --overwrite (which argparse refuses with --resume, and which would delete the run it resumes)."""
    from asyncrl.schedulers.local import resume_command

    monkeypatch.setattr(sys, "argv", ["asyncrl", "run", "-c", "examples/smollm2.yaml", "--overwrite", "name=x y"])
    assert resume_command() == "asyncrl run -c examples/smollm2.yaml 'name=x y' --resume"


def test_printed_commands_are_the_ones_the_user_typed(monkeypatch, tmp_path):
    """64.4: the resume hint and the dry run's start line said a bare ``asyncrl``, "command not found"
    after ``make demo`` (which does not activate .venv): they now say it as it was invoked."""
    from asyncrl.schedulers.local import this_command

    script = tmp_path / ".venv" / "bin" / "asyncrl"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # (.venv not activated)
    monkeypatch.setattr(sys, "argv", [str(script), "run", "-c", "x.yaml"])
    assert this_command() == ".venv/bin/asyncrl run -c x.yaml"
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")  # activated: the PATH finds it
    assert this_command() == "asyncrl run -c x.yaml"
    monkeypatch.setattr(sys, "argv", ["/somewhere/asyncrl/__main__.py", "run", "-c", "x.yaml"])
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    assert this_command() == ".venv/bin/python -m asyncrl run -c x.yaml"
