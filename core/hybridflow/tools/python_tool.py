"""The built-in ``python`` and ``calculator`` tools: ``python`` runs model-written code in the kernel-enforced
sandbox of :mod:`hybridflow.tools.sandbox` (what it enforces is documented there and in docs/guide/agent.md) and refuses
to start where that sandbox cannot be built, unless its config opts out; ``calculator`` evaluates arithmetic
in-process.

Stability: public. They only run code; parsing calls out of model text is :mod:`hybridflow.agent`'s business.
"""

from __future__ import annotations

import ast
import logging
import operator
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from hybridflow.errors import SandboxUnavailableError
from hybridflow.tools.base import ToolResult, tool_schema
from hybridflow.tools.isolation import IsolationMode, isolation_status
from hybridflow.tools.sandbox import SandboxLimits, SandboxOutcome, run_sandboxed_python

__all__ = ["PythonTool", "CalculatorTool", "UnisolatedToolWarning", "resolve_isolation"]

logger = logging.getLogger(__name__)

_ARITHMETIC_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
                     ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd)


def _result(outcome: SandboxOutcome, timeout_s: float) -> ToolResult:
    details = {"returncode": outcome.returncode, "isolation": outcome.isolation}
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


def resolve_isolation(tool: str, *, unsafe_allow_unisolated: bool) -> IsolationMode:
    """The isolation a code-running tool gets here: ``bubblewrap`` where the kernel boundary can be built; else
    ``unisolated`` if the config opted in (warned about, every time), else :class:`SandboxUnavailableError`."""
    status = isolation_status()
    if status.available:
        return "bubblewrap"
    if not unsafe_allow_unisolated:
        raise SandboxUnavailableError(
            f"tool {tool!r} runs model-written code and needs the kernel-enforced sandbox, which is unavailable "
            f"here: {status.reason}. To run it without isolation anyway (the code can then read and write "
            f"everything the trainer's user can), set rollout.multi_turn.tool_options.{tool}.unsafe_allow_unisolated"
            "=true; the run manifest records it")
    message = (f"UNSAFE: tool {tool!r} runs model-written code WITHOUT kernel isolation "
               f"(unsafe_allow_unisolated=true; the sandbox is unavailable: {status.reason})")
    warnings.warn(message, UnisolatedToolWarning, stacklevel=3)
    logger.warning(message)
    return "unisolated"


class UnisolatedToolWarning(UserWarning):
    """A code-running tool was built without the kernel boundary (an explicit ``unsafe_allow_unisolated``)."""


class PythonTool:
    """Runs a Python snippet in a fresh sandboxed interpreter; prints the value of a bare expression.

    Options (``rollout.multi_turn.tool_options.python``): ``cpu_seconds``, ``memory_mb``, ``scratch_mb``,
    ``max_processes``, ``allow_fork``; ``unsafe_allow_unisolated`` runs it without the kernel boundary where that
    is unavailable (refused otherwise, at start-up). ``isolation`` says which boundary its calls run under; every
    result's ``details["isolation"]`` repeats it.
    """

    name = "python"

    def __init__(self, *, cpu_seconds: int = 5, memory_mb: int = 512, scratch_mb: int = 16, max_processes: int = 16,
                 allow_fork: bool = False, unsafe_allow_unisolated: bool = False) -> None:
        self.isolation: IsolationMode = resolve_isolation(self.name, unsafe_allow_unisolated=unsafe_allow_unisolated)
        self.limits = SandboxLimits(cpu_seconds=cpu_seconds, memory_bytes=memory_mb * 2**20,
                                    scratch_bytes=scratch_mb * 2**20, max_processes=max_processes,
                                    allow_fork=allow_fork, isolation=self.isolation)
        self.description = tool_schema(
            self.name, "Run Python code (no network, no files outside a scratch dir); a bare expression prints "
            "its value.", {"code": {"type": "string", "description": "Python source"}}, ["code"])

    async def call(self, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult(text='Error: python needs {"code": "<python source>"}.', status="bad_call",
                              details={"isolation": self.isolation})
        return _result(await run_sandboxed_python(code, timeout_s=timeout_s, limits=self.limits), timeout_s)


#: the largest integer (in bits) a calculator expression may produce or multiply into: 10**1200 and beyond are refused
MAX_CALCULATOR_BITS = 4096


_OPERATIONS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _bits(value: int | float) -> int:
    return value.bit_length() if isinstance(value, int) else 64


def _evaluate(node: ast.AST) -> int | float:
    """The value of a whitelisted arithmetic tree, refusing results wider than :data:`MAX_CALCULATOR_BITS` before
    computing them (so ``9**9**9`` costs nothing)."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand)
        return -operand if isinstance(node.op, ast.USub) else +operand
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0 \
                and abs(left) > 1 and _bits(left) * right > MAX_CALCULATOR_BITS:
            raise OverflowError(f"the result would have more than {MAX_CALCULATOR_BITS} bits")
        if isinstance(node.op, ast.Mult) and _bits(left) + _bits(right) > MAX_CALCULATOR_BITS:
            raise OverflowError(f"the result would have more than {MAX_CALCULATOR_BITS} bits")
        operation = _OPERATIONS.get(type(node.op))
        if operation is not None:
            value: int | float | complex = operation(left, right)
            if isinstance(value, complex):
                raise ValueError("the result is a complex number")
            return value
    raise ValueError(f"only arithmetic is allowed, found {type(node).__name__}")


class CalculatorTool:
    """Evaluates one arithmetic expression (numbers, + - * / // % ** and parentheses) exactly.

    Only those syntax nodes are accepted and integer sizes are bounded (:data:`MAX_CALCULATOR_BITS`) before any
    operation runs, so it evaluates in-process in microseconds: no code runs, nothing can hang or allocate much.
    (It used to start a sandboxed interpreter per call; 64 of those at once, from a rollout worker on a busy CPU,
    took longer than the tool timeout.) The python tool's options are accepted and ignored, so one options dict
    can serve both.
    """

    name = "calculator"

    def __init__(self, **_: Any) -> None:
        self.description = tool_schema(
            self.name, "Evaluate an arithmetic expression exactly, e.g. 123*456.",
            {"expression": {"type": "string", "description": "numbers, + - * / // % ** and parentheses"}},
            ["expression"])

    async def call(self, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolResult:
        expression = arguments.get("expression")
        if not isinstance(expression, (str, int, float)) or isinstance(expression, bool):
            return ToolResult(text='Error: calculator needs {"expression": "<arithmetic>"}.', status="bad_call")
        expression = str(expression)
        if len(expression) > 1000:
            return ToolResult(text="Error: the expression is longer than 1000 characters.", status="bad_call")
        try:
            tree = ast.parse(expression, mode="eval")
        except SyntaxError as exc:
            return ToolResult(text=f"Error: not an expression: {exc.msg}", status="bad_call")
        bad = next((node for node in ast.walk(tree) if not isinstance(node, _ARITHMETIC_NODES)), None)
        if bad is not None or any(isinstance(n, ast.Constant) and not isinstance(n.value, (int, float))
                                  for n in ast.walk(tree)):
            what = type(bad).__name__ if bad is not None else "a non-number constant"
            return ToolResult(text=f"Error: only arithmetic is allowed, found {what}.", status="bad_call")
        try:
            value = _evaluate(tree)
        except (ArithmeticError, ValueError, RecursionError) as exc:
            return ToolResult(text=f"Error: {type(exc).__name__}: {exc}", status="error")
        return ToolResult(text=str(value), status="ok")
