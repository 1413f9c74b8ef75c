"""Bubblewrap (``bwrap``): the operating-system boundary around model-written Python.

``sandbox_argv`` wraps a Python command line so that it runs with

- new user, PID, network, IPC, UTS and (where the kernel has it) cgroup namespaces, uid/gid 65534
  inside, no capabilities, and no further user namespaces (``--disable-userns`` where bwrap has it);
- a filesystem that holds only: the real Python interpreter, its standard library and the shared
  libraries the standard modules in ``modules`` load (found with ``ldd``), all read-only; the
  program file (read-only); its own ``/proc`` and a minimal ``/dev`` (read-only); a private tmpfs
  ``/tmp`` of ``tmp_mb`` MiB as the working directory. The root itself is read-only. Nothing of the
  host's ``/etc``, home, run directory or ``/tmp`` is visible;
- an empty environment (``--clearenv``), a new terminal session, and ``--die-with-parent``;
- optionally a seccomp filter (``no_fork_filter``) under which ``fork``, ``vfork`` and ``clone``
  of a new process fail with EPERM (threads are allowed). RLIMIT_NPROC does not bind a sandbox
  started by root (its processes belong to root outside the user namespace), so this filter is what
  bounds a fork bomb there.

Every process of the run lives in the new PID namespace: when the program's main process exits,
bwrap's init (PID 1 there) exits and the kernel kills whatever else is left, including children
that called ``setsid``; when the caller kills bwrap, ``--die-with-parent`` takes the init down.

``unavailable()`` probes once per process whether all of this works here (None when it does, else
a one-line reason that says how to install bubblewrap). Nothing here falls back silently.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import struct
import subprocess
import sys
import sysconfig
from dataclasses import dataclass

INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)"
SANDBOX_ID = 65534  # 'nobody' inside the user namespace
PROGRAM_PATH = "/sandbox/prog.py"  # where the program file appears inside the sandbox
_LIB_DIRS = ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/local/lib")  # no-ldd fallback
# Standard modules the probe imports to find the shared objects they load (those of the caller's
# allowed list come on top): the rlimit stub needs ``resource``.
_BASE_MODULES = ("resource", "os")


@dataclass(frozen=True)
class PythonInstall:
    """What of the host's Python the sandbox sees (all read-only)."""

    executable: str  # the real interpreter (a venv's python is a link to it)
    dirs: tuple[str, ...]  # the standard library (and lib-dynload where it lies elsewhere)
    libs: tuple[tuple[str, str], ...]  # (host file, path the dynamic loader opens); () with fallback
    lib_dirs: tuple[str, ...] = ()  # whole library directories, only when ldd is not available


def base_executable() -> str:
    """The real interpreter behind ``sys.executable`` (a virtual environment's base Python)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


@functools.cache
def python_install(modules: tuple[str, ...] = ()) -> PythonInstall:
    """The interpreter, its standard library, and the shared libraries it and ``modules`` need."""
    exe = base_executable()
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    dirs = [stdlib]
    dynload = sysconfig.get_config_var("DESTSHARED")
    if dynload and os.path.isdir(dynload):
        dynload = os.path.realpath(dynload)
        if not dynload.startswith(stdlib + os.sep):
            dirs.append(dynload)
    objects = [exe] + _extension_files(exe, tuple(sorted(set(modules) | set(_BASE_MODULES))))
    libs = _ldd(objects)
    if libs is None:
        return PythonInstall(exe, tuple(dirs), (), tuple(d for d in _LIB_DIRS if os.path.lexists(d)))
    return PythonInstall(exe, tuple(dirs), tuple((os.path.realpath(p), p) for p in libs))


def _extension_files(exe: str, modules: tuple[str, ...]) -> list[str]:
    """The extension-module files (``.so``) that importing ``modules`` loads in a fresh interpreter."""
    code = (
        "import sys\nfor m in sys.argv[1:]:\n    __import__(m)\n"
        "print('\\n'.join(sorted({getattr(m, '__file__', None) or '' for m in list(sys.modules.values())})))"
    )
    try:
        out = subprocess.run(
            [exe, "-I", "-S", "-c", code, *modules], capture_output=True, text=True, timeout=60, env={}, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [p for p in out.splitlines() if p.endswith(".so") and os.path.isfile(p)]


def _ldd(objects: list[str]) -> list[str] | None:
    """Shared libraries of ``objects`` as the dynamic loader names them (``ldd``); None without ldd."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return None
    try:
        out = subprocess.run([ldd, *objects], capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found: set[str] = set()
    for line in out.splitlines():
        line = line.strip()
        path = line.split("=>", 1)[1] if "=>" in line else line  # "libc.so.6 => /lib/.../libc.so.6 (0x..)"
        path = path.split(" (", 1)[0].strip()  # or the loader itself: "/lib64/ld-linux-x86-64.so.2 (0x..)"
        if path.startswith("/") and os.path.exists(path):
            found.add(path)
    return sorted(found)


# ------------------------------------------------------------------------------------ seccomp
# Classic BPF over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]} (little-endian), as in
# the kernel's Documentation/userspace-api/seccomp_filter.rst.
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM, _ENOSYS, _CLONE_THREAD = 1, 38, 0x00010000
# machine -> (AUDIT_ARCH_*, clone, clone3, other process-creating calls, x32 bit or 0)
_ARCHES = {
    "x86_64": (0xC000003E, 56, 435, (57, 58), 0x40000000),  # fork 57, vfork 58
    "aarch64": (0xC00000B7, 220, 435, (), 0),
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


@functools.cache
def no_fork_filter(machine: str | None = None) -> bytes | None:
    """A seccomp program under which creating a process fails with EPERM (``fork``, ``vfork``,
    ``clone`` without CLONE_THREAD) and ``clone3`` with ENOSYS (the C library then falls back to
    ``clone``, so threads still work). Another architecture's system calls kill the process.
    None on a machine this module has no system-call table for."""
    arch = _ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit, clone, clone3, others, x32 = arch
    deny = _insn(_RET, _ERRNO | _EPERM)
    prog = [_insn(_LD_W_ABS, 4), _insn(_JEQ, audit, jt=1), _insn(_RET, _KILL_PROCESS), _insn(_LD_W_ABS, 0)]
    if x32:
        prog += [_insn(_JGE, x32, jf=1), deny]
    for nr in others:
        prog += [_insn(_JEQ, nr, jf=1), deny]
    prog += [
        _insn(_JEQ, clone3, jf=1),
        _insn(_RET, _ERRNO | _ENOSYS),
        _insn(_JEQ, clone, jf=4),
        _insn(_LD_W_ABS, 16),  # args[0] (flags), low 32 bits
        _insn(_JSET, _CLONE_THREAD, jf=1),
        _insn(_RET, _ALLOW),
        deny,
        _insn(_RET, _ALLOW),
    ]
    return b"".join(prog)


# ------------------------------------------------------------------------------------ command
@dataclass(frozen=True)
class Features:
    """bwrap options that older releases lack (found by the probe)."""

    disable_userns: bool = True  # bwrap >= 0.8
    tmp_size: bool = True  # --size for --tmpfs; without it /tmp is read-only


def sandbox_argv(
    inner: list[str],
    install: PythonInstall,
    *,
    program_fd: int,
    seccomp_fd: int | None = None,
    tmp_mb: int = 16,
    features: Features = Features(),
    bwrap: str = "bwrap",
    extra_ro: tuple[str, ...] = (),
) -> list[str]:
    """The bwrap command line that runs ``inner`` (which starts with ``install.executable``) in the
    sandbox described in the module docstring. ``program_fd`` is read by bwrap into the read-only
    file ``PROGRAM_PATH``; ``seccomp_fd`` (optional) holds a filter from ``no_fork_filter``. Both
    must be passed to the child (``pass_fds``). ``extra_ro``: more host paths bound read-only at
    the same place, after the private ``/tmp`` (so that one under the host's ``/tmp`` shows)."""
    argv = [
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--uid",
        str(SANDBOX_ID),
        "--gid",
        str(SANDBOX_ID),
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
    ]
    if features.disable_userns:
        argv += ["--disable-userns"]
    for d in install.dirs:
        argv += ["--ro-bind", d, d]
    for d in install.lib_dirs:  # fallback without ldd: the system's library directories
        argv += ["--symlink", os.readlink(d), d] if os.path.islink(d) else ["--ro-bind", d, d]
    argv += ["--ro-bind", install.executable, install.executable]
    for real, path in install.libs:
        argv += ["--ro-bind", real, path]
    if os.path.exists("/etc/ld.so.cache"):  # where the loader finds libraries outside its default dirs
        argv += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    argv += ["--ro-bind-data", str(program_fd), PROGRAM_PATH, "--proc", "/proc", "--dev", "/dev"]
    argv += (
        ["--size", str(tmp_mb << 20), "--tmpfs", "/tmp"]
        if features.tmp_size
        else ["--tmpfs", "/tmp", "--remount-ro", "/tmp"]
    )
    for path in extra_ro:
        argv += ["--ro-bind", path, path]
    argv += [
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
        "--chdir",
        "/tmp",
        "--clearenv",
        "--new-session",
        "--die-with-parent",
    ]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + ["--", *inner]


# ------------------------------------------------------------------------------------ probe
@dataclass(frozen=True)
class Probe:
    """The outcome of ``probe``: ``reason`` is None when bwrap works here."""

    reason: str | None
    bwrap: str = "bwrap"
    features: Features = Features()


_PROBE_CODE = "import os\nprint(os.getuid(), os.getpid())\n"


@functools.cache
def probe(modules: tuple[str, ...] = ()) -> Probe:
    """Run a trivial program in the full sandbox once (per process and ``modules``) and report
    whether it worked: uid 65534, PID 2 (a new PID namespace). Options the installed bwrap does not
    know are dropped in turn (see ``Features``)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return Probe(f"bwrap is not installed (not found on PATH): {INSTALL_HINT}")
    install = python_install(modules)
    features = Features()
    for _ in range(3):
        out, err = _probe_run(bwrap, install, features)
        if out == f"{SANDBOX_ID} 2":
            return Probe(None, bwrap, features)
        if "--disable-userns" in err and features.disable_userns:
            features = Features(False, features.tmp_size)
        elif "--size" in err and features.tmp_size:
            features = Features(features.disable_userns, False)
        else:
            break
    last = (err.strip().splitlines() or [f"unexpected output {out!r}"])[-1][:300]
    return Probe(
        f"bwrap ({bwrap}) does not work here: {last}. The sandbox needs unprivileged user "
        f"namespaces (or root); {INSTALL_HINT}"
    )


def _probe_run(bwrap: str, install: PythonInstall, features: Features) -> tuple[str, str]:
    fd = os.memfd_create("asyncrl-probe")
    try:
        os.write(fd, _PROBE_CODE.encode())
        os.lseek(fd, 0, os.SEEK_SET)
        argv = sandbox_argv(
            [install.executable, "-I", "-S", "-B", PROGRAM_PATH], install, program_fd=fd, features=features, bwrap=bwrap
        )
        res = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=30,
            env={},
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            check=False,
        )
        return res.stdout.strip(), res.stderr
    except (OSError, subprocess.SubprocessError) as e:
        return "", f"{type(e).__name__}: {e}"
    finally:
        os.close(fd)


def unavailable(modules: tuple[str, ...] = ()) -> str | None:
    """None when the bwrap sandbox works here, else why not (one line, with how to install it)."""
    return probe(modules).reason
