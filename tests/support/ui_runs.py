"""Helpers shared by the UI, analysis and notebook tests: one Absolute Zero and one RLCR run made once
per session (real ``asyncrl run`` processes on a very small embedded model), a headless Chromium,
and an ``asyncrl ui`` process."""

from __future__ import annotations

import base64
import contextlib
import json
import queue
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli, kill_tree, subprocess_env

ARTIFACTS = ROOT / "test-artifacts"
_RUNS: dict[str, Path] = {}
_LOCK = threading.Lock()


def make_runs(tmp_path_factory, model_cache: Path) -> dict[str, Path]:
    """``{"absolute_zero": dir, "rlcr": dir}``: 3 steps each, made concurrently once per session,
    with a ``sample`` event every step."""
    from asyncrl.analysis.demo_runs import demo_run

    with _LOCK:
        if not _RUNS:
            root = tmp_path_factory.mktemp("ui-runs")
            extra = [f"model.embedded.cache_dir={model_cache}"]
            with ThreadPoolExecutor(2) as ex:
                futures = {
                    alg: ex.submit(demo_run, alg, root, steps=3, extra_overrides=extra, reuse=False, quick=True)
                    for alg in ("absolute_zero", "rlcr")
                }
                _RUNS.update({alg: f.result() for alg, f in futures.items()})
    return dict(_RUNS)


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail(
            "chromium is not installed; the UI test needs a real headless browser: run `make browser` "
            "(apt-get install chromium) and try again"
        )
    return path


class Browser:
    """A headless Chromium driven over the DevTools protocol (a websocket on loopback): the page is
    loaded once and its live DOM read as often as needed. (``--dump-dom`` with a virtual time budget
    never returns on a page that keeps a server-sent event stream open, as Gradio's timers do.)"""

    def __init__(self, profile: Path, timeout: float = 120):
        profile.mkdir(parents=True, exist_ok=True)
        (profile / "DevToolsActivePort").unlink(missing_ok=True)
        cmd = [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--window-size=1400,1600",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self._id = 0
        try:
            port_file = profile / "DevToolsActivePort"
            deadline = time.time() + timeout
            while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
                if self.proc.poll() is not None:
                    raise AssertionError(f"chromium exited ({self.proc.returncode}): {self.proc.stderr.read()[-2000:]}")
                if time.time() > deadline:
                    raise AssertionError(f"chromium did not open its DevTools port in {timeout:.0f}s")
                time.sleep(0.2)
            port = int(port_file.read_text().splitlines()[0])
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout) as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            from websockets.sync.client import connect

            self._stack = contextlib.ExitStack()
            self.ws = self._stack.enter_context(
                connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=timeout)
            )
        except BaseException:
            kill_tree(self.proc)
            raise

    def call(self, method: str, timeout: float = 60, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.time() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.time())))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise AssertionError(f"chromium {method}: {msg['error']}")
                return msg["result"]

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=with_token(url))

    def js(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-able)."""
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise AssertionError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def dom(self) -> str:
        return self.js("document.documentElement ? document.documentElement.outerHTML : ''") or ""

    def mouse(self, kind: str, x: float, y: float, clicks: int = 0) -> None:
        """A real input event (``mouseMoved``, ``mousePressed``, ``mouseReleased``) at page coordinates."""
        self.call(
            "Input.dispatchMouseEvent",
            type=kind,
            x=x,
            y=y,
            button="none" if kind == "mouseMoved" else "left",
            clickCount=clicks,
        )

    def screenshot(self, out: Path) -> None:
        out.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            kill_tree(self.proc)  # chromium's renderer and GPU processes too


@contextlib.contextmanager
def ui_in_browser(run: Path, profile: Path, query: str = ""):
    """``asyncrl ui --run RUN`` and a headless Chromium on ``<its url>QUERY``; yields the browser.
    Both are stopped afterwards, and the UI must have exited cleanly (code 0)."""
    proc, reader = start_ui("--run", str(run))
    browser = None
    try:
        browser = Browser(profile)
        browser.goto(ui_url(reader) + query)
        yield browser
    finally:
        if browser is not None:
            browser.close()
        code = stop(proc)
    assert code == 0, f"asyncrl ui exited with code {code}"


def wait_dom(
    url: str, profile: Path, check, timeout: float = 120, what: str = "", screenshot_name: str | None = None
) -> str:
    """Open ``url`` in headless Chromium and read its DOM until ``check(dom)`` is true (the page may
    still be loading data). With ``screenshot_name``, the page as it was when the check passed is
    also saved as that file in ``test-artifacts/``."""
    browser = Browser(profile)
    try:
        browser.goto(url)
        return wait_page(browser, check, timeout, f"{url}: {what}", screenshot_name)
    finally:
        browser.close()


def wait_page(browser: Browser, check, timeout: float = 120, what: str = "", screenshot_name: str | None = None) -> str:
    """Read the open page's DOM until ``check(dom)`` is true; see :func:`wait_dom`."""
    deadline = time.time() + timeout
    dom = ""
    while time.time() < deadline:
        try:
            dom = browser.dom()
        except TimeoutError:  # a renderer busy on a loaded machine: ask again
            continue
        if check(dom):
            if screenshot_name:
                screenshot(browser, screenshot_name)
            return dom
        time.sleep(1)
    raise AssertionError(
        f"{what or 'expected content'} not in the page after {timeout:.0f}s; text was: {visible_text(dom)[:3000]}"
    )


def screenshot(browser: Browser, name: str) -> None:
    """The page as it is now, kept as ``test-artifacts/<name>``."""
    ARTIFACTS.mkdir(exist_ok=True)
    out = ARTIFACTS / name
    out.unlink(missing_ok=True)
    browser.screenshot(out)
    assert out.stat().st_size > 10_000, f"a blank screenshot {out}"


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
                raise AssertionError(
                    f"the process exited (code {self.proc.wait()}) before printing "
                    f"/{pattern}/; output:\n{''.join(self.lines)[-4000:]}"
                )
            self.lines.append(line)
            if m := rx.search(line):
                return m
        raise AssertionError(f"no /{pattern}/ after {timeout:.0f}s; output:\n{''.join(self.lines)[-4000:]}")


def start_ui(*args: str) -> tuple[subprocess.Popen, LineReader]:
    return start_logged(cli("ui", "--port", "0", *args))


def start_logged(cmd: list[str]) -> tuple[subprocess.Popen, LineReader]:
    """``cmd`` in its own session (see ``stop``), its output lines collected by a LineReader."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=subprocess_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, LineReader(proc)


TOKENS: dict[str, str] = {}  # a UI's base URL -> the token it printed (app/token_gate.py)


def split_token(url: str) -> str:
    """``url`` without its ``?token=...``; the token is remembered for :func:`with_token`."""
    base, _, token = url.partition("?token=")
    if token:
        TOKENS[base] = token
    return base


def with_token(url: str) -> str:
    """``url`` with its UI's token added (when one was printed), as a browser that opened the printed
    URL would hold it (in its cookie)."""
    m = re.match(r"https?://[^/]+/", url)
    token = TOKENS.get(m.group(0)) if m else None
    if token is None or "token=" in url:
        return url
    return f"{url}{'&' if '?' in url else '?'}token={token}"


def ui_url(reader: LineReader) -> str:
    """The base URL a UI printed (its token kept for :func:`with_token`)."""
    return split_token(reader.wait_for(r"asyncrl ui: serving (http://\S+)").group(1))


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
