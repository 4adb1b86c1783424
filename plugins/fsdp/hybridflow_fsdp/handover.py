"""Train → generate weight handover of the FSDP engine: full tensors for a tg=1 generation engine, produced from the
dim-0 shards one parameter at a time, with the bytes each rank received counted.

Two paths, chosen by the training engine's ``extra["handover"]``:

- ``"stream"`` (default): one ``DTensor.full_tensor`` per parameter, so only one gathered parameter is alive at a time;
  bytes received are the payload each rank lacked (for dim-0 shards → tg = 1 that is the planner's lower bound).
- ``"reshard"``: the 3D-HybridEngine planner and executor (:mod:`hybridflow.resharding`): the plan is built once and
  reused, bytes are measured from the collectives actually run, in bounded buckets; the whole generation model is
  produced before the first tensor is yielded.
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

__all__ = ["HandoverStats", "stream_generation_weights", "reshard_generation_weights", "TARGETS", "PATHS"]

TARGETS = ("hf",)
PATHS = ("stream", "reshard")


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
    path: str = "stream"


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


def reshard_generation_weights(engine: FSDPTrainingEngine, *,
                               target: str = "hf") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf name, full tensor)`` produced by the reshard planner's plan (FSDP dim-0 shards over d ranks →
    tg = 1 on every rank); a collective: every rank must consume the whole iterator."""
    from torch.distributed.tensor import DTensor

    from hybridflow.resharding import execute_reshard, plan_reshard
    from hybridflow_fsdp.layouts import build_fsdp_training_layout, build_hf_rollout_layout

    if target not in TARGETS:
        raise EngineError(f"generation weight target {target!r} is not supported by the fsdp engine; known: {TARGETS}")
    started = time.perf_counter()
    engine.last_handover_stats = None
    parameters = dict(engine.model.named_parameters())
    plan = getattr(engine, "_handover_plan", None)
    if plan is None:
        shapes = {name: tuple(p.shape) for name, p in parameters.items()}
        dtype = next(iter(parameters.values())).dtype
        plan = plan_reshard(build_fsdp_training_layout(shapes, data=engine.world_size, dtype=dtype),
                            build_hf_rollout_layout(shapes, data=engine.world_size, dtype=dtype),
                            strategy="hybridflow", bucket_bytes=int(engine.config.extra.get("handover_bucket_bytes",
                                                                                             64 << 20)))
        engine._handover_plan = plan
    with torch.no_grad():
        local = {name: (p.to_local() if isinstance(p, DTensor) else p).detach() for name, p in parameters.items()}
        full, stats = execute_reshard(plan, local, rank=engine.rank)
    engine.last_handover_stats = HandoverStats(
        rank=engine.rank, world_size=engine.world_size, parameters=len(parameters), bytes_total=stats.target_bytes,
        bytes_local=stats.source_bytes, bytes_received=stats.bytes_received, peak_gathered_bytes=stats.peak_extra_bytes,
        seconds=time.perf_counter() - started, path="reshard",
    )
    for name in parameters:
        yield name, full.pop(name)
