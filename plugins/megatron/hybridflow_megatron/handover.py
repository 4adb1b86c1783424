"""Train → generate weight handover of the megatron engine through the core reshard planner (3D-HybridEngine): the
tg = 1 HF-named full weights, or this rank's shards of any generation layout drawn inside the training mesh.

Planning and moving bytes belong to :mod:`hybridflow.resharding`; this module builds the target layouts, keeps one
plan per target (built on first use, reused every step) and falls back to :mod:`hybridflow_megatron.gather` only
where the planner cannot describe the shards: a vocabulary megatron padded for tensor parallelism.

With ``park=True`` (the actor worker's path) megatron's DDP param buffer — one flat storage behind every trained
parameter (distributed optimizer) — is released once the generation shards hold all of it, so a rank holds each
weight once while generating; it comes back bit for bit from those shards on ``end_generation()`` or the engine's
next use of its weights. On a pipeline's last stage the buffer also holds the tied embedding's output-layer copy,
which the layout describes once (on the first stage): it parks in the rank's generation shard of the embedding,
checked equal to it bit for bit first. Where a rank's generation shards do not contain its whole training shard
(tg not dividing t, e.g. p = 2, t = 2 → tg = 4) the buffer parks all the same and the cells only other ranks'
generation shards hold are fetched back on restore by the reverse plan (generation → training layout; a
collective over all ranks, ``HandoverStats.fetch_bytes`` per rank). Stability: public.
"""

from __future__ import annotations

import dataclasses
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
    ReshardStats,
    StorageParking,
    build_tensor_parallel_layout,
    execute_reshard,
    parking_cells,
    plan_reshard,
)
from hybridflow.resharding.planner import DEFAULT_BUCKET_BYTES
from hybridflow.resharding.specs import Piece

if TYPE_CHECKING:
    from hybridflow_megatron.engine import MegatronTrainingEngine

__all__ = ["TARGETS", "DEFAULT_BUCKET_BYTES", "HandoverStats", "WeightHandover"]

#: ``generation_weights`` targets. Both yield unfused Hugging Face names and full tensors (tg = 1): the ``hf``
#: rollout engine and vLLM's ``update_weights`` (``weights_target = "hf"``: vLLM fuses while loading) take those.
#: For vLLM's own fused, per-TP-rank shards use :meth:`WeightHandover.reshard` with ``build_vllm_layout``.
TARGETS = ("hf", "vllm")
_EMBEDDING = "model.embed_tokens.weight"


@dataclass(frozen=True, slots=True)
class _Fetch:
    """A pending fetch-back (``park=True`` where some rank's training shard is not inside its generation shards):
    the reverse plan, this rank's generation shards (its source; other ranks fetch from them) and, per training
    shard, the cells no generation shard on this rank holds (what this rank fetches)."""

    plan: ReshardPlan
    shards: dict[str, torch.Tensor]
    cells: dict[str, tuple[tuple[slice, ...], ...]]
    copies: dict[str, torch.Tensor]  # the tied copy by name; it is fetched as the embedding


@dataclass(frozen=True, kw_only=True, slots=True)
class HandoverStats:
    """What one handover measured on this rank.

    ``path="reshard"``: the planner's ``hybridflow`` plan ran through ``execute_reshard``; ``bytes_received`` and
    ``bytes_sent`` are the executor's counts, ``lower_bound_bytes`` what this rank had to receive at least (its
    target shards minus what it held), ``peak_extra_bytes`` the executor's memory high-water mark above
    max(source, target) footprint, ``max_bucket_cost`` the plan's largest bucket, ``aliased_bytes`` the generation
    shards handed over as views of the training parameters, ``parked_bytes`` the training storage released while
    generating (``park=True``), ``fetch_bytes`` what the restore will receive back (the lower bound of the reverse
    plan: the training bytes that lie only in other ranks' generation shards; 0 where every rank's training shard
    lies in its own generation shards). ``path="gather"``: the padded-vocab fallback (all-gather over t, broadcast
    over p), which reports received bytes only.
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
    fetch_bytes: int = 0


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
        self._fetch: _Fetch | None = None
        self._fetches: dict[Hashable, bool] = {}
        self._hooked = False
        #: the executor's stats of the last fetch-back (``restore`` after a park with cells on other ranks)
        self.last_fetch_stats: ReshardStats | None = None

    @property
    def parked_bytes(self) -> int:
        """Training storage bytes released now (parked in generation shards); 0 when everything is home."""
        return 0 if self._parking is None else self._parking.parked_bytes

    def restore(self) -> int:
        """Give the storage parked by ``reshard(park=True)`` back, bit for bit, from the generation shards holding
        it; returns the bytes restored (0: nothing was parked). After a park whose training shards do not all lie in
        their own rank's generation shards it is a collective over all ranks: the cells that lie only in other ranks'
        generation shards come back by the reverse plan (``last_fetch_stats``)."""
        parking, self._parking = self._parking, None
        fetch, self._fetch = self._fetch, None
        restored = 0 if parking is None else parking.restore()
        if fetch is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            with torch.no_grad():
                fetched, self.last_fetch_stats = execute_reshard(fetch.plan, fetch.shards, rank=rank)
                if restored:  # its cells are zero now (a rank whose buffer stayed holds them already)
                    local = {**dict(self._engine.iter_weight_shards()), **fetch.copies}
                    for name, cells in fetch.cells.items():
                        source = fetched[_EMBEDDING if name in fetch.copies else name]
                        for cell in cells:
                            local[name][cell].copy_(source[cell])
            del fetched
        return restored

    def _needs_fetch(self, plan: ReshardPlan, key: Hashable) -> bool:
        """Whether some rank's training shard has bytes outside its own generation shards (the same answer on every
        rank: parking then fetches back, a collective restore)."""
        if key not in self._fetches:
            self._fetches[key] = any(aside for rank in range(plan.world_size)
                                     for _, aside in parking_cells(plan, rank).values())
        return self._fetches[key]

    def _tied_copies(self, rank: int) -> dict[str, tuple[torch.Tensor, tuple[Piece, ...]]]:
        """The parameter the handover skips, as a copy for :class:`StorageParking`: on a pipeline's last stage (p > 1)
        megatron keeps ``output_layer.weight``, a copy of the tied embedding (its embedding-group all-reduce keeps
        the two equal), which the layout describes once, on the first stage. Its pieces are the embedding's on
        this rank's coordinates, so it parks in the rank's generation shard of the embedding and comes back from it."""
        from hybridflow_megatron.spec_names import named_local_parameters

        engine = self._engine
        if not engine.arch.tied_embeddings:
            return {}
        source = self.source_layout()
        spec = source.params.get(_EMBEDDING)
        copies = {}
        for name, param in named_local_parameters(engine.module):
            if name == "output_layer.weight" and spec is not None:
                pieces = dataclasses.replace(spec, pipeline_stage=None).pieces(source.mesh, rank)
                copies[name] = (param.detach(), pieces)
        return copies

    def _install_restore_hook(self) -> None:
        """Once: a forward of the model restores first, so a caller that skips ``end_generation()`` never reads
        released storage (the engine's own methods restore explicitly too); where the restore is a collective (a
        fetch-back) the forward raises instead."""
        if self._hooked:
            return
        self._hooked = True
        ref = weakref.ref(self)

        def restore(*_: Any, **__: Any) -> None:
            owner = ref()
            if owner is None:
                return
            if owner._fetch is not None:  # a collective: one rank's forward must not start it alone
                raise EngineError(
                    "the training weights are parked with cells that only other ranks' generation shards hold; "
                    "call engine.end_generation() on every rank (a collective) before running the model")
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

    def reverse_plan_for(self, target: ModelLayout) -> ReshardPlan:
        """The ``hybridflow`` plan from ``target`` back to the engine's layout (the fetch-back after a park whose
        training shards do not all lie in their own rank's generation shards): planned once per target."""
        key = ("reverse", _layout_key(target))
        if key not in self._plans:
            source = self.source_layout()
            embedding = source.params.get(_EMBEDDING)
            if self._engine.arch.tied_embeddings and embedding is not None and embedding.pipeline_stage is not None:
                # the last stage fetches its tied copy's cells too: the embedding, on every stage
                source = dataclasses.replace(source, params={
                    **source.params, _EMBEDDING: dataclasses.replace(embedding, pipeline_stage=None)})
            self._plans[key] = plan_reshard(target, source, strategy="hybridflow", bucket_bytes=self.bucket_bytes)
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
        follow the next optimizer step). ``park=True`` (implies views): the training storage (Megatron's DDP param
        buffer, the last stage's tied output-layer copy included) is released once the generation shards hold it,
        so the rank holds each weight once while generating (:class:`hybridflow.resharding.StorageParking`); the
        engine's ``end_generation()`` (or its next use of the weights) brings it back bit for bit, fetching from
        other ranks' generation shards what none of this rank's holds (then a collective over all ranks). Do not
        write into the returned shards until then."""
        self._check_plannable()
        started = time.perf_counter()
        plan = self.plan_for(target)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.restore()  # a previous handover's parked storage comes home before anything reads it
        local = dict(self._engine.iter_weight_shards())
        fetch = park and self._needs_fetch(plan, _layout_key(target))
        copies = self._tied_copies(rank) if park else {}
        parking = StorageParking(plan, rank, local, copies=copies, aside="fetch" if fetch else False) if park else None
        with torch.no_grad():
            shards, stats = execute_reshard(plan, local, rank=rank, views=views or park,
                                            on_release=None if parking is None else parking.on_release)
            parked = 0 if parking is None else parking.finish(shards)
        if parking is not None and parked:
            self._parking = parking
            self._install_restore_hook()
        reverse = self.reverse_plan_for(target) if fetch else None
        if reverse is not None and parking is not None:  # every rank: the others fetch from its generation shards
            self._fetch = _Fetch(reverse, dict(shards), parking.fetch_cells,
                                 {name: tensor for name, (tensor, _) in copies.items()})
        self._engine.last_handover_stats = HandoverStats(
            rank=rank, path="reshard", target=name, tensors=len(shards), bytes_received=stats.bytes_received,
            bytes_sent=stats.bytes_sent, lower_bound_bytes=plan.lower_bound_bytes(rank),
            peak_extra_bytes=stats.peak_extra_bytes, max_bucket_cost=plan.max_bucket_cost(), buckets=stats.buckets,
            seconds=time.perf_counter() - started, aliased_bytes=stats.aliased_bytes, parked_bytes=parked,
            fetch_bytes=0 if reverse is None else reverse.lower_bound_bytes(rank),
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
