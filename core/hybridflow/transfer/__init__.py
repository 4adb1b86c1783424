"""Transfer protocols: how a worker method's inputs are split to ranks and its outputs gathered back.

This package defines the contract, the built-ins and the user-facing :func:`register`; the controller
(:mod:`hybridflow.controller`) executes protocols and moves the bytes, and plugins add protocols through the
``hybridflow_register_transfer_protocols`` hook, which fills the same registry.
"""

from __future__ import annotations

from typing import Any

from hybridflow import registries
from hybridflow.transfer.builtin_protocols import (
    BUILTIN_PROTOCOLS,
    AllToAll,
    DataParallelCompute,
    GenerationMesh,
    Mesh,
    OneToAll,
    RankZero,
    concat_or_list,
)
from hybridflow.transfer.concat import PARALLEL_COPY_BYTES, concat_batches
from hybridflow.transfer.protocol import (
    RankInput,
    RowSplittable,
    TransferContext,
    TransferProtocol,
    is_row_splittable,
    split_rows,
)

__all__ = [
    "TransferProtocol",
    "TransferContext",
    "RankInput",
    "RowSplittable",
    "is_row_splittable",
    "split_rows",
    "concat_or_list",
    "concat_batches",
    "PARALLEL_COPY_BYTES",
    "OneToAll",
    "AllToAll",
    "DataParallelCompute",
    "RankZero",
    "GenerationMesh",
    "Mesh",
    "BUILTIN_PROTOCOLS",
    "register",
    "validate_protocol",
    "get_protocol",
    "protocol_names",
]

_REQUIRED = ("distribute", "collect_ranks", "collect")


def register(name: str, protocol: Any, *, replace: bool = False) -> Any:
    """Register ``protocol`` under ``name`` from user code (same registry the plugin hook fills). Stability: public.

    Raises :class:`TypeError` if it lacks ``distribute``/``collect_ranks``/``collect``/``concatenates`` and
    :class:`~hybridflow.errors.DuplicateNameError` if the name is taken (unless ``replace=True``).
    """
    validate_protocol(name, protocol)
    _ensure_core_protocols()
    return registries.transfer_protocols.register(name, protocol, owner="user code", replace=replace)


def validate_protocol(name: str, protocol: Any) -> None:
    """Raise :class:`TypeError` naming what ``protocol`` lacks to implement :class:`TransferProtocol`."""
    missing = [attribute for attribute in _REQUIRED if not callable(getattr(protocol, attribute, None))]
    if not isinstance(getattr(protocol, "concatenates", None), bool):
        missing.append("concatenates (bool attribute)")
    if missing:
        raise TypeError(
            f'transfer protocol "{name}" ({type(protocol).__name__}) does not implement TransferProtocol: missing '
            f"{', '.join(missing)}. Fix: implement them (see hybridflow.transfer.TransferProtocol)"
        )


def get_protocol(name: str) -> Any:
    """The protocol registered under ``name``; unknown names raise listing the known ones."""
    _ensure_core_protocols()
    return registries.transfer_protocols.get(name)


def protocol_names() -> list[str]:
    _ensure_core_protocols()
    return registries.transfer_protocols.names()


def _ensure_core_protocols() -> None:
    """Make sure the core's hook implementations ran (they register the built-in protocols)."""
    from hybridflow.plugins import get_plugin_manager

    get_plugin_manager()
