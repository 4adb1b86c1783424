"""Run model-written Python in a fresh interpreter behind a kernel boundary: the engine behind the ``python`` tool.

Two modes (:data:`hybridflow.tools.isolation.IsolationMode`), and every outcome says which one ran:

- ``bubblewrap`` (the default, and the only one a tool uses unless its config opts out): the namespaces, read-only
  filesystem, size-capped tmpfs scratch, unprivileged uid and syscall filter of :mod:`hybridflow.tools.isolation`;
  inside, before any model code runs, rlimits on CPU seconds, address space, file size, open files and processes
  (``RLIMIT_NPROC``: threads count), no core dumps. The parent kills the sandbox at the wall-clock timeout; the PID
  namespace takes every process the code started with it.
- ``unisolated`` (``unsafe_allow_unisolated: true``, for machines without bubblewrap; recorded in the manifest and
  warned about): the same rlimits in a host temp dir, a new network and PID namespace through ``unshare`` where it
  works, and the audit hook only. Not a security boundary.

In both modes an audit hook (PEP 578) turns the most common forbidden actions into a clear ``sandbox: denied ...``
message for the model; the code can switch it off, so it is a courtesy, never the boundary. The interpreter runs
isolated (``python -I -S``: no site-packages, no ``PYTHON*`` variables) with a minimal environment and reads its
source from standard input. Stability: public. Choosing tools is the agent loop's.
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
from typing import IO, Any

from hybridflow.tools.isolation import (
    SCRATCH,
    IsolationMode,
    bubblewrap_command,
    isolation_status,
    sandbox_credentials,
)
from hybridflow.tools.seccomp import compile_seccomp_filter, filter_pipe

__all__ = ["SandboxLimits", "SandboxOutcome", "run_sandboxed_python", "namespace_isolation_available", "DENIED_MARKER"]

DENIED_MARKER = "sandbox: denied"

# the child's first code: read the source, set the limits, install the courtesy audit hook, run the source (a bare
# expression prints its value). The hook's state lives in a closure, not in __main__'s globals; it is still no
# boundary (docs/guide/agent.md): the kernel's limits and namespaces are.
_BOOTSTRAP = r'''
import os, sys, resource, signal
source = sys.stdin.buffer.read().decode("utf-8", errors="replace")
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
scratch, cpu, memory, fsize, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
allow_fork, audit = sys.argv[6] == "1", sys.argv[7] == "1"

def _out_of_cpu(signum, frame):
    sys.stdout.flush()
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
if nproc > 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
os.chdir(scratch)
import traceback, linecache, io, math, fractions, decimal, statistics, itertools, functools, re, json  # noqa

def _install_hook():
    scratch_real = os.path.realpath(scratch)
    read_roots = tuple(os.path.realpath(p) for p in sys.path if p and os.path.isdir(p))
    denied = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
              "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg",
              "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "os.startfile", "pty.spawn",
              "webbrowser.open", "urllib.Request", "ftplib.connect", "smtplib.connect", "http.client.connect",
              "sys.remote_exec", "os.putenv", "os.unsetenv"}
    if not allow_fork:
        denied |= {"os.fork", "os.forkpty"}
    denied = frozenset(denied)
    paths = {"os.listdir": (0,), "os.scandir": (0,), "os.chdir": (0,), "os.remove": (0,), "os.rename": (0, 1),
             "os.rmdir": (0,), "os.mkdir": (0,), "os.symlink": (0, 1), "os.link": (0, 1), "os.chmod": (0,),
             "os.chown": (0,), "os.utime": (0,), "os.truncate": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
             "os.listxattr": (0,), "os.getxattr": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (0, 1),
             "shutil.move": (0, 1), "os.walk": (0,), "glob.glob": (0,), "os.chroot": (0,)}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep

    def inside(path, roots):
        if isinstance(path, int):
            return True
        real = realpath(fsdecode(path))
        return any(real == root or real.startswith(root + sep) for root in roots)

    def deny(event, detail):
        raise PermissionError(f"sandbox: denied {event} {detail}".rstrip())

    def hook(event, args):
        if event in denied:
            deny(event, "")
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in str(mode) for c in "wax+")) or bool((flags or 0) & write_flags)
            if path is None or inside(path, (scratch_real,)) or (not writing and inside(path, read_roots)):
                return
            deny("open", repr(path))
        elif event in paths:
            for index in paths[event]:
                if index < len(args) and args[index] is not None and not inside(args[index], (scratch_real,)):
                    deny(event, repr(args[index]))

    sys.addaudithook(hook)

if audit:
    _install_hook()
del resource, _install_hook
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
    """Per-call limits (defaults fit a short script)."""

    cpu_seconds: int = 5
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 8 * 2**20
    output_bytes: int = 16 * 2**10
    #: the tmpfs scratch dir's size (``bubblewrap``; model code can fill it, never the host's disk)
    scratch_bytes: int = 16 * 2**20
    #: processes and threads the code may run at once, the interpreter and bubblewrap's init included
    #: (``bubblewrap``: ``RLIMIT_NPROC`` per sandbox)
    max_processes: int = 16
    #: the courtesy audit hook refuses ``fork`` unless this is set (the kernel caps processes either way)
    allow_fork: bool = False
    isolation: IsolationMode = "bubblewrap"
    #: ``unisolated`` only: try ``unshare`` for new network and PID namespaces
    isolate_namespaces: bool = True
    #: False runs without the courtesy hook (the red-team tests use it to show that the kernel holds on its own)
    audit_hook: bool = True

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_bytes", "file_bytes", "output_bytes", "scratch_bytes", "max_processes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)}")
        if self.max_processes < 3:
            raise ValueError(f"SandboxLimits.max_processes must be at least 3 (bubblewrap's init, the interpreter "
                             f"and one more), got {self.max_processes}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxOutcome:
    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    seconds: float
    isolation: IsolationMode
    #: ``unisolated`` only: whether ``unshare`` gave the call new network and PID namespaces
    namespaced: bool

    @property
    def denied(self) -> bool:
        return DENIED_MARKER in self.stderr


@functools.cache
def namespace_isolation_available() -> bool:
    """Whether ``unshare`` can give an unprivileged child new user, network and PID namespaces here (the
    ``unisolated`` mode's best effort)."""
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return False
    try:
        probe = subprocess.run([*_UNSHARE, "true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


_UNSHARE = ("unshare", "--map-root-user", "--net", "--pid", "--fork", "--kill-child")


def _read(handle: IO[bytes], limit: int) -> str:
    handle.seek(0)
    data = handle.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    return text + ("\n[output cut]" if len(data) > limit else "")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _bootstrap_arguments(scratch: str, limits: SandboxLimits, nproc: int) -> list[str]:
    return ["-I", "-S", "-c", _BOOTSTRAP, scratch, str(limits.cpu_seconds), str(limits.memory_bytes),
            str(limits.file_bytes), str(nproc), "1" if limits.allow_fork else "0", "1" if limits.audit_hook else "0"]


async def run_sandboxed_python(source: str, *, timeout_s: float, limits: SandboxLimits = SandboxLimits()
                               ) -> SandboxOutcome:
    """Run ``source`` in a fresh sandboxed interpreter; returns its output, whatever the code does.

    Raises:
        RuntimeError: ``limits.isolation`` is ``bubblewrap`` and this machine cannot build the sandbox (the
            message is :func:`hybridflow.tools.isolation.isolation_status`'s reason; tools check at start-up).
    """
    started = time.perf_counter()
    extra: dict[str, Any] = {}
    pass_fds: tuple[int, ...] = ()
    host_scratch: str | None = None
    namespaced = False
    if limits.isolation == "bubblewrap":
        status = isolation_status()
        if not status.available:
            raise RuntimeError(f"the tool sandbox is unavailable: {status.reason}")
        seccomp_fd = filter_pipe(compile_seccomp_filter())
        pass_fds = (seccomp_fd,)
        command = [*bubblewrap_command(interpreter=status.interpreter, interpreter_mounts=status.interpreter_mounts,
                                       scratch_bytes=limits.scratch_bytes, seccomp_fd=seccomp_fd),
                   *_bootstrap_arguments(SCRATCH, limits, limits.max_processes)]
        extra = sandbox_credentials()
        env = {"PATH": "/usr/bin:/bin"}
    else:
        host_scratch = tempfile.mkdtemp(prefix="hybridflow-tool-")
        namespaced = limits.isolate_namespaces and namespace_isolation_available()
        command = [*(_UNSHARE if namespaced else ()), sys.executable, *_bootstrap_arguments(host_scratch, limits, 0)]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": host_scratch}
    try:
        with tempfile.TemporaryFile() as code, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            code.write(source.encode("utf-8", errors="replace"))
            code.seek(0)
            try:
                process = await asyncio.create_subprocess_exec(
                    *command, stdin=code, stdout=out, stderr=err, cwd=host_scratch or "/", start_new_session=True,
                    env=env, pass_fds=pass_fds, **extra)
            finally:
                for fd in pass_fds:
                    os.close(fd)
            timed_out = False
            try:
                await asyncio.wait_for(process.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                timed_out = True
            finally:
                # always: whatever the tool started goes with it (a cancelled call included); under bubblewrap the
                # PID namespace dies with its init, which dies with bwrap (--die-with-parent)
                _kill_group(process.pid)
                if process.returncode is None:
                    await process.wait()
            # unshare's own complaints (e.g. when its child was killed by a signal) are not the tool's output
            stderr = "\n".join(line for line in _read(err, limits.output_bytes).splitlines()
                                if not line.startswith("unshare: "))
            return SandboxOutcome(stdout=_read(out, limits.output_bytes), stderr=stderr,
                                  returncode=process.returncode, timed_out=timed_out,
                                  seconds=time.perf_counter() - started, isolation=limits.isolation,
                                  namespaced=namespaced)
    finally:
        if host_scratch is not None:
            shutil.rmtree(host_scratch, ignore_errors=True)
