"""Reshard planner: per rank the exact boxes to copy, send and receive, grouped into collectives and bounded
buckets, for HybridFlow's stride grouping and for the three baselines, plus the per-rank lower bound.

The planner moves no bytes; :mod:`hybridflow.resharding.executor` runs a plan. Stability: public.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast, get_args

from hybridflow.errors import LayoutError, ReshardError
from hybridflow.resharding.assign import (
    Transfer,
    assign_contributions,
    assign_minimal,
    collect_boxes,
    staged_canonicals,
)
from hybridflow.resharding.layout import GenerationLayout
from hybridflow.resharding.specs import ModelLayout, ParamShardSpec, box_numel, intersect_boxes

__all__ = ["Strategy", "STRATEGIES", "CollectiveOp", "Bucket", "ReshardPlan", "plan_reshard", "lower_bound_bytes"]

Strategy = Literal["hybridflow", "full_gather", "consecutive", "per_tensor_allgather"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
DEFAULT_BUCKET_BYTES = 64 << 20
Segment = tuple[str, tuple[tuple[int, int], ...]]
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class CollectiveOp:
    """One collective inside a bucket.

    ``all_gather``: member ``i`` of ``ranks`` contributes ``contributions[i]`` (equal byte counts) and every member
    receives every other contribution. ``all_to_all``: an all-to-all-v over ``ranks`` run as batched point-to-point
    messages, one per (source, target) pair.
    """

    kind: Literal["all_gather", "all_to_all"]
    ranks: tuple[int, ...]
    transfers: tuple[Transfer, ...]
    contributions: tuple[tuple[Segment, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class Bucket:
    """Staged parameters filled together, the local copies and collectives that fill them, the source
    parameters that may be freed once the bucket is done, and its planned cost: the most any rank allocates for it
    (new shards or the source bytes they replace, plus send and receive buffers)."""

    params: tuple[str, ...]
    local: tuple[Transfer, ...]
    ops: tuple[CollectiveOp, ...]
    release: tuple[str, ...]
    cost: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class ReshardPlan:
    """A complete plan (stability: public). ``staging`` is what the collectives fill: the target itself for
    ``hybridflow``, full canonical tensors for the baselines (each rank then slices its target shard out)."""

    source: ModelLayout
    target: ModelLayout
    staging: ModelLayout
    strategy: Strategy
    bucket_bytes: int
    buckets: tuple[Bucket, ...]
    #: what running the plan derives from it per rank and never changes (indices, shapes, views, parking cells, the
    #: lower bound), computed on a rank's first run: a plan reused every step pays for it once
    memo: dict[tuple[Any, ...], Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    def memoized(self, key: tuple[Any, ...], compute: Callable[[], _T]) -> _T:
        """``compute()``, remembered under ``key`` for the plan's life (it must depend on the plan and key only)."""
        if key not in self.memo:
            self.memo[key] = compute()
        return cast("_T", self.memo[key])

    @property
    def world_size(self) -> int:
        """Ranks the plan runs on."""
        return self.source.world_size

    def _transfers(self) -> list[Transfer]:
        return [t for bucket in self.buckets for op in bucket.ops for t in op.transfers]

    def bytes_received(self, rank: int) -> int:
        """Bytes ``rank`` receives under this plan."""
        return sum(t.nbytes for t in self._transfers() if t.target_rank == rank)

    def bytes_sent(self, rank: int) -> int:
        """Bytes ``rank`` sends under this plan (an all-gather contribution counts once per receiver)."""
        return sum(t.nbytes for t in self._transfers() if t.source_rank == rank)

    def lower_bound_bytes(self, rank: int) -> int:
        """Bytes ``rank`` must receive at least: its target shards minus what it already holds."""
        return self.memoized(("lower_bound_bytes", rank), lambda: lower_bound_bytes(self.source, self.target, rank))

    def max_bucket_cost(self) -> int:
        """Largest planned bucket cost; above ``bucket_bytes`` only when one parameter alone exceeds it."""
        return max((bucket.cost for bucket in self.buckets), default=0)

    def collective_groups(self) -> tuple[tuple[int, ...], ...]:
        """Rank groups of every all-gather, in first-use order (every rank creates them in this order)."""
        seen: dict[tuple[int, ...], None] = {}
        for bucket in self.buckets:
            for op in bucket.ops:
                if op.kind == "all_gather":
                    seen.setdefault(op.ranks, None)
        return tuple(seen)

    def describe(self) -> str:
        """A short human-readable summary, one line per bucket."""
        lines = [f"{self.strategy}: {len(self.buckets)} bucket(s), world {self.world_size}"]
        for index, bucket in enumerate(self.buckets):
            ops = ", ".join(f"{op.kind}{list(op.ranks)}" for op in bucket.ops) or "local only"
            lines.append(f"  bucket {index}: {len(bucket.params)} param(s): {ops}")
        return "\n".join(lines)


def lower_bound_bytes(source: ModelLayout, target: ModelLayout, rank: int) -> int:
    """Σ over target parameters of (bytes of the shard ``rank`` needs − bytes of it ``rank`` already holds)."""
    held: dict[str, list[tuple[tuple[int, int], ...]]] = defaultdict(list)
    for pieces in source.pieces(rank).values():
        for piece in pieces:
            held[piece.canonical].append(piece.box)
    total = 0
    for name, pieces in target.pieces(rank).items():
        itemsize = target.params[name].dtype.itemsize
        for piece in pieces:
            overlap = sum(
                box_numel(hit) for box in held[piece.canonical] if (hit := intersect_boxes(piece.box, box)) is not None
            )
            total += (box_numel(piece.box) - overlap) * itemsize
    return total


def _replicated_layout(layout: ModelLayout) -> ModelLayout:
    """Every canonical tensor of ``layout`` in full on every rank of its mesh."""
    params = {
        name: ParamShardSpec(name=name, shape=shape, dtype=dtype)
        for name, (shape, dtype) in layout.canonical_shapes().items()
    }
    return ModelLayout(mesh=layout.mesh, params=params)


def _check_compatible(source: ModelLayout, target: ModelLayout) -> None:
    if source.world_size != target.world_size:
        raise ReshardError(
            f"source mesh has {source.world_size} ranks but target mesh has {target.world_size}; build the "
            "generation layout with training=<the source ParallelLayout>."
        )
    a, b = source.canonical_shapes(), target.canonical_shapes()
    if a != b:
        diff = sorted(name for name in a.keys() | b.keys() if a.get(name) != b.get(name))
        raise ReshardError(
            f"source and target describe different canonical tensors (shape, dtype or name) for {diff[:5]}"
            f"{' ...' if len(diff) > 5 else ''}; both layouts must cover the same weights."
        )


def _is_all_gather(members: list[int], transfers: list[Transfer]) -> list[tuple[Segment, ...]] | None:
    payload: dict[tuple[int, int], list[Segment]] = defaultdict(list)
    for t in transfers:
        payload[(t.source_rank, t.target_rank)].append((t.canonical, t.box))
    contributions = []
    for member in members:
        sends = [tuple(sorted(payload.get((member, other), []))) for other in members if other != member]
        if not sends[0] or any(s != sends[0] for s in sends):
            return None
        contributions.append(sends[0])
    itemsizes = {(t.canonical, t.box): t.nbytes for t in transfers}
    sizes = {sum(itemsizes[s] for s in c) for c in contributions}
    return contributions if len(sizes) == 1 else None


def _classify(transfers: list[Transfer]) -> list[CollectiveOp]:
    """Split remote transfers into connected groups; a group whose members all send one equal payload to every
    other member is an all-gather, any other group an all-to-all."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for t in transfers:
        parent[find(t.source_rank)] = find(t.target_rank)
    groups: dict[int, list[Transfer]] = defaultdict(list)
    for t in transfers:
        groups[find(t.source_rank)].append(t)
    ops = []
    for group in groups.values():
        members = sorted({t.source_rank for t in group} | {t.target_rank for t in group})
        contributions = _is_all_gather(members, group)
        kind: Literal["all_gather", "all_to_all"] = "all_gather" if contributions else "all_to_all"
        ops.append(CollectiveOp(kind, tuple(members), tuple(group), tuple(contributions or ())))
    return sorted(ops, key=lambda op: (op.kind, op.ranks))


def _merge(ops: list[CollectiveOp]) -> list[CollectiveOp]:
    by_group: dict[tuple[str, tuple[int, ...]], list[CollectiveOp]] = defaultdict(list)
    for op in ops:
        by_group[(op.kind, op.ranks)].append(op)
    out = []
    for (kind, ranks), group in sorted(by_group.items()):
        transfers = tuple(t for op in group for t in op.transfers)
        contributions = tuple(
            tuple(s for op in group for s in op.contributions[i]) for i in range(len(ranks))
        ) if kind == "all_gather" else ()
        out.append(CollectiveOp(group[0].kind, ranks, transfers, contributions))
    return out


def _ops_for(per_param: dict[str, list[Transfer]]) -> list[CollectiveOp]:
    remote = [t for transfers in per_param.values() for t in transfers if t.source_rank != t.target_rank]
    whole = _classify(remote)
    if all(op.kind == "all_gather" for op in whole):
        return whole
    ops = []
    for transfers in per_param.values():
        ops.extend(_classify([t for t in transfers if t.source_rank != t.target_rank]))
    return _merge(ops)


def _bucket_costs(transfers: list[Transfer], staging: ModelLayout, held: list[dict[str, int]], param: str,
                  canonicals: list[str]) -> dict[int, int]:
    """Per rank, what filling ``param`` allocates on top: max(its new shard, the source bytes it replaces) plus
    the bytes it sends and receives. ``held[rank][canonical]`` is the source bytes a rank holds."""
    cost: dict[int, int] = defaultdict(int)
    payloads: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for t in transfers:
        if t.source_rank != t.target_rank:
            cost[t.target_rank] += t.nbytes
            payloads[(t.source_rank, t.target_rank)].append(t)
    unique: dict[int, dict[tuple[tuple[str, tuple[tuple[int, int], ...]], ...], int]] = defaultdict(dict)
    for (sender, _), sent in payloads.items():  # the executor packs bytes wanted by several peers once
        unique[sender][tuple((t.canonical, t.box) for t in sent)] = sum(t.nbytes for t in sent)
    for sender, packs in unique.items():
        cost[sender] += sum(packs.values())
    spec = staging.params[param]
    for rank in range(staging.world_size):
        new = sum(box_numel(p.box) for p in spec.pieces(staging.mesh, rank)) * spec.dtype.itemsize
        old = sum(held[rank].get(canonical, 0) for canonical in canonicals)
        if new or old:
            cost[rank] += max(new, old)
    return cost


def plan_reshard(
    source: ModelLayout,
    target: ModelLayout,
    *,
    strategy: Strategy = "hybridflow",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> ReshardPlan:
    """Plan the move from ``source`` shards to ``target`` shards.

    ``hybridflow`` receives exactly the lower bound, from the holder in the same training replica where possible,
    in buckets whose per-rank new allocations (shards, send and receive buffers) stay under ``bucket_bytes``; a
    single parameter larger than that gets a bucket of its own.
    Baselines: ``full_gather`` (every rank gathers the whole model, ZeRO-3 style, then slices),
    ``consecutive`` (generation groups drawn consecutively; the full model is all-gathered inside each training
    shard group, then sliced), ``per_tensor_allgather`` (tensor by tensor, full all-gather then slice).

    Raises:
        ReshardError: the layouts do not describe the same weights or world, or the strategy is unknown.
    """
    if strategy not in STRATEGIES:
        raise ReshardError(f"unknown reshard strategy {strategy!r}; known: {', '.join(STRATEGIES)}.")
    if bucket_bytes < 1:
        raise ReshardError(f"bucket_bytes must be positive; got {bucket_bytes}.")
    _check_compatible(source, target)
    if strategy == "consecutive" and isinstance(target.mesh, GenerationLayout):
        try:
            target = dataclasses.replace(target, mesh=dataclasses.replace(target.mesh, grouping="consecutive"))
        except LayoutError as exc:
            raise ReshardError(f"cannot draw consecutive generation groups: {exc}") from exc
    staging = target if strategy == "hybridflow" else _replicated_layout(target)
    canonical_shapes = staging.canonical_shapes()
    sources, staged = collect_boxes(source), collect_boxes(staging)
    owner = staged_canonicals(staging)

    def prefer(receiver: int, holder: int) -> tuple[int, ...] | None:
        same = source.mesh.replica(receiver) == source.mesh.replica(holder)
        if strategy != "hybridflow" and not same:
            return None
        return (0 if same else 1, (holder - receiver) % source.world_size)

    per_param: dict[str, dict[str, list[Transfer]]] = defaultdict(dict)
    for canonical, (shape, dtype) in canonical_shapes.items():
        if strategy == "full_gather":
            full = tuple((0, size) for size in shape)
            transfers = assign_contributions(canonical, dtype.itemsize, sources.get(canonical, {}),
                                             range(staging.world_size), full)
        else:
            transfers = assign_minimal(canonical, dtype.itemsize, sources.get(canonical, {}),
                                       staged.get(canonical, {}), prefer)
        per_param[owner[canonical]][canonical] = transfers

    names = list(staging.params)
    held: list[dict[str, int]] = [defaultdict(int) for _ in range(source.world_size)]
    for rank in range(source.world_size):
        for name, pieces in source.pieces(rank).items():
            for piece in pieces:
                held[rank][piece.canonical] += box_numel(piece.box) * source.params[name].dtype.itemsize
    costs = {name: _bucket_costs([t for ts in per_param[name].values() for t in ts], staging, held, name,
                                 list(per_param[name])) for name in names}
    groups: list[list[str]]
    if strategy in ("full_gather", "consecutive"):
        groups = [names]
    elif strategy == "per_tensor_allgather":
        groups = [[name] for name in names]
    else:
        current: list[str] = []
        cost: defaultdict[int, int] = defaultdict(int)
        groups = []
        for name in names:
            if current and any(cost[r] + value > bucket_bytes for r, value in costs[name].items()):
                groups.append(current)
                current, cost = [], defaultdict(int)
            current.append(name)
            for rank, value in costs[name].items():
                cost[rank] += value
        if current:
            groups.append(current)

    source_owner = staged_canonicals(source)
    last_use: dict[str, int] = {}
    for index, group in enumerate(groups):
        for name in group:
            for canonical in per_param[name]:
                last_use[source_owner[canonical]] = index
    buckets = []
    for index, group in enumerate(groups):
        flat = {f"{name}/{c}": ts for name in group for c, ts in per_param[name].items()}
        local = tuple(t for ts in flat.values() for t in ts if t.source_rank == t.target_rank)
        release = tuple(sorted(n for n in source.params if last_use.get(n, 0) == index))
        totals: dict[int, int] = defaultdict(int)
        for name in group:
            for rank, value in costs[name].items():
                totals[rank] += value
        buckets.append(Bucket(tuple(group), local, tuple(_ops_for(flat)), release, max(totals.values(), default=0)))
    return ReshardPlan(source=source, target=target, staging=staging, strategy=strategy,
                       bucket_bytes=bucket_bytes, buckets=tuple(buckets))
