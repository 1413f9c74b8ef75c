"""``sandbox.isolation: remote`` against a real HTTP server on 127.0.0.1 that implements the
SandboxFusion ``/run_code`` API and runs the code in the local bwrap sandbox: results, failures,
retries with backoff, timeouts against a server that hangs, and the concurrency cap."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from asyncrl.sandbox.python import SandboxLimits, run_python

WAIT_S = 20.0  # generous deadline for conditions on a loaded machine
LINGER_S = 0.5  # how long a gathered request waits for a request beyond the cap


class FusionServer:
    """A SandboxFusion-compatible server. ``fail_first``: answer that many requests with HTTP 503;
    ``hang``: never answer (until the test ends); ``reply``: a fixed reply body instead of running;
    ``gather``: hold each request until that many are in flight (or ``WAIT_S`` passes), then up to
    ``LINGER_S`` longer for one more, so that a client sending more than ``gather`` at once shows."""

    def __init__(
        self, fail_first: int = 0, hang: bool = False, reply: tuple[int, bytes] | None = None, gather: int = 0
    ):
        self.fail_first, self.hang, self.reply, self.gather = fail_first, hang, reply, gather
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.cond = threading.Condition()
        self.release = threading.Event()

    def handle(self, body: dict) -> tuple[int, bytes]:
        with self.cond:
            self.requests.append(body)
            n = len(self.requests)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.cond.notify_all()
            if self.gather:
                self.cond.wait_for(lambda: self.in_flight >= self.gather, timeout=WAIT_S)
                self.cond.wait_for(lambda: self.in_flight > self.gather, timeout=LINGER_S)
        try:
            if self.hang:
                self.release.wait(WAIT_S * 3)
                return 503, b"released"
            if n <= self.fail_first:
                return 503, b"busy"
            if self.reply is not None:
                return self.reply
            return 200, json.dumps(self.execute(body)).encode()
        finally:
            with self.cond:
                self.in_flight -= 1

    @staticmethod
    def execute(body: dict) -> dict:
        assert body["language"] == "python"
        lim = SandboxLimits(timeout_s=body["run_timeout"], memory_mb=body["memory_limit_MB"], determinism_runs=1)
        res = run_python(body["code"], lim, check=False)
        timed_out = not res.ok and res.reason.startswith(("timeout", "cpu time limit: busy"))  # (wall-clock kills)
        run = {
            "status": "TimeLimitExceeded" if timed_out else "Finished",
            "execution_time": res.seconds,
            "return_code": 0 if res.ok else 1,
            "stdout": res.output + "\n" if res.ok else "",
            "stderr": "" if res.ok else f"Traceback (most recent call last):\n{res.reason}\n",
        }
        return {
            "status": "Success" if res.ok else "Failed",
            "message": "",
            "compile_result": None,
            "run_result": run,
            "executor_pod_name": None,
            "files": {},
        }


@contextmanager
def serve(server: FusionServer):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path != "/run_code":
                self.send_error(404)
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, data = server.handle(body)
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up (timeout)
                pass

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        server.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=WAIT_S)


def remote(url: str, **remote_cfg) -> SandboxLimits:
    cfg = {"url": url, "backoff_s": 0.05, **remote_cfg}
    return SandboxLimits(isolation="remote", timeout_s=3.0, remote=cfg)


@pytest.mark.bwrap  # (the OS sandbox: make test-fast leaves it out)
def test_a_program_runs_remotely_with_the_determinism_check():
    server = FusionServer()
    with serve(server) as url:
        res = run_python("def f(xs):\n    return sorted(xs)[::-1]\nprint(repr(f([3, 1, 2])))", remote(url))
        assert res.ok and res.output == "[3, 2, 1]", res
        assert len(server.requests) == 2  # determinism_runs
        body = server.requests[0]
        assert body["run_timeout"] == 3.0 and body["memory_limit_MB"] == 256 and "def f(xs)" in body["code"]
        nondet = run_python("import random\nprint(random.random())", remote(url))
        assert not nondet.ok and "nondeterministic" in nondet.reason


@pytest.mark.bwrap  # (the OS sandbox: make test-fast leaves it out)
def test_remote_failures_come_back_as_reasons(tmp_path):
    target = tmp_path / "pwned"
    with serve(FusionServer()) as url:
        res = run_python(f"open({str(target)!r}, 'w').write('x')", remote(url), check=False)
        assert not res.ok and "FileNotFoundError" in res.reason, res.reason
        assert not target.exists()
        res = run_python("while True:\n    pass", remote(url).model_copy(update={"timeout_s": 1.0}), check=False)
        assert not res.ok and res.reason.startswith("timeout") and "remote" in res.reason, res.reason
        rejected = run_python("import os", remote(url))
        assert rejected.reason.startswith("rejected before running")  # the static check runs locally first


@pytest.mark.bwrap  # (the OS sandbox: make test-fast leaves it out)
def test_a_server_that_fails_once_is_retried():
    server = FusionServer(fail_first=1)
    with serve(server) as url:
        res = run_python("print(41 + 1)", remote(url, max_retries=2).model_copy(update={"determinism_runs": 1}))
    assert res.ok and res.output == "42", res
    assert len(server.requests) == 2


def test_retries_are_bounded_and_client_errors_are_not_retried():
    server = FusionServer(fail_first=100)
    with serve(server) as url:
        res = run_python("print(1)", remote(url, max_retries=2).model_copy(update={"determinism_runs": 1}))
    assert not res.ok and "HTTP 503" in res.reason and "after 3 attempts" in res.reason, res.reason
    assert len(server.requests) == 3
    bad = FusionServer(reply=(400, b'{"detail": "bad request"}'))
    with serve(bad) as url:
        res = run_python("print(1)", remote(url, max_retries=2).model_copy(update={"determinism_runs": 1}))
    assert not res.ok and "HTTP 400" in res.reason and len(bad.requests) == 1


@pytest.mark.parametrize(
    "reply,reason",
    [
        ((200, b"not json"), "reply is not JSON"),
        ((200, b'{"status": "SandboxError", "message": "executor crashed"}'), "remote sandbox error: executor crashed"),
        ((200, b'{"status": "Success", "message": ""}'), "has no run_result"),
        ((200, b'{"hello": 1}'), "not a SandboxFusion run_code response"),
    ],
)
def test_malformed_replies_are_reasons(reply, reason):
    with serve(FusionServer(reply=reply)) as url:
        res = run_python("print(1)", remote(url, max_retries=0))
    assert not res.ok and reason in res.reason, res.reason


def test_an_unreachable_server_is_a_reason():
    with serve(FusionServer()) as url:
        pass  # the port is closed again
    res = run_python("print(1)", remote(url, max_retries=1))
    assert not res.ok and "unreachable" in res.reason and "after 2 attempts" in res.reason, res.reason


def test_a_hanging_server_times_out():
    server = FusionServer(hang=True)
    with serve(server) as url:
        lim = remote(url, max_retries=1, request_timeout_s=0.5).model_copy(update={"timeout_s": 0.5})
        t0 = time.monotonic()
        res = run_python("print(1)", lim)
        elapsed = time.monotonic() - t0
        assert not res.ok and "no answer within 1 s" in res.reason and "after 2 attempts" in res.reason, res.reason
        assert len(server.requests) == 2
    assert elapsed < WAIT_S


@pytest.mark.bwrap  # (the OS sandbox: make test-fast leaves it out)
def test_concurrency_is_capped():
    server = FusionServer(gather=2)  # requests are held in pairs, and a third one would be seen
    with serve(server) as url:
        lim = remote(url, max_concurrency=2).model_copy(update={"determinism_runs": 1})
        with ThreadPoolExecutor(max_workers=6) as pool:
            results = list(pool.map(lambda i: run_python(f"print({i})", lim), range(6)))
    assert [r.output for r in results] == [str(i) for i in range(6)], [r.reason for r in results]
    assert server.max_in_flight == 2


def test_remote_isolation_needs_a_url():
    with pytest.raises(ValueError, match="isolation 'remote' needs remote.url"):
        SandboxLimits(isolation="remote")
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        SandboxLimits(isolation="remote", remote={"url": "sandbox:8080"})
