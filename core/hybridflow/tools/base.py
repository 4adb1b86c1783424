"""The ``Tool`` protocol an agent rollout calls, its result type, and :func:`call_tool`, which turns any failure of a
call (bad arguments, unknown tool, exception, hang past the timeout) into tool-output text with a status.

Stability: public (tool plugins code against it). Running the conversation that issues the calls is
:mod:`hybridflow.agent`'s business; sandboxing a call is each tool's own.
"""

from __future__ import annotations

import asyncio
import json
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "Tool",
    "StatefulTool",
    "IsolatedTool",
    "ToolFactory",
    "ToolResult",
    "ToolStatus",
    "TOOL_STATUSES",
    "call_tool",
    "tool_schema",
    "MAX_OUTPUT_CHARS",
]

#: how a call ended; everything but ``ok`` counts as a tool error in the rollout metrics
ToolStatus = Literal["ok", "error", "timeout", "bad_call", "unknown_tool", "denied"]
TOOL_STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "bad_call", "unknown_tool", "denied")
#: tool output longer than this is cut (with a note) before it is tokenized into the conversation
MAX_OUTPUT_CHARS = 2000


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolResult:
    """What a call returns to the model (``text``) and how it ended (``status``; ``seconds`` of wall time)."""

    text: str
    status: ToolStatus = "ok"
    seconds: float = 0.0
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_error(self) -> bool:
        return self.status != "ok"


@runtime_checkable
class Tool(Protocol):
    """A callable tool (stability: public).

    ``name`` is what the model writes in a call, ``description`` the OpenAI/Hermes function schema
    (``{"type": "function", "function": {"name", "description", "parameters": <JSON schema>}}``) rendered into the
    prompt through the tokenizer's chat template. ``call`` must return within about ``timeout_s`` and must not
    raise for bad input: it returns a :class:`ToolResult` with an error status instead (:func:`call_tool` still
    guards against tools that break this rule).
    """

    name: str
    description: Mapping[str, Any]

    async def call(self, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolResult: ...


@runtime_checkable
class StatefulTool(Tool, Protocol):
    """A tool with per-conversation state, as verl's ``BaseTool`` (stability: experimental).

    The agent loop calls ``create(**create_kwargs)`` at the conversation's first call of the tool (``create_kwargs``
    from the row's ``extra_info.tools_kwargs[name]``), passes what it returned as ``call(..., instance=...)`` with
    the row's ``execute_kwargs``, and ``release(instance)`` when the conversation ends.
    """

    async def create(self, **create_kwargs: Any) -> Any: ...

    async def call(self, arguments: Mapping[str, Any], *, timeout_s: float, **call_kwargs: Any) -> ToolResult: ...

    async def release(self, instance: Any) -> None: ...


@runtime_checkable
class IsolatedTool(Tool, Protocol):
    """A tool that runs model-written code and says under which boundary (stability: public).

    ``isolation`` is ``"bubblewrap"`` (the kernel boundary of :mod:`hybridflow.tools.isolation`) or ``"unisolated"``
    (an explicit ``unsafe_allow_unisolated`` opt-in); the run manifest records it per tool and each call's
    ``ToolResult.details["isolation"]`` repeats it. A plugin tool that runs model code should offer the same.
    """

    isolation: str


class ToolFactory(Protocol):
    """What the ``tools`` registry holds: ``factory(**options) -> Tool`` (options from ``rollout.multi_turn``)."""

    def __call__(self, **options: Any) -> Tool: ...


def tool_schema(name: str, description: str, properties: Mapping[str, Any], required: list[str]) -> dict[str, Any]:
    """An OpenAI-style function schema (what chat templates render under ``tools=``)."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": dict(properties), "required": list(required)}}}


def _clip(text: str) -> str:
    if len(text) <= MAX_OUTPUT_CHARS:
        return text
    return text[:MAX_OUTPUT_CHARS] + f"\n[output cut: {len(text) - MAX_OUTPUT_CHARS} more characters]"


async def call_tool(tools: Mapping[str, Tool], name: Any, arguments: Any, *, timeout_s: float,
                    call_kwargs: Mapping[str, Any] | None = None) -> ToolResult:
    """Run one parsed call and always return a :class:`ToolResult`; never raises (except cancellation).

    ``name``/``arguments`` come from model text, so anything is possible: a non-string name, an unknown tool,
    arguments that are not a JSON object (a JSON string holding an object is accepted), a tool that raises or
    hangs. A tool gets ``timeout_s`` plus one second of grace before it is cancelled here. ``call_kwargs`` go to
    a stateful tool's ``call`` (its ``instance`` from ``create`` and the row's ``execute_kwargs``).
    """
    started = time.perf_counter()

    def done(text: str, status: ToolStatus, **details: Any) -> ToolResult:
        return ToolResult(text=_clip(text), status=status, seconds=time.perf_counter() - started, details=details)

    if not isinstance(name, str) or name not in tools:
        known = ", ".join(sorted(tools)) or "(none)"
        return done(f"Error: unknown tool {name!r}. Available tools: {known}.", "unknown_tool")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return done(f"Error: arguments of {name} are not valid JSON ({exc.msg} at {exc.pos}).", "bad_call")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return done(f"Error: arguments of {name} must be a JSON object, got {type(arguments).__name__}.", "bad_call")
    try:
        running = tools[name].call(arguments, timeout_s=timeout_s, **dict(call_kwargs or {}))
        result = await asyncio.wait_for(running, timeout=timeout_s + 1.0)
    except asyncio.TimeoutError:
        return done(f"Error: {name} did not answer within {timeout_s:g} s and was stopped.", "timeout")
    except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation, not the trainer's crash
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return done(f"Error: {name} failed: {last}", "error", exception=type(exc).__name__)
    if not isinstance(result, ToolResult):
        return done(f"Error: {name} returned {type(result).__name__}, not a ToolResult.", "error")
    return ToolResult(text=_clip(result.text), status=result.status, seconds=time.perf_counter() - started,
                      details=result.details)
