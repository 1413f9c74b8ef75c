"""Hostile programs against the default sandbox (``isolation: bwrap``), issue 18's cases and more.

Every case runs in a sacrificial *caller* process (the role of an actor): a secret in its
environment, its own working directory (with a sentinel file) and its own TMPDIR. Each case checks
that the harmful effect did not happen (the file does not exist, the listener got no bytes, the
secret is not in the output, the caller is alive and still answers), that a failed run says why in
one line, that no process is left (the programs put a marker in their children's command lines)
and that no file is left (the caller's TMPDIR stays empty). Each case runs with the static check
on (the default: it must reject the program) and off (``check=False``: the OS boundary alone must
hold). The programs start with the escapes that undid the old sandbox: ``from random import _os``,
``operator.attrgetter('__import__')`` and deleting the ``None`` entries of ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncrl.sandbox.python import SandboxLimits

pytestmark = pytest.mark.bwrap  # (make test-fast leaves these out)


ROOT = Path(__file__).resolve().parents[3]  # tests/unit/<layer>/<this file>
SECRET_VAR = "ASYNCRL_HOSTILE_SECRET"
LEFTOVER_DEADLINE_S = 10.0  # the kernel reaps a dead PID namespace at once; this is slack for load
SLEEP_S = 300  # how long a hostile child would live if it escaped

ESCAPE = """from operator import attrgetter
from random import _os
_sys = _os.sys
for _k in [k for k, v in _sys.modules.items() if v is None]:
    del _sys.modules[_k]
_imp = attrgetter('__import__')(_sys.modules['builtins'])
_open = attrgetter('open')(_sys.modules['builtins'])
_util = _imp('importlib.util', None, None, ['find_spec'])
_posix = _util.module_from_spec(_util.find_spec('posix'))  # a fresh posix: fork, kill, exec restored
"""
# A child that would outlive the call: fork, setsid, exec a sleeper with a marker in its command line.
SPAWN = (
    "if _posix.fork() == 0:\n    _posix.setsid()\n"
    "    _posix.execv(_sys.executable, [_sys.executable, '-I', '-c', 'import time; time.sleep({sleep}) # {marker}'])\n"
)

# The caller: reads one JSON request per line, answers with run_python's result.
CALLER = r"""
import json, sys
from asyncrl.sandbox.python import SandboxLimits, run_python
for line in sys.stdin:
    req = json.loads(line)
    res = run_python(req["code"], SandboxLimits(**req["limits"]), check=req["check"])
    print(json.dumps({"ok": res.ok, "output": res.output, "reason": res.reason}), flush=True)
"""


@dataclass
class Env:
    """What a case's program text and effect check may refer to."""

    marker: str
    work: Path  # the test's own directory (outside the caller's reach)
    cwd: Path  # the caller's working directory (its 'run directory')
    tmpdir: Path  # the caller's TMPDIR
    home: Path
    secret: str
    caller_pid: int
    port: int
    received: list[bytes]

    def fill(self, template: str) -> str:
        return template.format(
            marker=self.marker,
            work=self.work,
            cwd=self.cwd,
            home=self.home,
            caller_pid=self.caller_pid,
            port=self.port,
            sleep=SLEEP_S,
        )


@dataclass
class Case:
    name: str
    program: str  # after ESCAPE; str.format fields from Env.fill
    happened: Callable[[Env, dict], bool]  # did the harmful effect happen?


def _file(template: str) -> Callable[[Env, dict], bool]:
    return lambda env, res: Path(env.fill(template)).exists()


def _printed(what: Callable[[Env], str]) -> Callable[[Env, dict], bool]:
    return lambda env, res: what(env) in res["output"]


def _caller_dead(env: Env, res: dict) -> bool:
    return res.get("caller_died", False)


CASES = [
    Case(
        "names from 'from' imports: random._os lists the caller's cwd",
        "print(_os.listdir('{cwd}'))",
        _printed(lambda env: "sentinel.txt"),
    ),
    Case(
        "attrgetter('__builtins__') reaches open: /etc/passwd",
        "def g():\n    pass\nprint(attrgetter('__builtins__')(g)['open']('/etc/passwd').read())",
        _printed(lambda env: "root:"),
    ),
    Case("read /etc/passwd", "print(_open('/etc/passwd').read())", _printed(lambda env: "root:")),
    Case(
        "ctypes system()",
        "_imp('ctypes').CDLL(None).system(b'echo pwned > {work}/system')\nprint(1)",
        _file("{work}/system"),
    ),
    Case(
        "subprocess.Popen /bin/sh",
        "_imp('subprocess').Popen(['/bin/sh', '-c', 'echo pwned > {work}/popen'])\nprint(1)",
        _file("{work}/popen"),
    ),
    Case(
        "socket to a listener on 127.0.0.1",
        "s = _imp('socket').create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'pwned')\nprint(1)",
        lambda env, res: bool(env.received),
    ),
    Case(
        "kill the caller: pidfd_open(getppid()) + pidfd_send_signal",
        "_imp('signal').pidfd_send_signal(_os.pidfd_open(_os.getppid()), 9)\nprint(1)",
        _caller_dead,
    ),
    Case(
        "kill the caller: pidfd_open(caller pid) + pidfd_send_signal",
        "_imp('signal').pidfd_send_signal(_os.pidfd_open({caller_pid}), 9)\nprint(1)",
        _caller_dead,
    ),
    Case(
        "kill the caller by pid: ctypes kill", "_imp('ctypes').CDLL(None).kill({caller_pid}, 9)\nprint(1)", _caller_dead
    ),
    Case("kill the caller by pid: kill(caller pid)", "_posix.kill({caller_pid}, 9)\nprint(1)", _caller_dead),
    Case("kill the caller by pid: kill(getppid())", "_posix.kill(_posix.getppid(), 9)\nprint(1)", _caller_dead),
    Case(
        "read the caller's environment: /proc/<ppid>/environ and every /proc/*/environ",
        "found = []\nfor p in ['%d' % _os.getppid(), '{caller_pid}'] + _os.listdir('/proc'):\n"
        "    try:\n        found.append(_open('/proc/%s/environ' % p, 'rb').read())\n"
        "    except OSError:\n        pass\nprint(found)",
        _printed(lambda env: env.secret),
    ),
    Case(
        "read the caller's run dir: /proc/<pid>/cwd",
        "print([_os.listdir('/proc/%s/cwd' % p) for p in ('%d' % _os.getppid(), '{caller_pid}')])",
        _printed(lambda env: "sentinel.txt"),
    ),
    Case(
        "write into the caller's cwd through /proc/<pid>/cwd",
        "_open('/proc/{caller_pid}/cwd/pwned', 'w').write('x')\nprint(1)",
        _file("{cwd}/pwned"),
    ),
    Case(
        "write into the caller's cwd through /proc/<ppid>/cwd",
        "_open('/proc/%d/cwd/pwned' % _os.getppid(), 'w').write('x')\nprint(1)",
        _file("{cwd}/pwned"),
    ),
    Case("write /tmp", "_open('/tmp/{marker}', 'w').write('x')\nprint(1)", _file("/tmp/{marker}")),
    Case("write the home directory", "_open('{home}/{marker}', 'w').write('x')\nprint(1)", _file("{home}/{marker}")),
    Case("write the caller's cwd by its path", "_open('{cwd}/pwned', 'w').write('x')\nprint(1)", _file("{cwd}/pwned")),
    Case("fork then setsid", SPAWN + "print(1)", lambda env, res: False),  # leftovers are checked for every case
    Case(
        "50 forks",
        "for i in range(50):\n" + "".join("    " + ln + "\n" for ln in SPAWN.splitlines()) + "print(50)",
        lambda env, res: False,
    ),
]


# ------------------------------------------------------------------------------------ fixtures
class Caller:
    """The sacrificial caller process; restarted if a case killed it."""

    def __init__(self, base: Path):
        self.base = base
        self.secret = "s3cret-" + uuid.uuid4().hex
        self.cwd, self.tmpdir = base / "cwd", base / "tmp"
        for d in (self.cwd, self.tmpdir):
            d.mkdir(parents=True, exist_ok=True)
        (self.cwd / "sentinel.txt").write_text("the caller's run directory")
        self.proc: subprocess.Popen | None = None

    def ensure(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            env = dict(os.environ, TMPDIR=str(self.tmpdir), PYTHONPATH=str(ROOT), **{SECRET_VAR: self.secret})
            self.proc = subprocess.Popen(
                [sys.executable, "-c", CALLER],
                cwd=self.cwd,
                env=env,
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        return self.proc

    def run(self, code: str, check: bool, limits: dict) -> dict:
        """The caller's answer, or ``{"caller_died": True}`` when it died (then it is restarted)."""
        proc = self.ensure()
        proc.stdin.write(json.dumps({"code": code, "check": check, "limits": limits}) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()  # run_python's own timeouts bound this
        if not line:
            proc.wait(timeout=30)
            return {"caller_died": True, "ok": False, "output": "", "reason": None}
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    c = Caller(tmp_path_factory.mktemp("hostile-caller"))
    try:
        yield c
    finally:
        c.stop()


def _processes_with(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line holds ``marker``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if marker.encode() in (d / "cmdline").read_bytes():
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    found.append(int(d.name))
        except OSError:
            continue
    return found


def _wait_no_processes(marker: str) -> list[int]:
    deadline = time.monotonic() + LEFTOVER_DEADLINE_S
    while True:
        left = _processes_with(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _run_case(case: Case, caller: Caller, listener, tmp_path: Path, check: bool, limits: dict) -> tuple[Env, dict]:
    port, received = listener
    env = Env(
        "asyncrl-hostile-" + uuid.uuid4().hex[:12],
        tmp_path,
        caller.cwd,
        caller.tmpdir,
        Path(pwd.getpwuid(os.getuid()).pw_dir),
        caller.secret,
        caller.ensure().pid,
        port,
        received,
    )
    res = None
    try:
        res = caller.run(env.fill(ESCAPE + case.program), check, limits)
        left = _wait_no_processes(env.marker)
        assert not left, f"{case.name}: processes left behind: {left}"
        assert not case.happened(env, res), f"{case.name}: the harmful effect happened: {res}"
        assert not res.get("caller_died"), f"{case.name}: the caller was killed"
        assert caller.run("print(6 * 7)", True, {"determinism_runs": 1})["output"] == "42", "caller stopped answering"
        assert os.listdir(caller.tmpdir) == [], f"{case.name}: files left in the caller's TMPDIR"
        assert sorted(os.listdir(caller.cwd)) == ["sentinel.txt"], f"{case.name}: the caller's cwd changed"
        if not res["ok"]:
            assert res["reason"] and "\n" not in res["reason"], f"{case.name}: no one-line reason: {res}"
        return env, res
    finally:
        for pid in _processes_with(env.marker):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        for leftover in (Path("/tmp") / env.marker, env.home / env.marker, caller.cwd / "pwned"):
            leftover.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_static_check_rejects_the_hostile_program(case, caller, listener, tmp_path):
    _, res = _run_case(case, caller, listener, tmp_path, check=True, limits={})
    assert not res["ok"] and res["reason"].startswith("rejected before running"), res


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_os_boundary_alone_contains_the_hostile_program(case, caller, listener, tmp_path):
    env, res = _run_case(case, caller, listener, tmp_path, check=False, limits={})
    assert env.secret not in res["output"] + (res["reason"] or "")


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.name in ("fork then setsid", "50 forks")], ids=["fork then setsid", "50 forks"]
)
def test_children_allowed_to_start_die_with_the_run(case, caller, listener, tmp_path):
    """``block_fork: false``: the children start (inside the run's PID namespace) and every one of
    them is gone when the call returns, including one in its own session."""
    _, res = _run_case(case, caller, listener, tmp_path, check=False, limits={"block_fork": False})
    assert res["ok"], res
    assert res["output"] == ("50" if case.name == "50 forks" else "1")


def test_process_creation_is_refused_by_default(caller, listener, tmp_path):
    case = next(c for c in CASES if c.name == "fork then setsid")
    _, res = _run_case(case, caller, listener, tmp_path, check=False, limits={})
    assert not res["ok"] and "Operation not permitted" in res["reason"], res


def test_a_proposal_whose_f_writes_a_file_is_rejected_and_writes_nothing(tmp_path):
    from asyncrl.algos.absolute_zero.code_o import CodeOutputDomain
    from asyncrl.types import Task

    target = tmp_path / "written-by-f"
    proposal = (
        "```python\ndef f(x):\n    from operator import attrgetter\n"
        "    op = attrgetter('__builtins__')(f)['open']\n"
        f"    with op({str(target)!r}, 'w') as fh:\n        fh.write('x')\n    return x\n```\n```input\n3\n```"
    )
    domain = CodeOutputDomain(SandboxLimits())
    got = domain.parse(proposal, Task(id="seed", prompt=[]), "q0")
    assert not got.valid and got.reason.startswith("sandbox: rejected before running"), got.reason
    assert not target.exists()
    # the same f with the static check off: the OS boundary keeps the file from being written
    from asyncrl.sandbox.python import run_python

    code = proposal.split("```python\n")[1].split("```")[0] + "print(repr(f(3)))"
    res = run_python(code, SandboxLimits(), check=False)
    assert not res.ok and "FileNotFoundError" in res.reason, res
    assert not target.exists()


def test_a_caller_killed_mid_run_takes_the_whole_sandbox_with_it(tmp_path):
    """The actor dies (SIGKILL) while its sandbox runs: bwrap (``--die-with-parent``) and every
    process in the run's PID namespace go too."""
    marker = "asyncrl-hostile-" + uuid.uuid4().hex[:12]
    program = (
        ESCAPE
        + "".join(f"{ln}\n" for ln in SPAWN.format(sleep=SLEEP_S, marker=marker).splitlines())
        + "import time\ntime.sleep(60)\n"
    )
    caller = Caller(tmp_path)
    try:
        proc = caller.ensure()
        proc.stdin.write(
            json.dumps({"code": program, "check": False, "limits": {"block_fork": False, "timeout_s": 60, "cpu_s": 30}})
            + "\n"
        )
        proc.stdin.flush()
        deadline = time.monotonic() + LEFTOVER_DEADLINE_S * 3
        while not _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_with(marker), "the sandboxed child never started"
        proc.kill()
        proc.wait(timeout=30)
        assert _wait_no_processes(marker) == []
        assert os.listdir(caller.tmpdir) == []
    finally:
        caller.stop()
        for pid in _processes_with(marker):
            os.kill(pid, 9)


def test_a_run_killed_at_its_timeout_leaves_no_process():
    """The wall-clock timeout kills bwrap; its PID namespace, a child in its own session included, goes too."""
    from asyncrl.sandbox.python import run_python

    marker = "asyncrl-hostile-" + uuid.uuid4().hex[:12]
    program = ESCAPE + SPAWN.format(sleep=SLEEP_S, marker=marker) + "while True:\n    pass\n"
    try:
        res = run_python(
            program, SandboxLimits(timeout_s=1.0, cpu_s=30, block_fork=False, determinism_runs=1), check=False
        )
        assert not res.ok and res.reason.startswith(("timeout", "cpu time limit")), res  # (it busy-loops)
        assert _wait_no_processes(marker) == []
    finally:
        for pid in _processes_with(marker):
            os.kill(pid, 9)
