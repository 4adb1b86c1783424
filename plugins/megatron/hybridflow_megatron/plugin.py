"""Hook implementations of hybridflow-megatron; imports no backend at module import."""

from __future__ import annotations

from hybridflow.hookspecs import hookimpl


@hookimpl
def hybridflow_report_capabilities() -> dict[str, str]:
    return {"status": "registers nothing yet"}
