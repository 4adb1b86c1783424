"""``Worker``: the optional base class of worker roles, giving each instance its rank and distributed environment.

It does not start torch.distributed (the worker or its engine calls ``init_process_group`` when it needs to);
the worker host (:mod:`hybridflow.controller.host`) sets the context before constructing roles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hybridflow.engines import MeshInfo

__all__ = ["Worker", "WorkerContext", "current_context", "set_context"]


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerContext:
    """Where this process sits in its worker group."""

    group: str = ""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def apply_environment(self) -> None:
        """Export the torch.distributed environment variables (``env://`` initialization)."""
        os.environ.update({
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        })


_context = WorkerContext()


def set_context(context: WorkerContext) -> None:
    """Set this process's worker context and export its torch.distributed environment (host use only)."""
    global _context
    _context = context
    context.apply_environment()


def current_context() -> WorkerContext:
    return _context


class Worker:
    """Base class of worker roles: ``rank``, ``world_size``, ``local_rank`` and a default ``mesh_info``.

    Stability: public. Subclasses are plain classes whose public methods carry ``@register``; colocated roles in
    one process share the same context (they occupy the same slot).
    """

    @property
    def rank(self) -> int:
        return _context.rank

    @property
    def world_size(self) -> int:
        return _context.world_size

    @property
    def local_rank(self) -> int:
        return _context.local_rank

    @property
    def master_addr(self) -> str:
        return _context.master_addr

    @property
    def master_port(self) -> int:
        return _context.master_port

    def mesh_info(self) -> MeshInfo:
        """This rank's position for protocol ``mesh``; default: pure data parallel, every rank collected."""
        return MeshInfo(dp_rank=self.rank, dp_size=self.world_size, is_collect=True)

    def reusable_process(self) -> bool:
        """Whether this process may host another group's roles once this role is closed (a finished group's
        processes are parked for the next group on the same pool shape: :mod:`hybridflow.controller.park`). The
        host drops the role, destroys torch.distributed's process groups and restores the environment, ``sys.path``,
        torch's global flags and default RNG seed; return True when that is all the role leaves behind (no
        module-level registry it filled, no global of a library it set up: DeepSpeed's, Megatron's, vLLM's).
        Default no, as for a plain class without this method: the group kills the process, as without parking. The
        built-in roles answer from their engines' info records (``reusable_process``, hybridflow.engines)."""
        return False

    def close(self) -> None:
        """Stop what this role started that outlives it (threads, servers, subprocesses); called by the host
        before it parks the process, never on a process about to be killed. Default: nothing to stop."""
