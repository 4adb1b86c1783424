"""The built-in tools and :func:`call_tool`: every failing, hanging or malicious call becomes tool-output text with a
status, never an exception, a hang or a process left behind."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import pytest

from hybridflow import registries
from hybridflow.plugin_listing import format_plugins
from hybridflow.plugins import load_plugins
from hybridflow.testing.processes import processes_tagged
from hybridflow.tools import ToolResult, build_tools, call_tool
from hybridflow.tools.python_tool import PythonTool
from hybridflow.tools.sandbox import SandboxLimits, namespace_isolation_available, run_sandboxed_python


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(r) for r in [
        {"title": "Paris", "text": "Paris is the capital of France."},
        {"title": "Rome", "text": "Rome is the capital of Italy and was founded on seven hills."},
        {"title": "Oslo", "text": "Oslo lies at the head of the Oslofjord."},
    ]))
    return build_tools(["python", "calculator", "search"], {"search": {"corpus": str(corpus), "top_k": 2}})


def test_tools_are_registered_and_listed() -> None:
    load_plugins()
    assert {"python", "calculator", "search"} <= set(registries.tools.names())
    assert "tool: calculator, python, search" in format_plugins([])


def test_calculator_is_exact(tools: dict[str, Any]) -> None:
    result = run(call_tool(tools, "calculator", {"expression": "123456789*987654321"}, timeout_s=10))
    assert (result.status, result.text) == ("ok", str(123456789 * 987654321))
    refused = run(call_tool(tools, "calculator", {"expression": "__import__('os').getcwd()"}, timeout_s=10))
    assert refused.status == "bad_call" and "only arithmetic" in refused.text


def test_python_runs_code_and_reports_exceptions(tools: dict[str, Any]) -> None:
    ok = run(call_tool(tools, "python", {"code": "x = [i * i for i in range(5)]\nprint(sum(x))"}, timeout_s=10))
    assert (ok.status, ok.text) == ("ok", "30")
    failed = run(call_tool(tools, "python", {"code": "1/0"}, timeout_s=10))
    assert failed.status == "error" and "ZeroDivisionError" in failed.text


def test_search_ranks_the_corpus(tools: dict[str, Any]) -> None:
    result = run(call_tool(tools, "search", {"query": "capital of Italy"}, timeout_s=5))
    assert result.status == "ok" and result.text.startswith("[1] Rome:")
    assert run(call_tool(tools, "search", {"query": "zebra"}, timeout_s=5)).text == "No results."


@pytest.mark.parametrize(("name", "arguments", "status", "says"), [
    ("nope", {}, "unknown_tool", "unknown tool 'nope'. Available tools: calculator, python, search"),
    (None, {}, "unknown_tool", "unknown tool None"),
    ("python", "{not json", "bad_call", "not valid JSON"),
    ("python", [1, 2], "bad_call", "must be a JSON object, got list"),
    ("python", {"source": "1"}, "bad_call", 'python needs {"code"'),
])
def test_bad_calls_become_text(tools: dict[str, Any], name: Any, arguments: Any, status: str, says: str) -> None:
    result = run(call_tool(tools, name, arguments, timeout_s=5))
    assert result.status == status and says in result.text


class _RaisingTool:
    """A tool that breaks the protocol by raising (a real tool would return an error result)."""

    name = "raising"
    description: Mapping[str, Any] = {}

    async def call(self, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolResult:
        raise RuntimeError("boom")


class _HangingTool:
    """A tool that ignores its timeout."""

    name = "hanging"
    description: Mapping[str, Any] = {}

    async def call(self, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolResult:
        await asyncio.sleep(3600)
        return ToolResult(text="never")


def test_raising_and_hanging_tools_become_text() -> None:
    tools: dict[str, Any] = {"raising": _RaisingTool(), "hanging": _HangingTool()}
    raised = run(call_tool(tools, "raising", {}, timeout_s=1))
    assert raised.status == "error" and "RuntimeError: boom" in raised.text
    started = time.perf_counter()
    hung = run(call_tool(tools, "hanging", {}, timeout_s=0.2))
    assert hung.status == "timeout" and time.perf_counter() - started < 3


def test_hang_past_timeout_is_killed(tools: dict[str, Any]) -> None:
    started = time.perf_counter()
    result = run(call_tool(tools, "python", {"code": "import time\ntime.sleep(60)"}, timeout_s=1))
    assert result.status == "timeout" and "timed out after 1 s" in result.text
    assert time.perf_counter() - started < 30


def test_busy_loop_hits_the_cpu_limit() -> None:
    tool = PythonTool(cpu_seconds=1)
    result = run(tool.call({"code": "while True: pass"}, timeout_s=120))  # ends at 1 CPU-second, however loaded
    assert result.status == "error" and "limit" in result.text


def test_memory_limit() -> None:
    tool = PythonTool(memory_mb=128)
    result = run(tool.call({"code": "x = bytearray(1024 * 2**20)"}, timeout_s=20))
    assert result.status == "error" and "MemoryError" in result.text


@pytest.mark.parametrize(("code", "event"), [
    ("open('/etc/passwd').read()", "open '/etc/passwd'"),
    ("import os\nos.listdir('/')", "os.listdir '/'"),
    ("open('../escape.txt', 'w').write('x')", "open '../escape.txt'"),
    ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)", "socket.getaddrinfo"),
    ("import _socket\n_socket.socket()", "socket.__new__"),
    ("import subprocess\nsubprocess.run(['ls'])", "subprocess.Popen"),
    ("import os\nos.fork()", "os.fork"),
    ("import ctypes", "ctypes.dlopen"),
])
def test_malicious_calls_are_denied(tools: dict[str, Any], code: str, event: str) -> None:
    result = run(call_tool(tools, "python", {"code": code}, timeout_s=10))
    assert result.status == "denied" and f"sandbox: denied {event}" in result.text, result.text


def test_files_inside_the_scratch_dir_work(tools: dict[str, Any]) -> None:
    code = "open('notes.txt', 'w').write('hello')\nprint(open('notes.txt').read())"
    assert run(call_tool(tools, "python", {"code": code}, timeout_s=10)).text == "hello"


@pytest.mark.skipif(not namespace_isolation_available(), reason="unshare cannot create namespaces here")
def test_unisolated_mode_has_no_network_below_the_audit_hook() -> None:
    """The opt-in ``unisolated`` mode's best effort: with the audit hook off, unshare's network namespace alone still
    leaves no route out (the kernel boundary's own checks are tests/core/tools/test_sandbox_redteam.py's)."""
    code = ("import socket\ns = socket.socket()\ns.settimeout(2)\ntry:\n    s.connect(('1.1.1.1', 80))\n"
            "except OSError as e:\n    print('unreachable', e.errno)")
    limits = SandboxLimits(audit_hook=False, isolation="unisolated")
    result = run(run_sandboxed_python(code, timeout_s=10, limits=limits))
    assert result.returncode == 0 and result.stdout.strip() in ("unreachable 101", "unreachable 22")


def _forking_code(tag: str) -> str:
    """Children that leave the process group (setsid) and become ``sleep`` processes named by ``tag``."""
    return ("import os, time\n"
            "for i in range(4):\n"
            "    if os.fork() == 0:\n"
            "        os.setsid()\n"
            f"        os.execv('/bin/sleep', ['{tag}', '120'])\n"
            "time.sleep(120)\n")


@pytest.mark.skipif(not namespace_isolation_available(), reason="unshare cannot create namespaces here")
def test_unisolated_mode_reaps_forked_children_only_with_unshare() -> None:
    """In the opt-in ``unisolated`` mode, children in their own session sleeping past the call are gone when the
    call returns if unshare gave it a PID namespace; without one (documented) the process-group kill misses them,
    which shows the check can fail."""
    tag = f"hf-fork-tag-{os.getpid()}-{time.monotonic_ns()}"
    # the audit hook would refuse fork and exec: turn it off to test the OS layer alone
    limits = SandboxLimits(allow_fork=True, audit_hook=False, isolation="unisolated")
    # the call times out (its code sleeps 120 s); 6 s leaves a loaded box room to set up the namespace first (one CI
    # run on a loaded box timed out at 1.5 s before it reported one)
    outcome = run(run_sandboxed_python(_forking_code(tag), timeout_s=6, limits=limits))
    assert outcome.timed_out and outcome.namespaced, outcome
    deadline = time.monotonic() + 5
    while processes_tagged(tag) and time.monotonic() < deadline:  # a SIGKILLed namespace is reaped asynchronously
        time.sleep(0.05)
    assert processes_tagged(tag) == []
    fallback = SandboxLimits(allow_fork=True, audit_hook=False, isolation="unisolated", isolate_namespaces=False)
    outcome = run(run_sandboxed_python(_forking_code(tag), timeout_s=6, limits=fallback))
    survivors = processes_tagged(tag)
    for pid in survivors:
        os.kill(pid, 9)
    assert not outcome.namespaced and len(survivors) == 4


def test_a_fork_bomb_is_contained(tools: dict[str, Any]) -> None:
    code = "import os\nwhile True:\n    os.fork()"
    result = run(call_tool(tools, "python", {"code": code}, timeout_s=5))
    assert result.status == "denied" and "os.fork" in result.text


def test_concurrent_calls_overlap(tools: dict[str, Any]) -> None:
    """Four calls sleeping 3 s each run at the same time: every one starts before any ends (CLOCK_MONOTONIC is
    the same clock in the children). Run one after another they could not; 3 s, not 0.5 s: one CI run on a loaded
    box started the four sandboxes more than 0.5 s apart."""
    code = "import time\nstart = time.monotonic()\ntime.sleep(3)\nprint(start, time.monotonic())"

    async def many() -> list[ToolResult]:
        return list(await asyncio.gather(*[call_tool(tools, "python", {"code": code}, timeout_s=60)
                                           for _ in range(4)]))

    spans = [tuple(float(x) for x in result.text.split()) for result in run(many())]
    assert max(start for start, _ in spans) < min(end for _, end in spans)


def test_a_plugin_registers_a_tool() -> None:
    """A plugin's ``hybridflow_register_tools`` adds a tool that ``build_tools`` builds (with its options), the
    listing shows it under the plugin, and a duplicate name is refused naming both owners."""
    import types

    from hybridflow import plugins
    from hybridflow.errors import DuplicateNameError
    from hybridflow.plugins import PluginInfo

    module = types.ModuleType("echo_tool_plugin")
    exec(
        "from hybridflow.hookspecs import hookimpl\n"
        "from hybridflow.tools import ToolResult\n"
        "class Echo:\n"
        "    name = 'echo'\n"
        "    description = {}\n"
        "    def __init__(self, prefix=''):\n"
        "        self.prefix = prefix\n"
        "    async def call(self, arguments, *, timeout_s):\n"
        "        return ToolResult(text=self.prefix + str(arguments.get('text')))\n"
        "@hookimpl\ndef hybridflow_register_tools(registry):\n"
        "    registry.register('echo', Echo)\n",
        module.__dict__,
    )
    try:
        info = plugins.register_plugin(module, name="echo_tools")
        assert info.registered == {"tool": ["echo"]}
        tools = build_tools(["echo"], {"echo": {"prefix": "> "}})
        assert run(call_tool(tools, "echo", {"text": "hi"}, timeout_s=1)).text == "> hi"
        listing = format_plugins([PluginInfo(name="echo_tools", distribution="echo", version="1",
                                             entry_point="x", registered=info.registered)])
        assert "tool: echo" in listing
        with pytest.raises(DuplicateNameError, match='Tool "python" registered twice: by hybridflow \\(core\\)'):
            registries.tools.register("python", object, owner="echo")
    finally:
        registries.tools.unregister("echo")
        plugins.get_plugin_manager().unregister(name="echo_tools")


@pytest.mark.parametrize(("expression", "status", "says"), [
    ("9**9**9", "error", "more than 4096 bits"),  # refused before it is computed: no hang
    ("(10**1000)*(10**1000)*(10**1000)*(10**1000)*(10**1000)", "error", "more than 4096 bits"),
    ("1/0", "error", "ZeroDivisionError"),
    ("(-8)**0.5", "error", "complex"),
    ("7/2", "ok", "3.5"),
    ("2**-2 + -(3)", "ok", "-2.75"),
])
def test_calculator_bounds_and_errors(tools: dict[str, Any], expression: str, status: str, says: str) -> None:
    result = run(call_tool(tools, "calculator", {"expression": expression}, timeout_s=5))
    assert result.status == status and says in result.text and result.seconds < 1.0
