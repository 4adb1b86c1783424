"""vLLM's ``external_launcher`` inside the trainer's own processes (docs/vllm.md, "Tensor-parallel generation in the
trainer"): a shared-memory name per engine, removed once every rank has mapped it, and the release of vLLM's own
process groups without the caller's world. These reach into vLLM internals (``ExecutorWithExternalLauncher.
_distributed_args``, the tensor group's message queue, ``parallel_state``): check them on a vLLM upgrade.
Stability: internal."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["shared_memory_identity", "external_launcher_identity", "unlink_shared_memory", "release_vllm_groups"]


def shared_memory_identity() -> str:
    """A name for this engine's CPU shared-memory segments that all ranks agree on (rank 0's, broadcast over the
    caller's world) and no other engine on the machine uses."""
    import secrets

    import torch.distributed as dist

    token = [f"hybridflow-{os.getpid()}-{secrets.token_hex(6)}"]
    dist.broadcast_object_list(token, src=0)
    return str(token[0])


@contextmanager
def external_launcher_identity(identity: str) -> Iterator[None]:
    """While vLLM starts, its ``external_launcher`` executor reports an init method ending in ``identity``.

    vLLM's CPU worker names the shared-memory segments of its tensor-parallel all-reduce after the init method's
    last ``:`` field (``VLLM_DIST_IDENT``, ``cpu_worker.py``); the external launcher's is ``env://``, so every such
    engine on a machine would use the same ``/dev/shm`` names: a second one fails with ``create shm in SHMManager
    failed. errno: 17`` (EEXIST), as does every later one after a killed process left its segments. The method
    itself is not used: the caller's world is initialised already, vLLM only builds groups inside it.
    """
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    original = ExecutorWithExternalLauncher._distributed_args

    def distributed_args(executor: Any) -> tuple[str, int, int]:
        _, rank, local_rank = original(executor)
        return f"env://hybridflow:{identity}", rank, local_rank

    ExecutorWithExternalLauncher._distributed_args = distributed_args
    try:
        yield
    finally:
        ExecutorWithExternalLauncher._distributed_args = original


def unlink_shared_memory(identity: str) -> None:
    """Remove the names of this engine's shared-memory segments once every rank has mapped them: the mappings stay,
    and no segment outlives its processes, however they end (a Ray worker is killed, not shut down; each start left
    24 MiB in /dev/shm before). The segments: the CPU all-reduce's (named after ``identity``, joined by every rank
    inside vLLM's start) and the tensor group's message queue (created by tensor rank 0, attached by the others
    before the group is ready)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    dist.barrier()
    for path in Path("/dev/shm").glob(f"{identity}-*"):
        path.unlink(missing_ok=True)
    buffer = getattr(get_tp_group().mq_broadcaster, "buffer", None)
    if buffer is not None and getattr(buffer, "is_creator", False):
        buffer.shared_memory.unlink()
        buffer.is_creator = False  # vLLM unlinks in __del__ as the creator; the name is gone already


def release_vllm_groups(shutdown_ray: bool = False) -> None:
    """vLLM's process groups and its world coordinator, not the default process group they were built in."""
    from vllm.distributed import parallel_state

    state: Any = parallel_state
    state.destroy_model_parallel()
    if state._WORLD is not None:
        state._WORLD.destroy()
        state._WORLD = None
