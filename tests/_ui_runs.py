"""Helpers shared by the UI, analysis and notebook tests: one Absolute Zero and one RLCR run made once
per session (real ``asyncrl run`` processes on a very small embedded model), a headless Chromium,
and an ``asyncrl ui`` process."""

from __future__ import annotations

import queue
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .conftest import ROOT, cli, kill_tree, subprocess_env

ARTIFACTS = ROOT / "test-artifacts"
_RUNS: dict[str, Path] = {}
_LOCK = threading.Lock()


def make_runs(tmp_path_factory, model_cache: Path) -> dict[str, Path]:
    """``{"absolute_zero": dir, "rlcr": dir}``: 3 steps each, made concurrently once per session,
    with a ``sample`` event every step."""
    from asyncrl.demo import demo_run

    with _LOCK:
        if not _RUNS:
            root = tmp_path_factory.mktemp("ui-runs")
            extra = [f"model.embedded.cache_dir={model_cache}"]
            with ThreadPoolExecutor(2) as ex:
                futures = {alg: ex.submit(demo_run, alg, root, steps=3, extra_overrides=extra, reuse=False, quick=True)
                           for alg in ("absolute_zero", "rlcr")}
                _RUNS.update({alg: f.result() for alg, f in futures.items()})
    return dict(_RUNS)


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("chromium is not installed; the UI test needs a real headless browser: run `make browser` "
                    "(apt-get install chromium) and try again")
    return path


def _browser(args: list[str], profile: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           f"--user-data-dir={profile}", "--virtual-time-budget=8000", "--window-size=1400,1600", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    finally:
        kill_tree(proc)  # chromium's renderer and GPU processes too


def dump_dom(url: str, profile: Path, shot: Path | None = None) -> str:
    """The rendered DOM of ``url``; with ``shot``, a screenshot of the same render is saved there
    (one browser run for both: a second run of a live page may render something else)."""
    res = _browser(["--dump-dom", *([f"--screenshot={shot}"] if shot else []), url], profile)
    assert res.returncode == 0, f"chromium --dump-dom {url} failed: {res.stderr[-2000:]}"
    return res.stdout


def wait_dom(url: str, profile: Path, check, timeout: float = 120, what: str = "",
             screenshot_name: str | None = None) -> str:
    """Dump ``url`` until ``check(dom)`` is true (the page may still be loading data). With
    ``screenshot_name``, the render that passed is also saved as that file in ``test-artifacts/``."""
    deadline = time.time() + timeout
    dom = ""
    shot = None
    if screenshot_name:
        ARTIFACTS.mkdir(exist_ok=True)
        shot = profile.parent / f"{profile.name}-{screenshot_name}"
    slow = 0
    while time.time() < deadline:
        if shot is not None:
            shot.unlink(missing_ok=True)
        try:
            dom = dump_dom(url, profile, shot)
        except subprocess.TimeoutExpired:  # a browser run stuck on a loaded machine: try again, twice
            slow += 1
            if slow == 3:
                raise AssertionError(f"{url}: 3 chromium runs timed out (120 s each)") from None
            deadline = max(deadline, time.time() + 30)
            continue
        if check(dom):
            if shot is not None:
                _keep_screenshot(shot, ARTIFACTS / screenshot_name, url)
            return dom
        time.sleep(1)
    raise AssertionError(f"{url}: {what or 'expected content'} not in the page after {timeout:.0f}s "
                         f"({slow} browser run(s) timed out); text was: {visible_text(dom)[:3000]}")


def _keep_screenshot(shot: Path, out: Path, url: str) -> None:
    assert shot.exists() and shot.stat().st_size > 10_000, f"no screenshot of {url} (or a blank one) at {shot}"
    out.unlink(missing_ok=True)
    shutil.copyfile(shot, out)


def visible_text(dom: str) -> str:
    dom = re.sub(r"<(style|script|svg)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


class LineReader:
    """Collects a process's output lines in a thread; ``wait_for(pattern)`` returns the first match."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with self.proc.stdout:
            for line in self.proc.stdout:
                self._q.put(line)
        self._q.put(None)

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match:
        rx = re.compile(pattern)
        for line in self.lines:
            if m := rx.search(line):
                return m
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self._q.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"the process exited (code {self.proc.wait()}) before printing "
                                     f"/{pattern}/; output:\n{''.join(self.lines)[-4000:]}")
            self.lines.append(line)
            if m := rx.search(line):
                return m
        raise AssertionError(f"no /{pattern}/ after {timeout:.0f}s; output:\n{''.join(self.lines)[-4000:]}")


def start_ui(*args: str) -> tuple[subprocess.Popen, LineReader]:
    return start_logged(cli("ui", "--port", "0", *args))


def start_logged(cmd: list[str]) -> tuple[subprocess.Popen, LineReader]:
    """``cmd`` in its own session (see ``stop``), its output lines collected by a LineReader."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, LineReader(proc)


def ui_url(reader: LineReader) -> str:
    return reader.wait_for(r"asyncrl ui: serving (http://\S+)").group(1)


def stop(proc: subprocess.Popen, sig=None, timeout: float = 60) -> int:
    """Send ``sig`` (SIGTERM) to ``proc`` and wait for it; then kill whatever is left of its tree.
    Fails if it did not stop by itself within ``timeout`` seconds."""
    import signal as _signal

    if proc.poll() is None:
        proc.send_signal(sig or _signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"process {proc.args} did not stop within {timeout}s") from None
    finally:
        kill_tree(proc)
