"""Hook implementations of the core itself: what hybridflow registers without any plugin installed.

Registered first by :func:`hybridflow.plugins.get_plugin_manager`; plugins add to the same registries.
"""

from __future__ import annotations

from typing import Any

from hybridflow.hookspecs import hookimpl


@hookimpl
def hybridflow_register_transfer_protocols(*, registry: Any) -> None:
    """The built-in transfer protocols (``one_to_all``, ``dp_compute``, ``mesh``, ...).

    See :mod:`hybridflow.transfer`.
    """
    from hybridflow.transfer.builtin_protocols import BUILTIN_PROTOCOLS

    for name, protocol in BUILTIN_PROTOCOLS.items():
        registry.register(name, protocol)


@hookimpl
def hybridflow_register_tools(*, registry: Any) -> None:
    """The built-in tools: ``python`` and ``calculator`` (sandboxed), ``search`` (a local corpus file).

    See :mod:`hybridflow.tools`.
    """
    from hybridflow.tools.python_tool import CalculatorTool, PythonTool
    from hybridflow.tools.search import SearchTool

    registry.register("python", PythonTool)
    registry.register("calculator", CalculatorTool)
    registry.register("search", SearchTool)
