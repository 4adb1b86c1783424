"""The single controller over Ray: resource pools, worker groups, dispatch declarations, futures and the watchdog.

This is the only package that imports Ray. What the workers compute (engines, algorithms) and which protocols
exist (:mod:`hybridflow.transfer`) are left to others.
"""

from __future__ import annotations

from hybridflow.controller import security as _security  # noqa: F401  (must run before Ray is imported)
from hybridflow.controller.decorator import DISPATCH_ATTRIBUTE, Dispatch, dispatch_of, register
from hybridflow.controller.future import BatchFuture
from hybridflow.controller.group import BoundMethod, RoleHandle, WorkerGroup
from hybridflow.controller.park import release_parked
from hybridflow.controller.pool import ResourcePool
from hybridflow.controller.records import CallObserver, CallRecord
from hybridflow.controller.runtime import DEFAULT_OBJECT_STORE_BYTES, init_ray, shutdown_ray
from hybridflow.controller.worker import Worker, WorkerContext, current_context

__all__ = [
    "init_ray",
    "shutdown_ray",
    "release_parked",
    "DEFAULT_OBJECT_STORE_BYTES",
    "ResourcePool",
    "WorkerGroup",
    "RoleHandle",
    "BoundMethod",
    "Worker",
    "WorkerContext",
    "current_context",
    "register",
    "Dispatch",
    "dispatch_of",
    "DISPATCH_ATTRIBUTE",
    "BatchFuture",
    "CallRecord",
    "CallObserver",
]
