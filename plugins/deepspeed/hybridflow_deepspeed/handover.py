"""Train → generate weight handover of the ``deepspeed`` engine through the core reshard planner (3D-HybridEngine).

ZeRO-3: each rank's flat partitions are described by :class:`~hybridflow_deepspeed.layouts.ZeroPartitionSpec` and
moved by the planner's ``hybridflow`` plan (built once per target layout, then reused), so a rank receives exactly
what it lacks: the lower bound. ZeRO-1/2 keep the full parameters on every rank, so the tg = 1 target is already
held: the weights are yielded without communication and 0 bytes received is the lower bound. At generation
tensor-parallel size tg > 1 (the trainer's ``rollout.tensor_parallel_size``) every stage goes through the planner to
the Megatron/vLLM-style shards of ``GenerationLayout(tensor=tg, training=<the engine's data mesh>)``. With
``park=True`` (ZeRO-3, the actor worker's path) a rank holds its generation shards alone while generating: the full
data of the persistent parameters (DeepSpeed's ``param_persistence_threshold``: kept gathered besides their
partitions) and the ``ds_tensor`` partitions' storage are released after the move, and both come back bit for
bit from the generation shards afterwards through the planner's way back (generation layout → ZeRO layout, the
persistent parameters whole): nothing at tg = 1, and at tg > 1 each rank receives from its tensor-parallel peers
exactly what its own shards lack (the row-parallel weights' partition bytes outside its columns, the persistent
parameters' other columns). Planning and moving bytes belong to :mod:`hybridflow.resharding`. Stability: public.
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
    ReshardStats,
    build_tensor_parallel_layout,
    execute_reshard,
    lower_bound_bytes,
    plan_reshard,
)
from hybridflow.resharding.specs import ParamShardSpec
from hybridflow_deepspeed.layouts import (
    build_deepspeed_training_layout,
    flat_partition_range,
    pack_partition,
    unpack_partition,
)

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
    ``parked_bytes``: ZeRO-3 storage released while generating (``park=True``): the partitions' and the gathered
    persistent parameters' full data; ``restore_bytes``: what bringing it back will receive from the other ranks'
    generation shards (the way back's lower bound: at tg > 1 the partition bytes and persistent parameters' columns
    this rank's own shards lack; 0 at tg = 1).
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
    restore_bytes: int = 0
    #: generation shards handed over as views of the training storage (none: ZeRO's flat partitions never alias)
    aliased_bytes: int = 0


@dataclass(slots=True)
class _Parked:
    """One ``park=True`` handover's released storages on this rank, and their way back."""

    back: ReshardPlan  # the generation layout -> the ZeRO layout (persisted parameters whole)
    shards: dict[str, torch.Tensor]  # this rank's generation shards: the way back's sources
    storages: list[tuple[torch.Tensor, int]]  # a tensor of each released storage, and its bytes
    persisted: frozenset[str]  # persistent parameters whose full data was released


def _layout_key(layout: ModelLayout) -> Hashable:
    return (layout.mesh, tuple(layout.params.items()))


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()


class WeightHandover:
    """One engine's handover: its ZeRO layout and one reshard plan per target layout, reused every step."""

    def __init__(self, engine: DeepSpeedTrainingEngine, *, bucket_bytes: int) -> None:
        self._engine = engine
        self.bucket_bytes = bucket_bytes
        self._source: ModelLayout | None = None
        self._plans: dict[Hashable, ReshardPlan] = {}
        self._back_plans: dict[Hashable, ReshardPlan] = {}
        self._parked: _Parked | None = None
        #: what the last :meth:`restore` moved (``None`` before the first)
        self.last_restore_stats: ReshardStats | None = None

    @property
    def parked_bytes(self) -> int:
        """Training storage bytes released now (ZeRO-3 partitions, persisted parameters' full data); 0 when
        everything is home."""
        return 0 if self._parked is None else sum(nbytes for _, nbytes in self._parked.storages)

    def restore(self) -> int:
        """Give the storages released by ``reshard(park=True)`` their bytes back, bit for bit, from the generation
        shards (the way back's plan: this rank receives from its tensor-parallel peers what its own shards lack);
        returns the bytes restored (0: nothing was parked). A collective over all ranks when something is parked,
        as on every rank after the same handover; ``last_restore_stats`` has what it moved."""
        parked, self._parked = self._parked, None
        if parked is None:
            return 0
        engine, source = self._engine, self.source_layout()
        mesh = source.mesh
        with torch.no_grad():
            for owner, nbytes in parked.storages:
                storage = owner.untyped_storage()
                storage.resize_(nbytes)
                torch.empty(0, dtype=torch.uint8, device=owner.device).set_(storage).zero_()
            shards, parked.shards = parked.shards, {}  # the executor pops each once read: its memory goes then
            try:
                rebuilt, self.last_restore_stats = execute_reshard(parked.back, shards, rank=engine.rank)
            except Exception as exc:
                raise EngineError(
                    f"rank {engine.rank}: bringing the parked ZeRO-3 partitions back from the generation shards failed "
                    f"({type(exc).__name__}: {exc}); expected every rank to run end_generation() (or a forward) after "
                    f"the same handover; got a failed collective, so this rank's weights are zeroed, not restored. "
                    f"Fix: the cause above, then load_checkpoint() before training on"
                ) from exc
            del shards
            for name, parameter in engine.module.named_parameters():
                tensor = rebuilt.pop(name, None)
                if tensor is None:
                    continue
                flat = parameter.ds_tensor.view(-1)  # type: ignore[attr-defined]  # set by ZeRO-3
                if name in parked.persisted:  # whole here: its full data, and its partition is its flat range
                    parameter.data.copy_(tensor)
                    start, stop = flat_partition_range(tensor.numel(), mesh.axis_size("data"),
                                                       mesh.axis_index(engine.rank, "data"))
                    flat[: stop - start].copy_(tensor.reshape(-1)[start:stop])
                else:
                    unpack_partition(tensor, flat, source.params[name], mesh, engine.rank)
        return sum(nbytes for _, nbytes in parked.storages)

    def _release(self, tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
        """Release the distinct non-empty storages behind ``tensors``; returns (a tensor of each, its bytes)."""
        released: dict[tuple[str, int], tuple[torch.Tensor, int]] = {}
        for tensor in tensors:
            if tensor.untyped_storage().nbytes():
                released.setdefault(_storage_key(tensor), (tensor, tensor.untyped_storage().nbytes()))
        for tensor, _ in released.values():
            tensor.untyped_storage().resize_(0)  # every view of it (the parameter, DeepSpeed's flat buffers) sees it go
        return list(released.values())

    def _gathered_persistent(self) -> dict[str, torch.Tensor]:
        """ZeRO-3's persistent parameters (``ds_persist``: under ``param_persistence_threshold`` elements) that are
        gathered now (after a forward or a step: DeepSpeed keeps them whole besides their partitions), by name. The
        same names on every rank: DeepSpeed gathers them in the same collectives everywhere."""
        return {name: p for name, p in self._engine.module.named_parameters()
                if getattr(p, "ds_persist", False) and p.data.numel() > 0}

    def back_plan(self, target: ModelLayout, persisted: frozenset[str] = frozenset()) -> ReshardPlan:
        """The way back of a parked handover: ``hybridflow`` plan from ``target`` (the generation shards) to the ZeRO
        layout, ``persisted`` parameters whole (their full data; their partitions are cut from it locally). Planned
        once per (target, persisted), then cached."""
        key = (_layout_key(target), persisted)
        if key not in self._back_plans:
            source = self.source_layout()
            params = {name: ParamShardSpec(name=name, shape=spec.shape, dtype=spec.dtype) if name in persisted
                      else spec for name, spec in source.params.items()}
            self._back_plans[key] = plan_reshard(target, ModelLayout(mesh=source.mesh, params=params),
                                                 strategy="hybridflow", bucket_bytes=self.bucket_bytes)
        return self._back_plans[key]

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
        a collective over all ranks. Sets the engine's ``last_handover_stats``. ``park`` (ZeRO-3): once the shards
        are moved, the partitions' storage and the persistent parameters' gathered full data are released, so the
        rank holds its generation shards alone until the engine's ``end_generation()`` or
        next forward, which bring both back from the shards (:meth:`restore`); do not write into the shards until
        then."""
        engine = self._engine
        self.restore()  # a previous handover's parked storages come home before anything reads them
        started = time.perf_counter()
        plan = self.plan_for(target)
        local = self.local_shards()
        with torch.no_grad():
            shards, stats = execute_reshard(plan, local, rank=engine.rank)
        released: list[tuple[torch.Tensor, int]] = []
        back_bytes = 0
        if park and engine.options.zero_stage == 3:
            persisted = self._gathered_persistent()
            # a storage that another (gathered, not persistent) parameter's data shares stays: it is no copy
            blocked = {_storage_key(p.data) for n, p in engine.module.named_parameters()
                       if n not in persisted and p.data.untyped_storage().nbytes()}
            released = self._release([p.data for p in persisted.values() if _storage_key(p.data) not in blocked]
                                     + [p.ds_tensor for p in engine.module.parameters()])  # type: ignore[attr-defined]
            back = self.back_plan(target, frozenset(persisted))
            back_bytes = back.lower_bound_bytes(engine.rank)
            self._parked = _Parked(back=back, shards=dict(shards), storages=released, persisted=frozenset(persisted))
        engine.last_handover_stats = HandoverStats(
            rank=engine.rank, path="reshard", target=name, tensors=len(shards), bytes_received=stats.bytes_received,
            bytes_sent=stats.bytes_sent, lower_bound_bytes=plan.lower_bound_bytes(engine.rank),
            bytes_total=stats.target_bytes, peak_extra_bytes=stats.peak_extra_bytes, buckets=stats.buckets,
            seconds=time.perf_counter() - started, parked_bytes=sum(nbytes for _, nbytes in released),
            restore_bytes=back_bytes,
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
        bytes outside this rank's columns come back from its tensor-parallel peers, ``HandoverStats.restore_bytes``)."""
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
