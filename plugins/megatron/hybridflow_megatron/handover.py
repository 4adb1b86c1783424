"""Train → generate weight handover of the megatron engine through the core reshard planner (3D-HybridEngine): the
tg = 1 HF-named full weights, or this rank's shards of any generation layout drawn inside the training mesh.

Planning and moving bytes belong to :mod:`hybridflow.resharding`; this module builds the target layouts, keeps one
plan per target (built on first use, reused every step) and falls back to :mod:`hybridflow_megatron.gather` only
where the planner cannot describe the shards: a vocabulary megatron padded for tensor parallelism.

With ``park=True`` (the actor worker's path) megatron's DDP param buffer — one flat storage behind every trained
parameter (distributed optimizer) — is released once the generation shards hold all of it, so a rank holds each
weight once while generating; it comes back bit for bit from those shards on ``end_generation()`` or the engine's
next use of its weights. It cannot part-release, so it parks only where the rank's generation shards contain its
whole training shard (pg = 1 and tg dividing t, e.g. t = 2 → tg = 1), and not on a pipeline's last stage holding
a tied embedding's copy. Stability: public.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from hybridflow.errors import ConfigError, EngineError
from hybridflow.resharding import (
    GenerationLayout,
    ModelLayout,
    ParallelLayout,
    ReshardPlan,
    StorageParking,
    build_tensor_parallel_layout,
    execute_reshard,
    plan_reshard,
)
from hybridflow.resharding.planner import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from hybridflow_megatron.engine import MegatronTrainingEngine

__all__ = ["TARGETS", "DEFAULT_BUCKET_BYTES", "HandoverStats", "WeightHandover"]

#: ``generation_weights`` targets. Both yield unfused Hugging Face names and full tensors (tg = 1): the ``hf``
#: rollout engine and vLLM's ``update_weights`` (``weights_target = "hf"``: vLLM fuses while loading) take those.
#: For vLLM's own fused, per-TP-rank shards use :meth:`WeightHandover.reshard` with ``build_vllm_layout``.
TARGETS = ("hf", "vllm")


@dataclass(frozen=True, kw_only=True, slots=True)
class HandoverStats:
    """What one handover measured on this rank.

    ``path="reshard"``: the planner's ``hybridflow`` plan ran through ``execute_reshard``; ``bytes_received`` and
    ``bytes_sent`` are the executor's counts, ``lower_bound_bytes`` what this rank had to receive at least (its
    target shards minus what it held), ``peak_extra_bytes`` the executor's memory high-water mark above
    max(source, target) footprint, ``max_bucket_cost`` the plan's largest bucket, ``aliased_bytes`` the generation
    shards handed over as views of the training parameters, ``parked_bytes`` the training storage released while
    generating (``park=True``). ``path="gather"``: the padded-vocab fallback (all-gather over t, broadcast over p),
    which reports received bytes only.
    """

    rank: int
    path: Literal["reshard", "gather"]
    target: str
    tensors: int
    bytes_received: int
    bytes_sent: int | None = None
    lower_bound_bytes: int | None = None
    peak_extra_bytes: int | None = None
    max_bucket_cost: int | None = None
    buckets: int | None = None
    seconds: float = 0.0
    aliased_bytes: int = 0
    parked_bytes: int = 0


def _layout_key(layout: ModelLayout) -> Hashable:
    return (layout.mesh, tuple(layout.params.items()))


class WeightHandover:
    """One engine's handover: its source layout and one reshard plan per target layout, reused every step."""

    def __init__(self, engine: MegatronTrainingEngine, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if bucket_bytes < 1:
            raise ConfigError(f"handover bucket_bytes must be a positive byte count; got {bucket_bytes}")
        self._engine = engine
        self.bucket_bytes = bucket_bytes
        self._source: ModelLayout | None = None
        self._plans: dict[Hashable, ReshardPlan] = {}
        self._parking: StorageParking | None = None
        self._hooked = False

    @property
    def parked_bytes(self) -> int:
        """Training storage bytes released now (parked in generation shards); 0 when everything is home."""
        return 0 if self._parking is None else self._parking.parked_bytes

    def restore(self) -> int:
        """Give the storage parked by ``reshard(park=True)`` back, bit for bit, from the generation shards holding
        it; returns the bytes restored (0: nothing was parked)."""
        parking, self._parking = self._parking, None
        return 0 if parking is None else parking.restore()

    def _unhanded(self) -> list[torch.Tensor]:
        """Parameters the handover skips (the last stage's copy of a tied embedding): their storage never parks."""
        from hybridflow_megatron.spec_names import named_local_parameters

        engine = self._engine
        return [param for name, param in named_local_parameters(engine.module)
                if engine.arch.tied_embeddings and name == "output_layer.weight"]

    def _install_restore_hook(self) -> None:
        """Once: a forward of the model restores first, so a caller that skips ``end_generation()`` never reads
        released storage (the engine's own methods restore explicitly too)."""
        if self._hooked:
            return
        self._hooked = True
        ref = weakref.ref(self)

        def restore(*_: Any, **__: Any) -> None:
            owner = ref()
            if owner is not None:
                owner.restore()

        self._engine.module.register_forward_pre_hook(restore, prepend=True)

    @property
    def plannable(self) -> bool:
        """False when megatron padded the vocabulary (padded rows have no canonical counterpart): gather path."""
        arch = self._engine.arch
        return arch.padded_vocab_size == arch.vocab_size

    def source_layout(self) -> ModelLayout:
        """The engine's ``megatron`` layout over its (p, t, d) mesh (built once)."""
        if self._source is None:
            self._source = self._engine.layout()
        return self._source

    def generation_layout(self, *, tensor: int = 1, pipeline: int = 1) -> ModelLayout:
        """Unfused Hugging Face names split Megatron/vLLM-style over a ``(pipeline, tensor)`` generation mesh drawn
        inside the training mesh (stride grouping); ``tensor=pipeline=1`` is the full model on every rank."""
        source = self.source_layout()
        shapes = {name: shape for name, (shape, _) in source.canonical_shapes().items()}
        dtype = next(iter(source.params.values())).dtype
        if not isinstance(source.mesh, ParallelLayout):
            raise EngineError(f"the megatron source layout must sit on a training mesh (ParallelLayout), got "
                              f"{type(source.mesh).__name__}")
        mesh = GenerationLayout(tensor=tensor, pipeline=pipeline, training=source.mesh)
        return build_tensor_parallel_layout(shapes, mesh=mesh, dtype=dtype)

    def plan_for(self, target: ModelLayout) -> ReshardPlan:
        """The ``hybridflow`` plan from the engine's layout to ``target``: planned once per target, then cached."""
        key = _layout_key(target)
        if key not in self._plans:
            self._plans[key] = plan_reshard(self.source_layout(), target, strategy="hybridflow",
                                            bucket_bytes=self.bucket_bytes)
        return self._plans[key]

    def _check_plannable(self) -> None:
        if not self.plannable:
            arch = self._engine.arch
            raise EngineError(
                f"vocab {arch.vocab_size} was padded to {arch.padded_vocab_size} for tensor parallelism, which no "
                "reshard layout describes; use a vocabulary that tensor size × extra.vocab_multiple divides, or "
                "generation_weights(), which falls back to the gather path"
            )

    def reshard(self, target: ModelLayout, *, name: str = "layout", views: bool = False,
                park: bool = False) -> dict[str, torch.Tensor]:
        """This rank's shards of ``target`` (a layout over ``GenerationLayout(..., training=<source mesh>)``), moved
        by the cached plan; a collective over all ranks. Sets the engine's ``last_handover_stats``. ``views=True``:
        shards this rank already holds whole are views of the training parameters (do not write into them; they
        follow the next optimizer step). ``park=True`` (implies views): a training storage (Megatron's DDP param
        buffer) whose every parameter lies in this rank's generation shards is released once they hold it, so the
        rank holds each weight once while generating (:class:`hybridflow.resharding.StorageParking`); the engine's
        ``end_generation()`` (or its next use of the weights) brings it back bit for bit. Do not write into the
        returned shards until then."""
        self._check_plannable()
        started = time.perf_counter()
        plan = self.plan_for(target)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.restore()  # a previous handover's parked storage comes home before anything reads it
        local = dict(self._engine.iter_weight_shards())
        parking = StorageParking(plan, rank, local, others=self._unhanded()) if park else None
        with torch.no_grad():
            shards, stats = execute_reshard(plan, local, rank=rank, views=views or park,
                                            on_release=None if parking is None else parking.on_release)
            parked = 0 if parking is None else parking.finish(shards)
        if parking is not None and parked:
            self._parking = parking
            self._install_restore_hook()
        self._engine.last_handover_stats = HandoverStats(
            rank=rank, path="reshard", target=name, tensors=len(shards), bytes_received=stats.bytes_received,
            bytes_sent=stats.bytes_sent, lower_bound_bytes=plan.lower_bound_bytes(rank),
            peak_extra_bytes=stats.peak_extra_bytes, max_bucket_cost=plan.max_bucket_cost(), buckets=stats.buckets,
            seconds=time.perf_counter() - started, aliased_bytes=stats.aliased_bytes, parked_bytes=parked,
        )
        return shards

    def generation_weights(self, *, target: str = "hf", park: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Full Hugging Face-named weights on every rank (tg = 1), tied weights once; a collective over all ranks.
        ``park``: see :meth:`reshard` (the padded-vocabulary gather fallback never parks)."""
        if target not in TARGETS:
            raise ConfigError(f"generation_weights target must be one of {list(TARGETS)}; got {target!r}")
        if self.plannable:
            return iter(self.reshard(self.generation_layout(), name=target, park=park).items())
        # Fallback, only for a padded vocabulary: the planner's layouts cannot name padded embedding rows.
        from hybridflow_megatron import gather

        engine = self._engine
        started = time.perf_counter()
        state, gathered = gather.gather_hf_state(engine.module, arch=engine.arch, placement=engine.placement)
        engine.last_handover_stats = HandoverStats(
            rank=dist.get_rank() if dist.is_initialized() else 0, path="gather", target=target,
            tensors=gathered.tensors, bytes_received=gathered.bytes_received, seconds=time.perf_counter() - started,
        )
        return iter(state.items())
