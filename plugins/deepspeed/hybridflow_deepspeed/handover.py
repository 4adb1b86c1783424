"""Train → generate weight handover of the ``deepspeed`` engine through the core reshard planner (3D-HybridEngine).

ZeRO-3: each rank's flat partitions are described by :class:`~hybridflow_deepspeed.layouts.ZeroPartitionSpec` and
moved by the planner's ``hybridflow`` plan (built once per target layout, then reused), so a rank receives exactly
what it lacks: the lower bound. ZeRO-1/2 keep the full parameters on every rank, so the tg = 1 target is already
held: the weights are yielded without communication and 0 bytes received is the lower bound. At generation
tensor-parallel size tg > 1 (the trainer's ``rollout.tensor_parallel_size``) every stage goes through the planner to
the Megatron/vLLM-style shards of ``GenerationLayout(tensor=tg, training=<the engine's data mesh>)``. With
``park=True`` (ZeRO-3, the actor worker's path) the ``ds_tensor`` partitions' storage is released while the
generation shards hold its bytes (all of them at tg = 1; at tg > 1 the few a row-parallel weight's flat rows have
outside this rank's columns are copied aside) and unpacked back bit for bit afterwards
(:class:`hybridflow.resharding.StorageParking` with ``aside=True``). Planning and moving bytes belong to
:mod:`hybridflow.resharding`. Stability: public.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from hybridflow.errors import ConfigError, EngineError
from hybridflow.resharding import (
    GenerationLayout,
    ModelLayout,
    ParallelLayout,
    ReshardPlan,
    StorageParking,
    build_tensor_parallel_layout,
    execute_reshard,
    lower_bound_bytes,
    plan_reshard,
)
from hybridflow.resharding.specs import ParamShardSpec
from hybridflow_deepspeed.layouts import build_deepspeed_training_layout, pack_partition, unpack_partition

if TYPE_CHECKING:
    from hybridflow_deepspeed.training import DeepSpeedTrainingEngine

__all__ = ["TARGETS", "HandoverStats", "WeightHandover"]

#: ``generation_weights`` targets: unfused Hugging Face names, full tensors (the hf engine; vLLM's update_weights
#: takes them too, ``weights_target = "hf"``, and fuses while loading)
TARGETS = ("hf",)


@dataclass(frozen=True, kw_only=True, slots=True)
class HandoverStats:
    """What one handover measured on this rank.

    ``path="reshard"``: ZeRO-3 partitions moved by ``execute_reshard``; ``bytes_received``/``bytes_sent`` are counted
    from the buffers the executor moved. ``path="replicated"``: ZeRO-1/2, every parameter already whole here, nothing
    moved. ``lower_bound_bytes`` is what this rank had to receive at least (target shards minus what it held).
    ``parked_bytes``: ZeRO-3 partition storage released while generating (``park=True``); ``aside_bytes``: the
    partition bytes no generation shard on this rank holds, kept in small aside buffers meanwhile (tg > 1).
    """

    rank: int
    path: Literal["reshard", "replicated"]
    target: str
    tensors: int
    bytes_received: int
    bytes_sent: int
    lower_bound_bytes: int
    bytes_total: int
    peak_extra_bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    parked_bytes: int = 0
    aside_bytes: int = 0


def _layout_key(layout: ModelLayout) -> Hashable:
    return (layout.mesh, tuple(layout.params.items()))


class WeightHandover:
    """One engine's handover: its ZeRO layout and one reshard plan per target layout, reused every step."""

    def __init__(self, engine: DeepSpeedTrainingEngine, *, bucket_bytes: int) -> None:
        self._engine = engine
        self.bucket_bytes = bucket_bytes
        self._source: ModelLayout | None = None
        self._plans: dict[Hashable, ReshardPlan] = {}
        self._parking: StorageParking | None = None

    @property
    def parked_bytes(self) -> int:
        """ZeRO-3 partition bytes released now (parked in generation shards); 0 when everything is home."""
        return 0 if self._parking is None else self._parking.parked_bytes

    def restore(self) -> int:
        """Give the partitions parked by ``reshard(park=True)`` their storage back, bit for bit, from the generation
        shards holding them; returns the bytes restored (0: nothing was parked)."""
        parking, self._parking = self._parking, None
        return 0 if parking is None else parking.restore()

    def _parking_for(self, plan: ReshardPlan, shards: dict[str, torch.Tensor]) -> StorageParking:
        """ZeRO-3: park the ``ds_tensor`` partitions (the optimizer's flat buffer behind all of them, for a trained
        role) that ``shards`` were packed from; restore unpacks each rebuilt shard into its partition. At tg > 1 a
        row-parallel weight's partition (flat rows) lies only partly in this rank's shards (its columns): the rest is
        copied aside (``StorageParking(aside=True)``, about a quarter of those weights' partitions at d = tg = 2) and
        the flat buffer still goes."""
        engine, source = self._engine, self.source_layout()
        partitions = {name: p.ds_tensor for name, p in engine.module.named_parameters()  # type: ignore[attr-defined]
                      if name in shards}

        def write_back(name: str, shard: torch.Tensor) -> None:
            unpack_partition(shard, partitions[name].view(-1), source.params[name], source.mesh, engine.rank)

        return StorageParking(plan, engine.rank, shards, storages=partitions, write_back=write_back, aside=True)

    def source_layout(self) -> ModelLayout:
        """The engine's ZeRO layout over its data-parallel ranks (built once)."""
        if self._source is None:
            engine = self._engine
            shapes = {name: shape for name, shape, _ in engine.named_parameter_shapes()}
            self._source = build_deepspeed_training_layout(shapes, data=engine.world_size,
                                                           zero_stage=engine.options.zero_stage,
                                                           dtype=engine.parameter_dtype())
        return self._source

    def generation_layout(self, *, tensor: int = 1) -> ModelLayout:
        """Unfused Hugging Face names split Megatron/vLLM-style over ``tensor`` generation ranks drawn inside the
        data-parallel mesh (stride grouping); ``tensor=1`` is the full model on every rank."""
        source = self.source_layout()
        if not isinstance(source.mesh, ParallelLayout):
            raise EngineError(f"the deepspeed layout must sit on a ParallelLayout; got {type(source.mesh).__name__}")
        shapes = {name: shape for name, (shape, _) in source.canonical_shapes().items()}
        dtype = next(iter(source.params.values())).dtype
        mesh = GenerationLayout(tensor=tensor, pipeline=1, training=source.mesh)
        if tensor == 1:
            params = {name: ParamShardSpec(name=name, shape=shape, dtype=dtype) for name, shape in shapes.items()}
            return ModelLayout(mesh=mesh, params=params)
        return build_tensor_parallel_layout(shapes, mesh=mesh, dtype=dtype)

    def plan_for(self, target: ModelLayout) -> ReshardPlan:
        """The ``hybridflow`` plan from the ZeRO-3 layout to ``target``: planned once per target, then cached."""
        key = _layout_key(target)
        if key not in self._plans:
            self._plans[key] = plan_reshard(self.source_layout(), target, strategy="hybridflow",
                                            bucket_bytes=self.bucket_bytes)
        return self._plans[key]

    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's source shards by parameter name, as the ZeRO layout describes them (ZeRO-3: packed from the
        flat partitions; ZeRO-1/2: the full parameters)."""
        engine, source = self._engine, self.source_layout()
        shards = {}
        for name, parameter in engine.module.named_parameters():
            spec = source.params[name]
            if engine.options.zero_stage != 3:
                shards[name] = parameter.detach()
            elif spec.local_shape(source.mesh, engine.rank) is not None:
                partition = parameter.ds_tensor  # type: ignore[attr-defined]  # set by ZeRO-3 on its parameters
                shards[name] = pack_partition(partition.detach().view(-1), spec, source.mesh, engine.rank)
        return shards

    def reshard(self, target: ModelLayout, *, name: str = "layout", park: bool = False) -> dict[str, torch.Tensor]:
        """This rank's shards of ``target`` (a layout over ``GenerationLayout(..., training=<source mesh>)``);
        a collective over all ranks. Sets the engine's ``last_handover_stats``. ``park`` (ZeRO-3): the partitions'
        storage is released once the generation shards hold its bytes (the rest, at tg > 1, copied aside) until the
        engine's ``end_generation()`` or next forward; do not write into the shards until then."""
        engine = self._engine
        self.restore()  # a previous handover's parked partitions come home before anything reads them
        started = time.perf_counter()
        plan = self.plan_for(target)
        local = self.local_shards()
        parking = self._parking_for(plan, local) if park and engine.options.zero_stage == 3 else None
        with torch.no_grad():
            shards, stats = execute_reshard(plan, local, rank=engine.rank,
                                            on_release=None if parking is None else parking.on_release)
            parked = 0 if parking is None else parking.finish(shards)
        if parking is not None and parked:
            self._parking = parking
        engine.last_handover_stats = HandoverStats(
            rank=engine.rank, path="reshard", target=name, tensors=len(shards), bytes_received=stats.bytes_received,
            bytes_sent=stats.bytes_sent, lower_bound_bytes=plan.lower_bound_bytes(engine.rank),
            bytes_total=stats.target_bytes, peak_extra_bytes=stats.peak_extra_bytes, buckets=stats.buckets,
            seconds=time.perf_counter() - started, parked_bytes=parked,
            aside_bytes=0 if parking is None or not parked else parking.aside_bytes,
        )
        return shards

    def full_weights(self, *, target: str = "hf", park: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Full Hugging Face-named weights on every rank (tg = 1), tied weights once; a collective under ZeRO-3.
        ``park``: see :meth:`reshard` (ZeRO-1/2 yield the parameters themselves: nothing to park)."""
        if target not in TARGETS:
            raise ConfigError(f"generation_weights target must be one of {list(TARGETS)}; got {target!r}")
        engine = self._engine
        if engine.options.zero_stage == 3:
            return iter(self.reshard(self.generation_layout(), name=target, park=park).items())
        return self._replicated(target)

    def shard_weights(self, *, target: str = "hf", tensor: int,
                      park: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's tensor-parallel shards of generation layout (pg = 1, tg = ``tensor``), Hugging Face-named;
        moved by the planner (a collective over all ranks, under every ZeRO stage: ZeRO-1/2 ranks hold the
        parameters whole and receive nothing). ``park``: see :meth:`reshard` (the row-parallel weights' partition
        bytes outside this rank's columns are kept aside, ``HandoverStats.aside_bytes``)."""
        if target not in TARGETS:
            raise ConfigError(f"generation_weights target must be one of {list(TARGETS)}; got {target!r}")
        return iter(self.reshard(self.generation_layout(tensor=tensor), name=target, park=park).items())

    def _replicated(self, target: str) -> Iterator[tuple[str, torch.Tensor]]:
        engine = self._engine
        started = time.perf_counter()
        engine.last_handover_stats = None
        source = self.source_layout()
        total = count = 0
        for name, parameter in engine.module.named_parameters():
            count += 1
            total += parameter.numel() * parameter.element_size()
            yield name, parameter.detach()
        engine.last_handover_stats = HandoverStats(
            rank=engine.rank, path="replicated", target=target, tensors=count, bytes_received=0, bytes_sent=0,
            lower_bound_bytes=lower_bound_bytes(source, self.generation_layout(), engine.rank), bytes_total=total,
            seconds=time.perf_counter() - started,
        )
