"""The code_o sandbox: good programs run; hostile ones are stopped with a reason, by the static
check and, with the static check switched off, by the run-time layers alone."""

from __future__ import annotations

import time

import pytest

from asyncrl.envs.sandbox import SandboxLimits, check_code, run_python

FAST = SandboxLimits(timeout_s=1.5, cpu_s=1, memory_mb=256, max_output_bytes=4096)


def test_a_good_program_runs_and_prints_its_result():
    res = run_python("def f(xs):\n    return sorted(xs)[::-1]\nprint(repr(f([3, 1, 2])))", FAST)
    assert res.ok, res.reason
    assert res.output == "[3, 2, 1]"


def test_whitelisted_imports_are_allowed():
    res = run_python("import math\nfrom collections import Counter\nprint(math.factorial(5), "
                     "Counter('aab')['a'])", FAST)
    assert res.ok, res.reason
    assert res.output == "120 2"


@pytest.mark.parametrize("code,reason", [
    ("import os\nos.system('echo pwned')", "import of 'os' is not allowed"),
    ("import os\nwhile True:\n    os.fork()", "import of 'os' is not allowed"),  # fork bomb
    ("import socket\nsocket.create_connection(('10.0.0.1', 80))", "import of 'socket' is not allowed"),
    ("from subprocess import run\nrun(['ls'])", "import of 'subprocess' is not allowed"),
    ("print(().__class__.__base__.__subclasses__())", "attribute '__subclasses__' is not allowed"),
    ("import random\nrandom._os.system('id')", "attribute '_os' is not allowed"),
    ("print(open('/etc/passwd').read())", "use of 'open' is not allowed"),
    ("eval('1+1')", "use of 'eval' is not allowed"),
    ("def f(:\n", "code does not parse"),
])
def test_static_check_rejects_before_running(code, reason):
    assert reason in check_code(code)
    res = run_python(code, FAST)
    assert not res.ok and res.reason.startswith("rejected before running") and reason in res.reason


@pytest.mark.parametrize("code,reason", [
    ("while True:\n    pass", ("timeout", "cpu time limit")),  # infinite loop
    ("x = [0] * (10 ** 10)\nprint(len(x))", ("memory limit",)),  # huge allocation
    ("while True:\n    print('x' * 1000)", ("output limit",)),  # gigabytes of output, streamed
    ("print('x' * (10 ** 10))", ("memory limit",)),  # gigabytes of output in one string
])
def test_runtime_limits_stop_hostile_programs(code, reason):
    t0 = time.perf_counter()
    res = run_python(code, FAST)
    assert not res.ok
    assert any(r in res.reason for r in reason), res.reason
    assert time.perf_counter() - t0 < 5 * FAST.timeout_s


@pytest.mark.parametrize("code,reason", [
    ("import os\nos.system('echo pwned')", "process creation blocked"),
    ("import os\nwhile True:\n    os.fork()", "process creation blocked"),  # fork bomb
    ("import subprocess\nsubprocess.run(['ls'])", "blocked in the sandbox"),
    ("import socket\nsocket.create_connection(('10.0.0.1', 80))", "blocked in the sandbox"),
])
def test_runtime_layers_hold_without_the_static_check(code, reason):
    res = run_python(code, FAST, check=False)
    assert not res.ok
    assert reason in res.reason
    assert "pwned" not in res.output


def test_determinism_check():
    res = run_python("import random\nprint(random.random())", FAST)
    assert not res.ok and "nondeterministic" in res.reason
    seeded = run_python("import random\nr = random.Random(3)\nprint(r.random())", FAST)
    assert seeded.ok, seeded.reason


def test_the_child_runs_with_an_empty_environment():
    res = run_python("import os\nprint(sorted(os.environ))", FAST, check=False)
    assert res.ok, res.reason
    assert res.output in ("[]", "['LC_CTYPE']")  # Python may set LC_CTYPE itself


def test_limits_are_in_place_before_the_program_runs():
    code = ("import resource as r\nprint(*(r.getrlimit(k)[0] for k in (r.RLIMIT_CPU, r.RLIMIT_AS, "
            "r.RLIMIT_FSIZE, r.RLIMIT_NPROC)))")
    res = run_python(code, FAST, check=False)
    assert res.ok, res.reason
    assert res.output == f"1 {256 * 1024 * 1024} 4096 0"
