"""Model-chosen tool calls of a verifiers toolset run in the bubblewrap sandbox, never in the actor
(issue 41.5): another uid, another PID namespace, no network, none of the caller's files; a hung tool
is killed and the next call works; a toolset whose runtime asyncrl cannot honour is refused in one line."""

from __future__ import annotations

import os
import time

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.envs.base import make_env
from asyncrl.sandbox.bwrap import SANDBOX_ID, unavailable
from tests.conftest import alive, descendants

pytest.importorskip("verifiers.v1", reason="the envs extra (pip install -e '.[envs]') is not installed")
pytestmark = [
    pytest.mark.bwrap,  # (make test-fast leaves these out)
    pytest.mark.skipif(unavailable() is not None, reason=f"bwrap does not work here: {unavailable()}"),
]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _env(taskset: str):
    return make_env(
        load_config(
            None, ["env.type=verifiers", f"env.kwargs.taskset=asyncrl.testing.verifiers_tasksets:{taskset}"]
        ).env
    )


@pytest.fixture(scope="module")
def probe():
    env = _env("ProbeTaskset")
    vtask = next(iter(env.taskset))
    specs, sandbox = env.tools(vtask)
    yield specs, sandbox
    sandbox.close()


def test_tools_are_offered_and_called_in_the_sandbox(probe, tmp_path):
    specs, sandbox = probe
    assert {s["function"]["name"] for s in specs} == {"whoami", "read", "dial", "nap"}
    uid, pid = sandbox.call("whoami", "{}").split()
    assert int(uid) == SANDBOX_ID and int(uid) != os.getuid()
    assert int(pid) < 100  # a PID namespace of its own (the actor's pid is far higher on a busy machine)
    secret = tmp_path / "secret.txt"  # a file of the caller's: not in the sandbox's filesystem at all
    secret.write_text("the caller's secret")
    got = sandbox.call("read", f'{{"path": "{secret}"}}')
    assert got.startswith("error: FileNotFoundError") and "secret" not in got.split(":", 2)[-1].replace(str(secret), "")
    home = sandbox.call("read", '{"path": "/root/.bashrc"}')
    assert home.startswith("error:"), home


def test_the_sandbox_answers_in_a_process_holding_over_a_thousand_descriptors():
    """CI: after the endpoint tests (a thousand agents' connections) the tools' pipes were numbered
    past 1,023, and every call failed with "filedescriptor out of range in select()"."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1200, hard), hard))
    held, sandbox = [], None
    try:
        with open(os.devnull, "rb") as null:
            held = [os.dup(null.fileno()) for _ in range(1100)]
        env = _env("ProbeTaskset")
        _, sandbox = env.tools(next(iter(env.taskset)))
        uid, _ = sandbox.call("whoami", "{}").split()
        assert int(uid) == SANDBOX_ID
        assert sandbox._proc.stdout.fileno() > 1023  # (its pipes were numbered past select's range)
    finally:
        if sandbox is not None:
            sandbox.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_tool_cannot_reach_the_network(probe, listener):
    specs, sandbox = probe
    port, received = listener
    got = sandbox.call("dial", f'{{"port": {port}}}')
    assert got.startswith("error:") and not received, (got, received)


def test_bad_calls_are_answers_and_a_hung_tool_is_killed():
    env = _env("ProbeTaskset")
    _, sandbox = env.tools(next(iter(env.taskset)))
    sandbox.timeout_s = 1.0
    try:
        assert sandbox.call("nope", "{}").startswith("error: no tool 'nope'")
        assert sandbox.call("read", "[1, 2]") == "error: ValueError: arguments must be a JSON object"
        assert sandbox.call("read", "{not json").startswith("error: JSONDecodeError")
        starts = sandbox.starts
        before = {sandbox._proc.pid} | descendants(sandbox._proc.pid)  # bwrap and the sandbox's processes
        assert any(b"/sandbox/prog.py" in _cmdline(p) for p in before)
        assert sandbox.call("nap", '{"seconds": 120}') == "error: the tool 'nap' did not answer within 1 s"
        deadline = time.time() + 30  # the hung worker, and everything in its sandbox, is gone
        while time.time() < deadline and alive(before):
            time.sleep(0.1)
        assert not alive(before)
        assert sandbox.call("whoami", "{}").split()[0] == str(SANDBOX_ID)  # a fresh worker
        assert sandbox.starts == starts + 1
    finally:
        sandbox.close()


@pytest.mark.parametrize("taskset, words", [("DockerTaskset", "runtime 'docker'"), ("ServerTaskset", "config.url")])
def test_a_toolset_that_cannot_be_sandboxed_is_refused_in_one_line(taskset, words):
    with pytest.raises(ConfigError) as e:
        _env(taskset)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_taskset_under_the_hosts_tmp_is_seen_in_the_sandbox(tmp_path, monkeypatch):
    """The sandbox's /tmp is its own: a package (or a virtual environment) under the host's /tmp, as
    in a fresh clone in a temp dir, is bound over it, not hidden by it."""
    pkg = tmp_path / "tmp_tasks_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(
        "import verifiers.v1 as vf\n"
        "class Echo(vf.Toolset[vf.ToolsetConfig]):\n"
        "    @vf.tool\n"
        "    def echo(self, text: str) -> str:\n"
        "        '''Echo.'''\n"
        "        return text[::-1]\n"
        "class EchoTask(vf.Task[vf.TaskData]):\n"
        "    @classmethod\n"
        "    def toolsets(cls, config):\n"
        "        return [Echo(vf.ToolsetConfig())]\n"
    )
    assert str(tmp_path).startswith("/tmp/")
    monkeypatch.syspath_prepend(str(tmp_path))
    from tmp_tasks_pkg.mod import EchoTask
    from verifiers.v1.configs.task import TaskConfig

    from asyncrl.sandbox.tools import ToolSandbox

    sandbox = ToolSandbox(EchoTask, TaskConfig())
    try:
        assert sandbox.call("echo", '{"text": "abc"}') == "cba"
    finally:
        sandbox.close()
