"""Red team: escape attempts through the ``python`` tool exactly as the agent loop calls it (``build_tools`` +
``call_tool``), each one first switching off the in-process audit hook, so what holds is the kernel's boundary.

Every attempt asserts two things: the guard really was off (the code printed ``GUARD_OFF`` after importing ctypes
and opening a socket, both of which the hook refuses) and the attempt was contained (the secret never shows, the
host file never appears, the listener accepted nothing, the process the test started is alive, ...). Every result
must report ``isolation == "bubblewrap"``: on a box where the sandbox degrades (bubblewrap missing, user namespaces
off) this module fails under ``HYBRIDFLOW_REQUIRE_ENGINES=1`` (CI) instead of passing on a weaker mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hybridflow
from hybridflow.config import load_config
from hybridflow.manifest import build_manifest
from hybridflow.testing.processes import processes_tagged
from hybridflow.tools import ToolResult, build_tools, call_tool
from hybridflow.tools.isolation import SANDBOX_UID, isolation_status
from hybridflow.tools.python_tool import PythonTool

#: the attacker's first lines: find the audit hook's closure through the garbage collector and empty its deny-list,
#: its path map and its path check (the hook cannot be removed, but it can be made to allow everything)
DISABLE_GUARD = '''
import gc
for _f in gc.get_objects():
    if type(_f).__name__ == "function" and _f.__name__ == "hook" and _f.__closure__:
        for _c in _f.__closure__:
            _v = _c.cell_contents
            if isinstance(_v, (frozenset, set)):
                _c.cell_contents = frozenset()
            elif isinstance(_v, dict):
                _c.cell_contents = {}
            elif callable(_v) and getattr(_v, "__name__", "") == "inside":
                _c.cell_contents = lambda path, roots: True
import ctypes, socket
socket.socket().close()
print("GUARD_OFF")
'''

SECRET = "hybridflow-redteam-secret-7f3a"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture(scope="module", autouse=True)
def kernel_boundary() -> None:
    status = isolation_status()
    if not status.available:
        message = f"the tool sandbox is unavailable on this box: {status.reason}"
        if os.environ.get("HYBRIDFLOW_REQUIRE_ENGINES") == "1":
            pytest.fail(message + " (HYBRIDFLOW_REQUIRE_ENGINES=1: scripts/setup.sh installs bubblewrap)")
        pytest.skip(message)


@pytest.fixture(scope="module")
def tool() -> dict[str, Any]:
    return build_tools(["python"], {"python": {"cpu_seconds": 2, "memory_mb": 256, "scratch_mb": 8,
                                               "max_processes": 8, "allow_fork": True}})


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trainer-files") / "secret.txt"
    path.write_text(SECRET)
    path.chmod(0o644)
    for parent in path.parents:  # readable by anyone on the host: only the mount namespace hides it
        if str(parent).startswith(tempfile.gettempdir()) and parent != Path(tempfile.gettempdir()):
            parent.chmod(0o755)
    return path


def attack(tools: dict[str, Any], code: str, *, timeout_s: float = 20) -> ToolResult:
    result: ToolResult = asyncio.run(call_tool(tools, "python", {"code": DISABLE_GUARD + code}, timeout_s=timeout_s))
    assert result.details.get("isolation") == "bubblewrap", result
    return result


def assert_guard_was_off(result: ToolResult) -> None:
    assert result.text.startswith("GUARD_OFF"), f"the attack did not get past the audit hook: {result.text!r}"


@pytest.mark.parametrize("how", [
    "open({secret!r}).read()",
    "open('../../../..' + {secret!r}).read()",
    "import os\nos.symlink({secret!r}, 'link')\nopen('link').read()",
    "import os\nos.link({secret!r}, 'hard')\nopen('hard').read()",
    "open('/proc/self/root' + {secret!r}).read()",
    "open('/proc/1/root' + {secret!r}).read()",
    "import os\nfd = os.open('/', os.O_RDONLY)\nos.read(os.open({secret!r}[1:], os.O_RDONLY, dir_fd=fd), 100)",
])
def test_files_outside_the_scratch_dir_cannot_be_read(tool: dict[str, Any], secret_file: Path, how: str) -> None:
    # the last line of ``how`` is the read: print what it got, or the error that contained it
    body = how.format(secret=str(secret_file)).split("\n")
    code = "try:\n" + "".join(f"    {line}\n" for line in body[:-1]) + f"    print({body[-1]})\n"
    code += "except OSError as exc:\n    print('contained', exc.errno)\n"
    result = attack(tool, code)
    assert_guard_was_off(result)
    assert SECRET not in result.text and "contained" in result.text, result.text


def test_the_sandbox_sees_none_of_the_trainers_files(tool: dict[str, Any]) -> None:
    """Its root holds /usr (read-only), a private /proc, a read-only /dev and the scratch tmpfs: no /etc, /home,
    /root, /work, /var, /run, no host /tmp or /dev/shm contents, no /sys."""
    result = attack(tool, "import os\nprint(sorted(os.listdir('/')))\nprint(sorted(os.listdir('/tmp')))\n"
                          "print(sorted(os.listdir('/dev/shm')))\nprint(os.path.exists(" + repr(hybridflow.__file__)
                          + "))")
    assert_guard_was_off(result)
    root, scratch, shm, package = result.text.splitlines()[1:5]
    assert set(eval(root)) <= {"bin", "dev", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}, root
    assert eval(scratch) == [] and eval(shm) == [] and package == "False"


@pytest.mark.parametrize("where", ["installed_package", "run_dir", "host_tmp", "dev_shm", "usr", "root"])
def test_nothing_outside_the_scratch_dir_can_be_written(tool: dict[str, Any], tmp_path: Path, where: str) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o777)  # even a world-writable host dir is out of reach: it is not in the namespace
    target = {"installed_package": Path(hybridflow.__file__).parent / "pwned.py", "run_dir": run_dir / "pwned",
              "host_tmp": Path(tempfile.gettempdir()) / f"pwned-{os.getpid()}", "dev_shm": Path("/dev/shm/pwned"),
              "usr": Path("/usr/pwned"), "root": Path("/pwned")}[where]
    code = (f"try:\n    open({str(target)!r}, 'w').write('x')\n    print('written')\n"
            "except OSError as exc:\n    print('contained', exc.errno)\n")
    result = attack(tool, code)
    assert_guard_was_off(result)
    assert not target.exists(), result.text
    # the sandbox's /tmp is its own scratch tmpfs: a write to a host /tmp path lands there, and vanishes with it
    assert ("written" if where == "host_tmp" else "contained") in result.text, result.text


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


def test_no_network_reaches_a_listener_on_loopback(tool: dict[str, Any], listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    code = ("import socket, os\nfor host in ('127.0.0.1', 'localhost', '::1', '10.0.0.1'):\n"
            "    try:\n        s = socket.create_connection((host, " + str(port) + "), timeout=2)\n"
            "        print('connected', host)\n    except OSError as exc:\n"
            "        print('contained', host, exc.errno)\n"
            "print(socket.if_nameindex())\n"
            "print(open('/proc/net/dev').read().count(':'))\n")
    result = attack(tool, code)
    assert_guard_was_off(result)
    assert "connected" not in result.text and result.text.count("contained") == 4, result.text
    assert "[(1, 'lo')]" in result.text  # the only interface: its own loopback, down
    with pytest.raises(BlockingIOError):
        listener.accept()


def test_the_trainers_environment_and_other_processes_are_invisible(tool: dict[str, Any],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDFLOW_REDTEAM_TOKEN", SECRET)
    victim = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(60)  # {SECRET}"])
    try:
        code = ("import os, signal\nprint(dict(os.environ))\n"
                "pids = [p for p in os.listdir('/proc') if p.isdigit()]\nprint('pids', len(pids))\n"
                "for p in pids:\n"
                "    for name in ('environ', 'cmdline'):\n"
                "        try:\n            print(open(f'/proc/{p}/{name}', 'rb').read())\n"
                "        except OSError as exc:\n            print('no', p, name, exc.errno)\n"
                f"for pid in ({victim.pid}, {os.getpid()}, 1):\n"
                "    try:\n        os.kill(pid, signal.SIGKILL)\n        print('signalled', pid)\n"
                "    except OSError as exc:\n        print('contained', pid, exc.errno)\n")
        result = attack(tool, code)
        assert_guard_was_off(result)
        assert SECRET not in result.text, result.text
        count = int(next(line for line in result.text.splitlines() if line.startswith("pids")).split()[1])
        assert count <= 3, result.text  # bubblewrap's init, the interpreter (and a reaped child at most)
        assert victim.poll() is None  # still running: the signal could not reach it
        assert f"signalled {victim.pid}" not in result.text or victim.pid in (1, 2)
    finally:
        victim.kill()
        victim.wait()


def _host_status(tag: str, timeout_s: float) -> dict[str, str]:
    """The ``/proc/<pid>/status`` fields, as the host sees them, of the one process whose argv holds ``tag``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in processes_tagged(tag):
            with contextlib.suppress(OSError):
                lines = Path(f"/proc/{pid}/status").read_text().splitlines()
                return dict(line.split(":\t", 1) for line in lines if ":\t" in line)
        time.sleep(0.02)
    raise AssertionError(f"no process tagged {tag} appeared within {timeout_s} s")


def test_the_code_runs_as_nobody_without_capabilities_or_new_privileges(tool: dict[str, Any]) -> None:
    """Inside: uid/gid 65534, no capabilities, no new privileges, the filter on, setuid/chroot refused. Outside (the
    host's /proc of the same process, exec'd into a tagged ``sleep``): uid 65534 for a root trainer, the trainer's
    own uid otherwise, never 0, and no capabilities there either."""
    tag = f"hf-redteam-uid-{os.getpid()}-{time.monotonic_ns()}"
    code = ("import os, sys\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
            "status = open('/proc/self/status').read().splitlines()\n"
            "print([l for l in status if l.startswith(('CapEff', 'CapPrm', 'CapBnd', 'NoNewPrivs', 'Seccomp:'))])\n"
            "for call in (lambda: os.setuid(0), lambda: os.setgid(0), lambda: os.chroot('/tmp')):\n"
            "    try:\n        call()\n        print('escalated')\n    except OSError as exc:\n"
            "        print('contained', exc.errno)\n"
            f"sys.stdout.flush()\nos.execv('/bin/sleep', ['{tag}', '30'])\n")

    async def scenario() -> tuple[ToolResult, dict[str, str]]:
        call = asyncio.ensure_future(call_tool(tool, "python", {"code": DISABLE_GUARD + code}, timeout_s=4))
        host = await asyncio.to_thread(_host_status, tag, 4)
        return await call, host

    result, host = asyncio.run(scenario())
    assert result.status == "timeout" and result.details["isolation"] == "bubblewrap"
    expected = str(SANDBOX_UID if os.geteuid() == 0 else os.geteuid())
    assert host["Uid"].split() == [expected] * 4 and host["Gid"].split()[0] == str(
        SANDBOX_UID if os.geteuid() == 0 else os.getegid()), host
    assert "0" not in host["Uid"].split() and host["CapEff"] == host["CapPrm"] == "0000000000000000", host
    assert host["NoNewPrivs"] == "1" and host["Seccomp"] == "2", host


#: (name, arguments) of syscalls the filter denies, as raw calls through ctypes: each must fail with EPERM
DENIED_CALLS = {
    "ptrace": "16, 1, 0, 0",  # PTRACE_ATTACH to init
    "unshare": "0x10000000",  # CLONE_NEWUSER
    "mount": "b'none', b'/tmp', b'tmpfs', 0, None",
    "keyctl": "0, 0, 0, 0, 0",
    "bpf": "0, None, 0",
    "setns": "0, 0",
    "perf_event_open": "None, 0, -1, -1, 0",
    "io_uring_setup": "1, None",
    "init_module": "None, 0, b''",
}


def test_raw_syscalls_through_ctypes_are_filtered(tool: dict[str, Any]) -> None:
    import platform

    numbers = {"x86_64": {"ptrace": 101, "unshare": 272, "mount": 165, "keyctl": 250, "bpf": 321, "setns": 308,
                          "perf_event_open": 298, "io_uring_setup": 425, "init_module": 175},
               "aarch64": {"ptrace": 117, "unshare": 97, "mount": 40, "keyctl": 219, "bpf": 280, "setns": 268,
                           "perf_event_open": 241, "io_uring_setup": 425, "init_module": 105}}.get(platform.machine())
    if numbers is None:
        pytest.skip(f"no syscall numbers written down for {platform.machine()}")
    code = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    for name, arguments in DENIED_CALLS.items():
        code += (f"ctypes.set_errno(0)\nrc = libc.syscall({numbers[name]}, {arguments})\n"
                 f"print('{name}', rc, ctypes.get_errno())\n")
    result = attack(tool, code)
    assert_guard_was_off(result)
    outcomes = {line.split()[0]: line.split()[1:] for line in result.text.splitlines()[1:]}
    assert outcomes == {name: ["-1", str(errno.EPERM)] for name in DENIED_CALLS}, result.text


def test_a_fork_and_thread_flood_hits_the_process_cap(tool: dict[str, Any]) -> None:
    code = ("import os, threading, time\nforked = 0\n"
            "try:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n            os._exit(0)\n"
            "        forked += 1\nexcept OSError as exc:\n    print('fork refused after', forked, exc.errno)\n"
            "threads = 0\ntry:\n    while True:\n        threading.Thread(target=time.sleep, args=(30,), daemon=True)"
            ".start()\n        threads += 1\nexcept RuntimeError as exc:\n    print('thread refused after', threads)\n"
            "sys.stdout.flush()\nos._exit(0)\n")
    result = attack(tool, "import sys\nsys.stdout.flush()\n" + code)
    assert_guard_was_off(result)
    lines = result.text.splitlines()
    forked = int(lines[1].split()[3])
    assert lines[1].startswith("fork refused after") and lines[1].split()[4] == str(errno.EAGAIN)
    assert forked <= 8 and lines[2].startswith("thread refused after"), result.text


def test_sleeping_past_the_timeout_leaves_no_process_behind(tool: dict[str, Any]) -> None:
    """Children in their own session, exec'd into ``sleep`` under a tag unique to this call, die with the call."""
    tag = f"hf-redteam-{os.getpid()}-{time.monotonic_ns()}"
    code = ("import os, time\nfor i in range(3):\n    if os.fork() == 0:\n        os.setsid()\n"
            f"        os.execv('/bin/sleep', ['{tag}', '120'])\nprint('forked')\ntime.sleep(120)\n")
    started = time.monotonic()
    result = attack(tool, code, timeout_s=2)
    assert result.status == "timeout" and time.monotonic() - started < 15, result
    deadline = time.monotonic() + 5
    while processes_tagged(tag) and time.monotonic() < deadline:  # a SIGKILLed namespace is reaped asynchronously
        time.sleep(0.05)
    assert processes_tagged(tag) == []


def test_a_disk_flood_fills_only_the_capped_scratch_dir(tool: dict[str, Any]) -> None:
    code = ("written = 0\ntry:\n    for i in range(64):\n        with open(f'f{i}', 'wb') as out:\n"
            "            out.write(b'x' * (2 * 2**20))\n        written += 2\nexcept OSError as exc:\n"
            "    print('full after', written, 'MiB', exc.errno)\n")
    result = attack(tool, code)
    assert_guard_was_off(result)
    line = result.text.splitlines()[1]
    assert line.startswith("full after") and int(line.split()[2]) <= 8 and line.split()[4] == str(errno.ENOSPC)


def test_memory_and_cpu_are_capped(tool: dict[str, Any]) -> None:
    memory = attack(tool, "x = bytearray(1024 * 2**20)\n")
    assert_guard_was_off(memory)
    assert memory.status == "error" and "MemoryError" in memory.text
    started = time.monotonic()
    cpu = attack(tool, "while True:\n    pass\n", timeout_s=60)
    assert_guard_was_off(cpu)
    assert cpu.status == "error" and "CPU time limit" in cpu.text and time.monotonic() - started < 30


def test_nothing_is_left_in_the_hosts_temp_dir(tool: dict[str, Any], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = attack(tool, "open('left.txt', 'w').write('x')\nprint('ok')\n")
    assert result.text.endswith("ok") and list(tmp_path.iterdir()) == []


def test_without_the_sandbox_the_tool_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail closed: with bwrap off PATH, building the tool raises, naming what is missing and the fix; the explicit
    opt-in builds it, warns, and its results say ``unisolated``."""
    from hybridflow.errors import SandboxUnavailableError
    from hybridflow.tools import isolation
    from hybridflow.tools.python_tool import UnisolatedToolWarning

    isolation.isolation_status.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setenv("PATH", "/nonexistent")
            with pytest.raises(SandboxUnavailableError, match=r"bwrap \(bubblewrap\) is not on PATH.*apt-get "
                               r"install bubblewrap.*unsafe_allow_unisolated=true"):
                build_tools(["python"])
            with pytest.warns(UnisolatedToolWarning, match="WITHOUT kernel isolation"):
                unsafe = PythonTool(unsafe_allow_unisolated=True)
            result = asyncio.run(unsafe.call({"code": "print(6 * 7)"}, timeout_s=20))
            assert (result.text, result.details["isolation"]) == ("42", "unisolated")
            # the run's manifest records the opt-in per tool (and the console warned again while building it)
            config = load_config(EXAMPLES / "grpo_tool_calc.yaml", [
                'rollout.multi_turn.tools=["calculator", "python"]',
                'rollout.multi_turn.tool_options={"python": {"unsafe_allow_unisolated": true}}'])
            with pytest.warns(UnisolatedToolWarning):
                manifest = build_manifest(config, protocols={}, mapping={})
            assert manifest["tools"] == {"calculator": "in-process", "python": "unisolated"}
    finally:
        isolation.isolation_status.cache_clear()
    assert isolation.isolation_status().available
    assert build_manifest(load_config(EXAMPLES / "grpo_tool_calc.yaml", ['rollout.multi_turn.tools=["python"]']),
                          protocols={}, mapping={})["tools"] == {"python": "bubblewrap"}


def test_the_scratch_dir_works_for_honest_code(tool: dict[str, Any]) -> None:
    code = ("import json, os, tempfile\nopen('notes.txt', 'w').write('hello')\n"
            "with tempfile.NamedTemporaryFile('w', delete=False) as f:\n    f.write('x')\n"
            "print(open('notes.txt').read(), os.getcwd(), os.environ['HOME'], len(os.listdir('.')))\n")
    result = asyncio.run(call_tool(tool, "python", {"code": code}, timeout_s=20))
    assert result.status == "ok" and result.text == "hello /tmp /tmp 2", result.text

