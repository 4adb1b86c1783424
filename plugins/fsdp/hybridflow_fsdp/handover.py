"""Train → generate weight handover of the FSDP engine: full tensors for a tg=1 generation engine, produced from the
dim-0 shards one parameter at a time, with the bytes each rank received counted.

Only one gathered parameter is alive at a time here (the consumer decides what to keep); a general planner for
other generation layouts (tg > 1) is :mod:`hybridflow.resharding`'s business.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridflow.errors import EngineError

if TYPE_CHECKING:
    from hybridflow_fsdp.training import FSDPTrainingEngine

__all__ = ["HandoverStats", "stream_generation_weights", "TARGETS"]

TARGETS = ("hf",)


@dataclass(frozen=True, kw_only=True, slots=True)
class HandoverStats:
    """What one handover moved on this rank.

    ``bytes_received`` counts the payload this rank lacked (full tensor − its own shard), which for FSDP dim-0
    shards → tg=1 equals the per-rank lower bound of :func:`hybridflow.resharding.planner.lower_bound_bytes`.
    ``peak_gathered_bytes`` is the largest full tensor alive at once (the handover's transient memory).
    """

    rank: int
    world_size: int
    parameters: int
    bytes_total: int
    bytes_local: int
    bytes_received: int
    peak_gathered_bytes: int
    seconds: float


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def stream_generation_weights(engine: FSDPTrainingEngine, *, target: str = "hf") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf name, full tensor)`` for every parameter (tied weights once), gathering shard by shard.

    Every rank must consume the whole iterator in step (each item is an all-gather). On exhaustion the engine's
    ``last_handover_stats`` holds a :class:`HandoverStats`.
    """
    from torch.distributed.tensor import DTensor

    if target not in TARGETS:
        raise EngineError(f"generation weight target {target!r} is not supported by the fsdp engine; known: {TARGETS}")
    started = time.perf_counter()
    total = local = received = peak = count = 0
    engine.last_handover_stats = None
    with torch.no_grad():
        for name, parameter in engine.model.named_parameters():
            if isinstance(parameter, DTensor):
                shard = parameter.to_local()
                full = parameter.full_tensor()
            else:
                shard = full = parameter.detach()
            count += 1
            total += _nbytes(full)
            local += _nbytes(shard)
            received += _nbytes(full) - _nbytes(shard)
            peak = max(peak, _nbytes(full))
            yield name, full.detach()
            del full
    engine.last_handover_stats = HandoverStats(
        rank=engine.rank, world_size=engine.world_size, parameters=count, bytes_total=total, bytes_local=local,
        bytes_received=received, peak_gathered_bytes=peak, seconds=time.perf_counter() - started,
    )
