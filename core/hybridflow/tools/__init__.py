"""Tools an agent rollout can call: the :class:`Tool` protocol, :func:`call_tool`, the sandbox and the built-ins
(``python``, ``calculator``, ``search``), registered under ``hybridflow_register_tools``.

Stability: public. Plugins add tools through the hook; :func:`build_tools` builds a run's tools by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.tools.base import (
    MAX_OUTPUT_CHARS,
    TOOL_STATUSES,
    IsolatedTool,
    StatefulTool,
    Tool,
    ToolFactory,
    ToolResult,
    ToolStatus,
    call_tool,
    tool_schema,
)

__all__ = ["Tool", "StatefulTool", "ToolFactory", "ToolResult", "ToolStatus", "TOOL_STATUSES", "MAX_OUTPUT_CHARS",
           "call_tool", "tool_schema", "build_tools", "IsolatedTool", "tool_isolation"]


def build_tools(names: Sequence[str], options: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Tool]:
    """Build the named tools from the ``tools`` registry (``options[name]`` are each factory's keyword arguments)."""
    from hybridflow import registries
    from hybridflow.plugins import load_plugins

    load_plugins()
    options = options or {}
    tools: dict[str, Tool] = {}
    for name in names:
        factory = registries.tools.get(name)
        tool = factory(**dict(options.get(name, {})))
        tools[tool.name] = tool
    return tools


def tool_isolation(tools: Mapping[str, Tool]) -> dict[str, str]:
    """Each tool's boundary: its ``isolation`` if it runs model-written code (:class:`IsolatedTool`), else
    ``"in-process"`` (it runs no model code: ``calculator``, ``search``)."""
    return {name: tool.isolation if isinstance(tool, IsolatedTool) else "in-process" for name, tool in tools.items()}
