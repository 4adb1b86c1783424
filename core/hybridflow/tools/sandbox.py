"""Run untrusted Python in a child process with OS limits: the engine behind the ``python`` and ``calculator`` tools.

What is enforced, and by what (docs/agent.md repeats this for users):

- **kernel-enforced**: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), size of files written
  (``RLIMIT_FSIZE``), open files (``RLIMIT_NOFILE``), no core dumps; a wall-clock timeout after which the whole
  process group is killed; with ``unshare`` available (probed once), a new network namespace (no interface but a down
  loopback: no network at all) and a new PID namespace whose processes all die with the tool, so nothing it forked
  survives the call, even a ``setsid`` grandchild. Without ``unshare`` the process group is killed after every call
  (a child that left the group with ``setsid`` could survive: ``unshare`` is what closes that hole).
- **audit-hook enforced (PEP 578, inside the interpreter, not a security boundary)**: opening, listing, creating,
  renaming or deleting paths outside the call's fresh temp dir (reads of the standard library stay allowed, for
  imports), sockets, subprocesses, ``exec``/``system``/``posix_spawn``, ``fork`` (unless ``allow_fork``), signals to
  other processes and ``ctypes``. Code that escapes the interpreter (a crafted C extension, an interpreter bug)
  escapes these checks; ``os.stat`` and friends raise no audit event, so existence of outside paths can be probed.

The interpreter runs isolated (``python -I -S``: no site-packages, no ``PYTHON*`` variables, no user site) with a
minimal environment, in a temp dir deleted after the call. Stability: public. Choosing tools is the agent loop's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SandboxLimits", "SandboxOutcome", "run_sandboxed_python", "namespace_isolation_available", "DENIED_MARKER"]

DENIED_MARKER = "sandbox: denied"

# the child's first code: limits, then the audit hook, then the user's main.py (an expression prints its value)
_BOOTSTRAP = r'''
import os, sys, resource, signal
scratch, cpu, memory, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
allow_fork, audit = sys.argv[5] == "1", sys.argv[6] == "1"

def _out_of_cpu(signum, frame):
    sys.stderr.write(f"Error: CPU time limit exceeded ({cpu} s)\n")
    sys.stderr.flush()
    os._exit(152)

# the soft limit signals (reported as text above), the hard one a second later kills (code stuck in C)
signal.signal(signal.SIGXCPU, _out_of_cpu)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writing past the file-size limit fails with an OSError instead
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.chdir(scratch)
with open("main.py", encoding="utf-8") as handle:
    source = handle.read()
import traceback, linecache, io, math, fractions, decimal, statistics, itertools, functools, re, json  # noqa
scratch_real = os.path.realpath(scratch)
read_roots = tuple(os.path.realpath(p) for p in sys.path if p and os.path.isdir(p))
DENIED = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
          "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg",
          "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "os.startfile", "pty.spawn",
          "webbrowser.open", "urllib.Request", "ftplib.connect", "smtplib.connect", "http.client.connect",
          "sys.remote_exec", "os.putenv", "os.unsetenv"}
if not allow_fork:
    DENIED |= {"os.fork", "os.forkpty"}
PATHS = {"os.listdir": (0,), "os.scandir": (0,), "os.chdir": (0,), "os.remove": (0,), "os.rename": (0, 1),
         "os.rmdir": (0,), "os.mkdir": (0,), "os.symlink": (0, 1), "os.link": (0, 1), "os.chmod": (0,),
         "os.chown": (0,), "os.utime": (0,), "os.truncate": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
         "os.listxattr": (0,), "os.getxattr": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (0, 1),
         "shutil.move": (0, 1), "os.walk": (0,), "glob.glob": (0,), "os.chroot": (0,)}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

def _inside(path, roots):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return any(real == root or real.startswith(root + os.sep) for root in roots)

def _deny(event, detail):
    raise PermissionError(f"sandbox: denied {event} {detail}".rstrip())

def _hook(event, args):
    if event in DENIED:
        _deny(event, "")
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
        if path is None or _inside(path, (scratch_real,)) or (not writing and _inside(path, read_roots)):
            return
        _deny("open", repr(path))
    elif event in PATHS:
        for index in PATHS[event]:
            if index < len(args) and args[index] is not None and not _inside(args[index], (scratch_real,)):
                _deny(event, repr(args[index]))

if audit:
    sys.addaudithook(_hook)
del resource
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    expression = None
    try:
        expression = compile(source, "<tool>", "eval")
    except SyntaxError:
        pass
    if expression is None:
        exec(compile(source, "<tool>", "exec"), namespace)
    else:
        value = eval(expression, namespace)
        if value is not None:
            print(value)
except SystemExit:
    raise
except BaseException:
    lines = traceback.format_exc().splitlines()
    # drop the bootstrap's own frame so the model sees only its code's
    print("\n".join(line for line in lines if "<string>" not in line), file=sys.stderr)
    sys.exit(1)
'''


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxLimits:
    """Per-call limits (defaults fit a calculator / short script)."""

    cpu_seconds: int = 5
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 8 * 2**20
    output_bytes: int = 16 * 2**10
    allow_fork: bool = False
    isolate_namespaces: bool = True
    #: False runs with the OS-level limits only (tests use it to check that layer on its own)
    audit_hook: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxOutcome:
    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    seconds: float
    namespaced: bool

    @property
    def denied(self) -> bool:
        return DENIED_MARKER in self.stderr


@functools.cache
def namespace_isolation_available() -> bool:
    """Whether ``unshare`` can give an unprivileged child new user, network and PID namespaces here."""
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return False
    try:
        probe = subprocess.run([*_UNSHARE, "true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


_UNSHARE = ("unshare", "--map-root-user", "--net", "--pid", "--fork", "--kill-child")


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    return text + ("\n[output cut]" if len(data) > limit else "")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_sandboxed_python(source: str, *, timeout_s: float, limits: SandboxLimits = SandboxLimits()
                               ) -> SandboxOutcome:
    """Run ``source`` in a fresh sandboxed interpreter; returns its output, whatever the code does."""
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="hybridflow-tool-"))
    namespaced = limits.isolate_namespaces and namespace_isolation_available()
    try:
        (scratch / "main.py").write_text(source, encoding="utf-8")
        stdout_path, stderr_path = scratch / ".stdout", scratch / ".stderr"
        command = [*(_UNSHARE if namespaced else ()), sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(scratch),
                   str(limits.cpu_seconds), str(limits.memory_bytes), str(limits.file_bytes),
                   "1" if limits.allow_fork else "0", "1" if limits.audit_hook else "0"]
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            process = await asyncio.create_subprocess_exec(
                *command, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err, cwd=scratch,
                start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(scratch)})
        timed_out = False
        try:
            await asyncio.wait_for(process.wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            # always: whatever the tool started in its group goes with it (a cancelled call included)
            _kill_group(process.pid)
            if process.returncode is None:
                await process.wait()
        # unshare's own complaints (e.g. when its child was killed by a signal) are not the tool's output
        stderr = "\n".join(line for line in _read(stderr_path, limits.output_bytes).splitlines()
                            if not line.startswith("unshare: "))
        return SandboxOutcome(stdout=_read(stdout_path, limits.output_bytes), stderr=stderr,
                              returncode=process.returncode, timed_out=timed_out,
                              seconds=time.perf_counter() - started, namespaced=namespaced)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
