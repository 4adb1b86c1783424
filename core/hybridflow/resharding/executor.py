"""Runs a :class:`ReshardPlan` on one rank over torch.distributed (gloo on CPU, nccl on CUDA), bucket by bucket,
freeing source shards as soon as the plan no longer reads them, and measures bytes moved and peak extra memory.

It trusts the plan; building one is :func:`hybridflow.resharding.plan_reshard`'s job. Stability: public.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.errors import ReshardError
from hybridflow.resharding.assign import Transfer
from hybridflow.resharding.planner import CollectiveOp, ReshardPlan, Segment
from hybridflow.resharding.specs import Box, ModelLayout, Piece

__all__ = ["ReshardStats", "execute_reshard"]

_GROUP_CACHE: dict[tuple[str, tuple[int, ...]], Any] = {}


@dataclass(frozen=True, kw_only=True, slots=True)
class ReshardStats:
    """What one rank measured: bytes passed through the collectives it ran, and its memory high-water mark.

    ``peak_extra_bytes`` is the peak of (live source shards + live target/staging tensors + communication buffers)
    minus the larger of the rank's source and target footprints, i.e. what the transition costs on top.
    ``aliased_bytes`` counts target shards returned as views of source shards (``views=True``): bytes neither
    moved nor copied, whose storage the source keeps.
    """

    rank: int
    bytes_sent: int
    bytes_received: int
    peak_bytes: int
    peak_extra_bytes: int
    source_bytes: int
    target_bytes: int
    buckets: int
    aliased_bytes: int = 0


class _Memory:
    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def sub(self, nbytes: int) -> None:
        self.live -= nbytes


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Index:
    """Canonical name → (parameter, piece) held by one rank in one layout."""

    def __init__(self, layout: ModelLayout, rank: int) -> None:
        self.by_canonical: dict[str, list[tuple[str, Piece]]] = {}
        for name, pieces in layout.pieces(rank).items():
            for piece in pieces:
                self.by_canonical.setdefault(piece.canonical, []).append((name, piece))
        self._found: dict[tuple[str, Box], tuple[str, tuple[slice, ...]]] = {}

    @classmethod
    def of(cls, plan: ReshardPlan, which: str, rank: int) -> _Index:
        """The index of ``plan``'s ``source``, ``staging`` or ``target`` layout on ``rank``, built once per plan."""
        return plan.memoized(("index", which, rank), lambda: cls(getattr(plan, which), rank))

    def locate(self, canonical: str, box: Box) -> tuple[str, tuple[slice, ...]]:
        found = self._found.get((canonical, box))
        if found is not None:
            return found
        for name, piece in self.by_canonical.get(canonical, []):
            if all(p0 <= b0 and b1 <= p1 for (p0, p1), (b0, b1) in zip(piece.box, box, strict=True)):
                found = self._found[(canonical, box)] = name, piece.local_slices(box)
                return found
        raise ReshardError(f"box {box} of {canonical!r} is not held locally; the plan does not match the layouts.")


def _local_shapes(plan: ReshardPlan, which: str, rank: int) -> dict[str, tuple[int, ...] | None]:
    """Every parameter's local shard shape on ``rank`` in ``plan``'s ``source`` or ``staging`` layout (None where the
    rank holds none of it), computed once per plan."""
    layout: ModelLayout = getattr(plan, which)
    return plan.memoized(("shapes", which, rank),
                         lambda: {name: spec.local_shape(layout.mesh, rank) for name, spec in layout.params.items()})


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)


def _subgroup(parent: Any, ranks: tuple[int, ...]) -> Any:
    """Process group over plan ranks ``ranks`` of the default group, created once per process and cached.

    ``new_group`` is collective over the default group, so every rank creates every group of a plan in the plan's
    order, members or not (see :meth:`ReshardPlan.collective_groups`).
    """
    if parent is not None and parent is not dist.group.WORLD:
        return None
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    key = (str(id(dist.group.WORLD)), ranks)
    if key not in _GROUP_CACHE:
        _GROUP_CACHE[key] = dist.new_group(ranks=list(ranks))
    return _GROUP_CACHE[key]


def execute_reshard(
    plan: ReshardPlan,
    local_shards: MutableMapping[str, torch.Tensor],
    *,
    rank: int,
    group: Any = None,
    views: bool = False,
    on_release: Callable[[str, Mapping[str, torch.Tensor]], None] | None = None,
) -> tuple[dict[str, torch.Tensor], ReshardStats]:
    """Move this rank's training shards to its generation shards; every rank of ``group`` must call it with the
    same plan.

    ``local_shards`` holds this rank's source shards by source parameter name; it is consumed: entries are popped
    as soon as the plan no longer reads them, so drop other references to let the memory go. Plan rank ``i`` is
    rank ``i`` of ``group`` (default: the default process group, which may be absent for a one-rank plan).

    ``views=True``: a target shard whose whole box this rank already holds inside one source shard (e.g. FSDP
    shards that are the tensor-parallel shards, d == tg) is returned as a view of that source shard instead of a
    copy (contiguous views only, never for the baselines' staged tensors); the caller must then not write into it.

    Returns:
        The target shards by target parameter name, and the measured :class:`ReshardStats`.

    Raises:
        ReshardError: the shards or the process group do not match the plan.
    """
    world = plan.world_size
    if world > 1:  # a one-rank plan moves nothing and needs no process group
        if not dist.is_initialized():
            raise ReshardError(f"plan spans {world} ranks but torch.distributed is not initialized.")
        if dist.get_world_size(group) != world or dist.get_rank(group) != rank:
            raise ReshardError(
                f"plan expects {world} ranks with this one at {rank}; the process group has "
                f"{dist.get_world_size(group)} ranks and this process is {dist.get_rank(group)}."
            )
    _check_shards(plan, local_shards, rank)
    device = next(iter(local_shards.values())).device if local_shards else torch.device("cpu")
    memory = _Memory()
    source_bytes = sum(_nbytes(t) for t in local_shards.values())
    memory.add(source_bytes)
    src_index, stage_index = _Index.of(plan, "source", rank), _Index.of(plan, "staging", rank)
    staged_mode = plan.staging is not plan.target
    if on_release is not None and staged_mode:
        raise ReshardError(f"on_release needs a direct plan; strategy {plan.strategy!r} stages full tensors first.")
    tgt_index = _Index.of(plan, "target", rank) if staged_mode else stage_index
    staging_shapes = _local_shapes(plan, "staging", rank)
    if world > 1:
        for ranks in plan.collective_groups():
            _subgroup(group, ranks)
    staging: dict[str, torch.Tensor] = {}
    targets: dict[str, torch.Tensor] = {}
    sent = received = aliased = 0
    kept: set[str] = set()  # source shards some target views: their storage stays after release
    for bucket_index, bucket in enumerate(plan.buckets):
        viewed: set[str] = set()
        for name in bucket.params:
            shape = staging_shapes[name]
            if shape is None:
                continue
            view = (_local_view(plan, bucket_index, name, rank, local_shards, src_index)
                    if views and not staged_mode else None)
            if view is not None:
                staging[name], source_name = view
                viewed.add(name)
                kept.add(source_name)
                aliased += _nbytes(view[0])
                continue
            staging[name] = torch.empty(shape, dtype=plan.staging.params[name].dtype, device=device)
            memory.add(_nbytes(staging[name]))
        for t in bucket.local:
            if t.target_rank == rank and stage_index.locate(t.canonical, t.box)[0] not in viewed:
                src_name, src_slices = src_index.locate(t.canonical, t.box)
                dst_name, dst_slices = stage_index.locate(t.canonical, t.box)
                staging[dst_name][dst_slices] = local_shards[src_name][src_slices]
        pending = [
            _prepare(op, rank, local_shards, src_index, memory, device, collective=world > 1 and op.kind ==
                     "all_gather" and _subgroup(group, op.ranks) is not None)
            for op in bucket.ops if rank in op.ranks
        ]
        for name in bucket.release:  # everything this bucket sends is packed: the training copy can go
            tensor = local_shards.pop(name, None)
            if tensor is not None and name not in kept:
                memory.sub(_nbytes(tensor))
                if on_release is not None:
                    on_release(name, staging)
            del tensor
        for prepared in pending:
            s, r = prepared.communicate(rank, staging, stage_index, group, memory, device)
            sent, received = sent + s, received + r
        if staged_mode:
            _finish_from_staging(plan, rank, bucket.params, staging, targets, tgt_index, memory, device)
        else:
            targets.update({name: staging.pop(name) for name in bucket.params if name in staging})
    for name in list(local_shards):
        tensor = local_shards.pop(name)
        if name not in kept:
            memory.sub(_nbytes(tensor))
            if on_release is not None:
                on_release(name, targets)
    target_bytes = sum(_nbytes(t) for t in targets.values())
    stats = ReshardStats(
        rank=rank, bytes_sent=sent, bytes_received=received, peak_bytes=memory.peak,
        peak_extra_bytes=max(0, memory.peak - max(source_bytes, target_bytes)), source_bytes=source_bytes,
        target_bytes=target_bytes, buckets=len(plan.buckets), aliased_bytes=aliased,
    )
    return targets, stats


def _local_view(plan: ReshardPlan, bucket_index: int, name: str, rank: int,
                shards: MutableMapping[str, torch.Tensor], src: _Index) -> tuple[torch.Tensor, str] | None:
    """A contiguous view of the source shard holding target ``name``'s whole (single, unfused) piece on ``rank``,
    with that source's name; None when the piece is not held whole locally or any byte of it arrives remotely."""
    where = plan.memoized(("view", bucket_index, name, rank),
                          lambda: _local_view_place(plan, plan.buckets[bucket_index], name, rank, src))
    if where is None:
        return None
    source_name, slices, expected = where
    view = shards[source_name][slices]
    if tuple(view.shape) != expected or not view.is_contiguous():
        return None
    return view, source_name


def _local_view_place(plan: ReshardPlan, bucket: Any, name: str, rank: int,
                      src: _Index) -> tuple[str, tuple[slice, ...], tuple[int, ...] | None] | None:
    """Where :func:`_local_view` finds target ``name`` on ``rank`` (source name, slices, expected shape), from the
    plan alone; None when no source shard can hold it whole."""
    spec = plan.staging.params[name]
    pieces = spec.pieces(plan.staging.mesh, rank)
    if spec.fused is not None or len(pieces) != 1 or pieces[0].canonical != name:
        return None
    piece = pieces[0]
    if any(t.target_rank == rank and t.source_rank != rank and t.canonical == name
           for op in bucket.ops for t in op.transfers):
        return None
    try:
        source_name, slices = src.locate(name, piece.box)
    except ReshardError:
        return None
    return source_name, slices, spec.local_shape(plan.staging.mesh, rank)


def _check_shards(plan: ReshardPlan, shards: MutableMapping[str, torch.Tensor], rank: int) -> None:
    layout = plan.source
    expected = {name: shape for name, shape in _local_shapes(plan, "source", rank).items() if shape is not None}
    if shards.keys() != expected.keys():
        missing, extra = sorted(set(expected) - set(shards)), sorted(set(shards) - set(expected))
        raise ReshardError(
            f"rank {rank}: local shards do not match the source layout; missing {missing[:5]}, unexpected "
            f"{extra[:5]}. Pass exactly the parameters this rank holds."
        )
    for name, shape in expected.items():
        tensor = shards[name]
        if tuple(tensor.shape) != shape or tensor.dtype != layout.params[name].dtype:
            raise ReshardError(
                f"rank {rank}: shard {name!r} is {tuple(tensor.shape)} {tensor.dtype}; the source layout expects "
                f"{shape} {layout.params[name].dtype}."
            )


def _pack(buffer: torch.Tensor, segments: list[Segment], shards: MutableMapping[str, torch.Tensor],
          index: _Index) -> None:
    offset = 0
    for canonical, box in segments:
        name, slices = index.locate(canonical, box)
        source = _byte_view(shards[name][slices])
        buffer[offset:offset + source.numel()].view(source.shape).copy_(source)
        offset += source.numel()


def _unpack(buffer: torch.Tensor, segments: list[Segment], staging: dict[str, torch.Tensor], index: _Index) -> None:
    offset = 0
    for canonical, box in segments:
        name, slices = index.locate(canonical, box)
        target = _byte_view(staging[name][slices])
        target.copy_(buffer[offset:offset + target.numel()].view(target.shape))
        offset += target.numel()


class _Prepared:
    """One collective of a bucket with its outgoing bytes already packed."""

    def __init__(self, op: CollectiveOp, collective: bool, flat: torch.Tensor | None,
                 sends: dict[int, torch.Tensor], incoming: dict[int, list[Transfer]]) -> None:
        self.op, self.collective, self.flat, self.sends, self.incoming = op, collective, flat, sends, incoming

    def communicate(self, rank: int, staging: dict[str, torch.Tensor], stage: _Index, group: Any, memory: _Memory,
                    device: torch.device) -> tuple[int, int]:
        """Run the collective, unpack what arrived into ``staging`` and free the buffers; returns (sent, received)."""
        op = self.op
        if self.collective:
            assert self.flat is not None
            members, me = len(op.ranks), op.ranks.index(rank)
            slots = list(torch.split(self.flat, self.flat.numel() // members))
            own = slots[me].clone() if device.type == "cuda" else slots[me]
            dist.all_gather(slots, own, group=_subgroup(group, op.ranks))
            for index, segments in enumerate(op.contributions):
                if index != me:
                    _unpack(slots[index], list(segments), staging, stage)
            memory.sub(self.flat.numel())
            moved = slots[me].numel() * (members - 1)
            return moved, moved

        def peer(other: int) -> int:
            return dist.get_global_rank(group, other) if group is not None else other

        ops = [dist.P2POp(dist.isend, buffer, peer(other), group=group) for other, buffer in self.sends.items()]
        receives = []
        for other, transfers in sorted(self.incoming.items()):
            buffer = torch.empty(sum(t.nbytes for t in transfers), dtype=torch.uint8, device=device)
            memory.add(buffer.numel())
            ops.append(dist.P2POp(dist.irecv, buffer, peer(other), group=group))
            receives.append((buffer, transfers))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for buffer, transfers in receives:
            _unpack(buffer, [(t.canonical, t.box) for t in transfers], staging, stage)
        sent = sum(b.numel() for b in self.sends.values())
        received = sum(b.numel() for b, _ in receives)
        unique = {id(b): b.numel() for b in self.sends.values()}
        memory.sub(sum(unique.values()) + received)
        self.sends.clear()
        return sent, received


def _prepare(op: CollectiveOp, rank: int, shards: MutableMapping[str, torch.Tensor], src: _Index, memory: _Memory,
             device: torch.device, *, collective: bool) -> _Prepared:
    """Pack what ``rank`` sends in ``op``: its all-gather slot, or one buffer per receiving peer.

    An all-gather inside a caller-provided subgroup runs as its point-to-point transfers (same bytes).
    """
    if collective:
        sizes = {(t.canonical, t.box): t.nbytes for t in op.transfers}
        slot = sum(sizes[s] for s in op.contributions[0])
        flat = torch.empty(slot * len(op.ranks), dtype=torch.uint8, device=device)
        memory.add(flat.numel())
        me = op.ranks.index(rank)
        _pack(flat[me * slot:(me + 1) * slot], list(op.contributions[me]), shards, src)
        return _Prepared(op, True, flat, {}, {})
    outgoing: dict[int, list[Transfer]] = {}
    incoming: dict[int, list[Transfer]] = {}
    for t in op.transfers:
        if t.source_rank == rank:
            outgoing.setdefault(t.target_rank, []).append(t)
        if t.target_rank == rank:
            incoming.setdefault(t.source_rank, []).append(t)
    sends: dict[int, torch.Tensor] = {}
    packed: dict[tuple[Segment, ...], torch.Tensor] = {}  # peers wanting the same bytes share one buffer
    for other, transfers in sorted(outgoing.items()):
        key = tuple((t.canonical, t.box) for t in transfers)
        if key not in packed:
            packed[key] = torch.empty(sum(t.nbytes for t in transfers), dtype=torch.uint8, device=device)
            memory.add(packed[key].numel())
            _pack(packed[key], list(key), shards, src)
        sends[other] = packed[key]
    return _Prepared(op, False, None, sends, incoming)


def _finish_from_staging(plan: ReshardPlan, rank: int, params: tuple[str, ...], staging: dict[str, torch.Tensor],
                         targets: dict[str, torch.Tensor], index: _Index, memory: _Memory,
                         device: torch.device) -> None:
    """Baselines: slice target shards out of staged full canonical tensors, then drop those."""
    for canonical in params:
        full = staging.pop(canonical, None)
        if full is None:
            continue
        for name, piece in index.by_canonical.get(canonical, []):
            if name not in targets:
                spec = plan.target.params[name]
                shape = spec.local_shape(plan.target.mesh, rank)
                assert shape is not None
                targets[name] = torch.empty(shape, dtype=spec.dtype, device=device)
                memory.add(_nbytes(targets[name]))
            targets[name][piece.local_slices(piece.box)] = full[tuple(slice(a, b) for a, b in piece.box)]
        memory.sub(_nbytes(full))
        del full
