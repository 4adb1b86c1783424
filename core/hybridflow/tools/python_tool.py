"""The built-in ``python`` and ``calculator`` tools: code or an arithmetic expression run in the sandbox of
:mod:`hybridflow.tools.sandbox` (what it enforces is documented there and in docs/agent.md).

Stability: public. They only run code; parsing calls out of model text is :mod:`hybridflow.agent`'s business.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

from hybridflow.tools.base import ToolResult, tool_schema
from hybridflow.tools.sandbox import SandboxLimits, SandboxOutcome, run_sandboxed_python

__all__ = ["PythonTool", "CalculatorTool"]

_ARITHMETIC_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
                     ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd)


def _result(outcome: SandboxOutcome, timeout_s: float) -> ToolResult:
    details = {"returncode": outcome.returncode, "namespaced": outcome.namespaced}
    if outcome.timed_out:
        return ToolResult(text=f"Error: timed out after {timeout_s:g} s (the process and its children were killed).",
                          status="timeout", seconds=outcome.seconds, details=details)
    if outcome.returncode == 0:
        return ToolResult(text=outcome.stdout.rstrip("\n"), status="ok", seconds=outcome.seconds, details=details)
    text = (outcome.stdout + outcome.stderr).strip()
    if not text:  # killed without a word: a hard limit (CPU stuck in C code, or the kernel's memory limit)
        text = f"Error: killed (exit status {outcome.returncode}): a CPU-time or memory limit was hit"
    return ToolResult(text=text, status="denied" if outcome.denied else "error", seconds=outcome.seconds,
                      details=details)


class PythonTool:
    """Runs a Python snippet in a fresh sandboxed interpreter; prints the value of a bare expression."""

    name = "python"

    def __init__(self, *, cpu_seconds: int = 5, memory_mb: int = 512, allow_fork: bool = False,
                 isolate_namespaces: bool = True, **_: Any) -> None:
        self.limits = SandboxLimits(cpu_seconds=cpu_seconds, memory_bytes=memory_mb * 2**20, allow_fork=allow_fork,
                                    isolate_namespaces=isolate_namespaces)
        self.description = tool_schema(
            self.name, "Run Python code (no network, no files outside a scratch dir); a bare expression prints "
            "its value.", {"code": {"type": "string", "description": "Python source"}}, ["code"])

    async def call(self, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult(text='Error: python needs {"code": "<python source>"}.', status="bad_call")
        return _result(await run_sandboxed_python(code, timeout_s=timeout_s, limits=self.limits), timeout_s)


class CalculatorTool:
    """Evaluates one arithmetic expression (numbers, + - * / // % ** and parentheses) in the sandbox."""

    name = "calculator"

    def __init__(self, *, cpu_seconds: int = 2, memory_mb: int = 256, isolate_namespaces: bool = True,
                 **_: Any) -> None:
        self.limits = SandboxLimits(cpu_seconds=cpu_seconds, memory_bytes=memory_mb * 2**20,
                                    isolate_namespaces=isolate_namespaces)
        self.description = tool_schema(
            self.name, "Evaluate an arithmetic expression exactly, e.g. 123*456.",
            {"expression": {"type": "string", "description": "numbers, + - * / // % ** and parentheses"}},
            ["expression"])

    async def call(self, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolResult:
        expression = arguments.get("expression")
        if not isinstance(expression, (str, int, float)) or isinstance(expression, bool):
            return ToolResult(text='Error: calculator needs {"expression": "<arithmetic>"}.', status="bad_call")
        expression = str(expression)
        try:
            tree = ast.parse(expression, mode="eval")
        except SyntaxError as exc:
            return ToolResult(text=f"Error: not an expression: {exc.msg}", status="bad_call")
        bad = next((node for node in ast.walk(tree) if not isinstance(node, _ARITHMETIC_NODES)), None)
        if bad is not None or any(isinstance(n, ast.Constant) and not isinstance(n.value, (int, float))
                                  for n in ast.walk(tree)):
            what = type(bad).__name__ if bad is not None else "a non-number constant"
            return ToolResult(text=f"Error: only arithmetic is allowed, found {what}.", status="bad_call")
        return _result(await run_sandboxed_python(expression, timeout_s=timeout_s, limits=self.limits), timeout_s)
