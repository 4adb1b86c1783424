"""vLLM's ``external_launcher`` inside the trainer's own processes (docs/guide/vllm.md, "Tensor-parallel generation in
the trainer"): the checks that the caller's ranks can be vLLM's tensor-parallel workers, a shared-memory name per
engine, removed once every rank has mapped it, the release of vLLM's own process groups without the caller's world, and
the caller's RNG states kept across vLLM's start-up (which seeds them). These reach into vLLM internals
(``ExecutorWithExternalLauncher._distributed_args``, the tensor group's message queue, ``parallel_state``): check them
on a vLLM upgrade.
Stability: internal."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from hybridflow.errors import ConfigError

__all__ = ["check_external_launcher", "external_launcher_identity", "release_vllm_groups", "restore_random_states",
           "save_random_states", "shared_memory_identity", "unlink_shared_memory"]


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


def check_external_launcher(tensor: int, groups: Any, llm_kwargs: Mapping[str, Any]) -> None:
    """Raise unless vLLM can generate at ``tensor``-way tensor parallelism over ``groups`` on the caller's processes.

    The caller's processes are vLLM's tensor-parallel workers: vLLM's ``external_launcher`` executor reuses the
    initialised torch.distributed world and groups its ranks into tensor groups of consecutive ranks
    (``vllm.distributed.parallel_state.initialize_model_parallel``: ``arange(world).reshape(..., tp)``). It fits
    the hybrid engine's generation layout when that layout is one tensor group over the whole world."""
    import torch.distributed as dist

    if tensor == 1:
        return
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            f"RolloutEngineConfig.tensor_groups with tensor_parallel_size={tensor} runs vLLM on the caller's processes "
            "(external_launcher), which needs torch.distributed initialised first (the actor's training engine "
            "does it); got an uninitialised default process group")
    world = dist.get_world_size()
    if groups != [list(range(world))]:
        raise ConfigError(
            f"the vllm engine generates tensor-parallel on the actor's own ranks only as one tensor group over "
            f"the whole world (vLLM's external_launcher groups consecutive ranks; the hybrid engine's generation "
            f"layout draws strided groups once the world is larger than tg): expected tensor_groups "
            f"[{list(range(world))}], got {groups}. Fix: set rollout.tensor_parallel_size to the actor's world "
            f"size {world}, or 1")
    backend = llm_kwargs.get("distributed_executor_backend", "external_launcher")
    if backend != "external_launcher":
        raise ConfigError(
            f"extra.llm_kwargs.distributed_executor_backend={backend!r}, but the vllm engine of the hybrid engine "
            "generates on the actor's own processes, which needs 'external_launcher'. Fix: remove "
            "distributed_executor_backend from rollout.extra.llm_kwargs")


def save_random_states() -> tuple[Any, ...]:
    """Python's, numpy's and torch's global RNG states: vLLM seeds them in the process it starts in (a colocated
    trainer's streams then continue as if no engine had started, :func:`restore_random_states`)."""
    import random

    import numpy

    return random.getstate(), numpy.random.get_state(), torch.random.get_rng_state()


def restore_random_states(states: tuple[Any, ...]) -> None:
    """Put back the states :func:`save_random_states` took."""
    import random

    import numpy

    random.setstate(states[0])
    numpy.random.set_state(states[1])
    torch.random.set_rng_state(states[2])
