"""The kernel boundary around a tool call that runs model-written code: the bubblewrap command that builds it, and
the probe that says whether this machine can build it (and, if not, what is missing and how to get it).

One call runs under ``bwrap`` (Debian/Ubuntu/Fedora package ``bubblewrap``) with:

- a **mount namespace** whose root is read-only and holds only ``/usr`` (with the ``/lib``, ``/bin`` links), the
  interpreter's own prefix when it lives elsewhere, a private ``/proc`` and a minimal read-only ``/dev``, plus the
  scratch dir ``/tmp``: a tmpfs capped at ``scratch_bytes`` that vanishes with the call. Nothing of the trainer's
  (the run dir, checkpoints, the repo, ``/home``, ``/root``, ``/etc``, the host's ``/tmp`` and ``/dev/shm``) exists
  there;
- new **user, PID, network, IPC, UTS and cgroup namespaces**: no network (no interface but a down loopback), no
  other process visible or signalable; ``--disable-userns`` forbids nesting user namespaces;
- an **unprivileged uid** (65534) that is not root anywhere: a trainer running as root drops to uid/gid 65534 before
  bwrap starts (so the namespace maps 65534 to 65534), any other user keeps its own uid; no capabilities, no new
  privileges (bwrap sets ``PR_SET_NO_NEW_PRIVS``);
- the **syscall filter** of :mod:`hybridflow.tools.seccomp`.

Process, CPU, memory, file-size and open-file caps are rlimits the sandbox's first code sets before any model code
runs (:mod:`hybridflow.tools.sandbox`); with the uid dropped, ``RLIMIT_NPROC`` counts this sandbox's processes
only. What this module does not do: run the code, time it out, or read its output (the sandbox's job).
Stability: developer.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hybridflow.tools.seccomp import SeccompUnavailable, compile_seccomp_filter, filter_pipe

__all__ = ["IsolationMode", "IsolationStatus", "SANDBOX_UID", "SCRATCH", "bubblewrap_command", "isolation_status",
           "sandbox_credentials"]

#: ``bubblewrap``: the kernel boundary of this module; ``unisolated``: rlimits and the audit hook only (an explicit,
#: recorded opt-in: ``unsafe_allow_unisolated``)
IsolationMode = Literal["bubblewrap", "unisolated"]

#: the uid and gid the code runs as, inside the namespace and (for a root trainer) outside it: ``nobody``
SANDBOX_UID = 65534
#: the scratch dir inside the sandbox: the working directory, ``HOME`` and ``TMPDIR``
SCRATCH = "/tmp"

_INSTALL_HINT = ("install bubblewrap: apt-get install bubblewrap (Debian/Ubuntu), dnf install bubblewrap (Fedora), "
                 "or run scripts/setup.sh, which installs it where it can")
_USERNS_HINT = ("bubblewrap needs unprivileged user namespaces: sysctl -w user.max_user_namespaces=15000 (and "
                "kernel.unprivileged_userns_clone=1 on Debian kernels before 6.x; on Ubuntu 24.04+ "
                "kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap); in a container, "
                "allow unshare/clone with CLONE_NEWUSER in its seccomp profile")


@dataclass(frozen=True, kw_only=True, slots=True)
class IsolationStatus:
    """Whether a tool call can run under the kernel boundary here; ``reason`` says what is missing and the fix."""

    available: bool
    reason: str = ""
    interpreter: str = ""
    #: directories the interpreter needs besides /usr, bound read-only at the same path
    interpreter_mounts: tuple[str, ...] = ()


def sandbox_credentials() -> dict[str, object]:
    """``subprocess`` keyword arguments that start bwrap as uid/gid 65534 when the trainer is root (else nothing:
    an unprivileged user cannot and need not switch)."""
    if os.geteuid() != 0:
        return {}
    return {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}


def _reachable(path: str, *, executable: bool) -> bool:
    """Whether a user who is neither the owner nor in the group can reach ``path`` (every parent searchable, the
    file itself readable, and executable when asked)."""
    real = Path(os.path.realpath(path))
    try:
        for parent in real.parents:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        mode = os.stat(real).st_mode
    except OSError:
        return False
    need = stat.S_IROTH | (stat.S_IXOTH if executable else 0)
    return mode & need == need


def _stdlib_dir(executable: str) -> str | None:
    """The standard library's directory of the interpreter ``executable`` (asked of the interpreter itself)."""
    try:
        probe = subprocess.run([executable, "-I", "-S", "-c", "import os, sys; print(os.path.dirname(os.__file__))"],
                               capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return probe.stdout.strip() or None if probe.returncode == 0 else None


def _choose_interpreter(switching_user: bool) -> tuple[str, tuple[str, ...]] | str:
    """The interpreter the sandbox runs and the directories to bind for it, or why none fits.

    The trainer's own interpreter (its base installation, not the venv: no site-packages goes in) when the sandbox
    user can reach it; a root trainer whose Python lives under ``/root`` (pyenv) falls back to the system's
    ``python3`` in ``/usr``.
    """
    own = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    candidates = [own] + [path for path in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(path)]
    refused = []
    for candidate in candidates:
        executable = os.path.realpath(candidate)
        stdlib = _stdlib_dir(executable)
        if stdlib is None:
            refused.append(f"{candidate} (does not run)")
            continue
        if switching_user and not (_reachable(executable, executable=True) and _reachable(stdlib, executable=True)):
            refused.append(f"{candidate} (not readable by uid {SANDBOX_UID})")
            continue
        prefix = os.path.dirname(os.path.dirname(executable))
        mounts = () if prefix == "/usr" or prefix.startswith("/usr/") else (prefix,)
        return executable, mounts
    return ("no Python interpreter the sandbox user can run: tried " + ", ".join(refused) + ". Fix: install "
            "python3 from the distribution (apt-get install python3), or run the trainer as a user whose Python "
            f"uid {SANDBOX_UID} can read")


def _root_links() -> list[str]:
    """bwrap arguments recreating the host's merged-/usr links (``/lib -> usr/lib``) or binding real top dirs."""
    arguments: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            arguments += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            arguments += ["--ro-bind", path, path]
    return arguments


def bubblewrap_command(*, interpreter: str, interpreter_mounts: tuple[str, ...], scratch_bytes: int,
                       seccomp_fd: int) -> list[str]:
    """The ``bwrap`` argv up to (not including) the interpreter's own arguments."""
    command = [shutil.which("bwrap") or "bwrap",
               "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
               "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
               "--ro-bind", "/usr", "/usr", *_root_links()]
    for mount in interpreter_mounts:
        command += ["--ro-bind", mount, mount]
    command += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
                "--size", str(scratch_bytes), "--tmpfs", SCRATCH, "--chdir", SCRATCH, "--remount-ro", "/",
                "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
                "--setenv", "HOME", SCRATCH, "--setenv", "TMPDIR", SCRATCH,
                "--seccomp", str(seccomp_fd), interpreter]
    return command


@functools.cache
def isolation_status() -> IsolationStatus:
    """Probe once per process: can a sandbox be built here? Runs one real sandboxed ``pass``."""
    if not sys.platform.startswith("linux"):
        return IsolationStatus(available=False, reason=f"the tool sandbox needs Linux (this is {sys.platform})")
    if shutil.which("bwrap") is None:
        return IsolationStatus(available=False, reason=f"bwrap (bubblewrap) is not on PATH. Fix: {_INSTALL_HINT}")
    try:
        program = compile_seccomp_filter()
    except SeccompUnavailable as exc:
        return IsolationStatus(available=False, reason=str(exc))
    chosen = _choose_interpreter(switching_user=os.geteuid() == 0)
    if isinstance(chosen, str):
        return IsolationStatus(available=False, reason=chosen)
    interpreter, mounts = chosen
    seccomp_fd = filter_pipe(program)
    try:
        command = bubblewrap_command(interpreter=interpreter, interpreter_mounts=mounts, scratch_bytes=2**20,
                                     seccomp_fd=seccomp_fd)
        probe = subprocess.run([*command, "-I", "-S", "-c", "pass"], capture_output=True, text=True, timeout=30,
                               check=False, pass_fds=(seccomp_fd,), **sandbox_credentials())  # type: ignore[call-overload]
    except (OSError, subprocess.SubprocessError) as exc:
        return IsolationStatus(available=False, reason=f"bwrap could not be started ({exc}). Fix: {_INSTALL_HINT}")
    finally:
        os.close(seccomp_fd)
    if probe.returncode != 0:
        said = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else f"exit status {probe.returncode}"
        return IsolationStatus(available=False, reason=f"bwrap could not build the sandbox here ({said}). Fix: "
                               f"{_USERNS_HINT}")
    return IsolationStatus(available=True, interpreter=interpreter, interpreter_mounts=mounts)
