"""Parking training storages while generating: a training shard whose every byte lies in this rank's generation
shards gives its storage up once :func:`~hybridflow.resharding.execute_reshard` has copied it there, and gets it
back, bit for bit, from those generation shards after generation (3D-HybridEngine's zero redundancy).

Engine-agnostic: it works on storages, so it serves an engine whose parameters each own a storage (released bucket by
bucket, through the executor's ``on_release`` hook) and one whose parameters share a flat buffer (Megatron's DDP
param buffer: released when its last parameter has been copied, or after the handover, once the generation shards
that are views into it have been made copies). Stability: public.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field

import torch

from hybridflow.resharding.planner import ReshardPlan
from hybridflow.resharding.specs import Piece

__all__ = ["Home", "parking_cells", "parking_homes", "StorageParking"]


@dataclass(frozen=True, slots=True)
class Home:
    """Where a piece of a training shard lives on while it is parked: ``target[target_slices]`` holds
    ``training_shard[source_slices]``."""

    source_slices: tuple[slice, ...]
    target: str
    target_slices: tuple[slice, ...]


def parking_cells(plan: ReshardPlan, rank: int) -> dict[str, tuple[tuple[Home, ...], tuple[tuple[slice, ...], ...]]]:
    """Every source parameter of ``plan`` on ``rank``: the homes of its bytes in ``rank``'s target shards of the same
    canonical tensor, and the slices of the shard that no target piece on ``rank`` holds (its *aside* cells).

    A (non-empty) piece lying whole inside one target piece is one home (fused sources, e.g. Megatron's qkv, have one
    per component); any other piece is cut along the boundaries of the target pieces it meets, each cell a home or
    aside (a ZeRO-3 flat row range under a column split: the rank's columns go home, the others aside)."""
    targets: dict[str, list[tuple[str, Piece]]] = {}
    for name, pieces in plan.target.pieces(rank).items():
        for piece in pieces:
            targets.setdefault(piece.canonical, []).append((name, piece))
    out: dict[str, tuple[tuple[Home, ...], tuple[tuple[slice, ...], ...]]] = {}
    for name, pieces in plan.source.pieces(rank).items():
        homes: list[Home] = []
        aside: list[tuple[slice, ...]] = []
        for piece in pieces:
            if any(stop <= start for start, stop in piece.box):
                continue
            meeting = [(target, candidate) for target, candidate in targets.get(piece.canonical, [])
                       if all(max(s0, h0) < min(s1, h1) for (s0, s1), (h0, h1)
                              in zip(piece.box, candidate.box, strict=True))]
            whole = next(((t, c) for t, c in meeting if _inside(piece.box, c.box)), None)
            cells = [piece.box] if whole is not None or not meeting else _cells(piece.box, [c.box for _, c in meeting])
            for cell in cells:
                home = whole if whole is not None else next(((t, c) for t, c in meeting if _inside(cell, c.box)), None)
                if home is None:
                    aside.append(piece.local_slices(cell))
                else:
                    homes.append(Home(piece.local_slices(cell), home[0], home[1].local_slices(cell)))
        out[name] = (tuple(homes), tuple(aside))
    return out


def parking_homes(plan: ReshardPlan, rank: int) -> dict[str, tuple[Home, ...]]:
    """Source parameters of ``plan`` on ``rank`` whose every byte lies in ``rank``'s target shards of the same
    canonical tensor, with those homes (:func:`parking_cells` without aside cells; an empty shard has none).
    Parameters with a byte outside the rank's targets are left out."""
    return {name: homes for name, (homes, aside) in parking_cells(plan, rank).items() if not aside}


Box = tuple[tuple[int, int], ...]


def _inside(box: Box, home: Box) -> bool:
    return all(h0 <= s0 and s1 <= h1 for (s0, s1), (h0, h1) in zip(box, home, strict=True))


def _cells(box: Box, homes: list[Box]) -> list[Box]:
    """``box`` cut along every boundary of ``homes`` that falls inside it: each cell lies inside a home or in none."""
    cuts = [sorted({lo, hi, *(c for home in homes for c in home[d] if lo < c < hi)}) for d, (lo, hi) in enumerate(box)]
    cells: list[Box] = [()]
    for points in cuts:
        cells = [(*cell, (a, b)) for cell in cells for a, b in itertools.pairwise(points)]
    return cells


def _key(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()


#: attribute under which a parked storage's owner tensor carries its aside copy (counted by ``count_storage_bytes``)
ASIDE_ATTRIBUTE = "parked_aside"


@dataclass(slots=True)
class _Storage:
    owner: torch.Tensor  # a tensor of the storage (resize_ works through any of them)
    members: set[str]
    released: set[str] = field(default_factory=set)
    nbytes: int = 0  # > 0 once parked


class StorageParking:
    """One handover's parking on one rank (stability: public).

    ``shards``: the training shards handed to the executor, by source name; ``others``: every other tensor that may
    share their storages (e.g. a tied copy the handover skips): a storage holding one of them is never released.
    Where a shard is a packed copy of what the engine stores (DeepSpeed's ZeRO-3 flat partitions), ``storages`` gives
    by name the tensor whose storage parks and ``write_back(name, shard)`` puts a shard rebuilt from its homes back
    into it; no reference to the packed copies is kept.
    Pass :meth:`on_release` as ``execute_reshard(..., on_release=...)`` and the executor's targets to :meth:`finish`;
    :meth:`restore` brings every parked storage back. Views (``views=True``) are fine: a storage some targets view
    is released in :meth:`finish` only when at least one of its shards was copied out (its viewing targets are made
    copies first, so the rank still holds every weight once).

    ``aside=True``: a storage also parks when some of its shards' bytes lie in no generation shard on this rank
    (:func:`parking_cells`), provided they are fewer than the storage's bytes: as each shard is released those cells
    are copied into a small aside buffer (one per shard, set on its ``storages`` tensor as ``parked_aside`` so that
    ``count_storage_bytes`` counts it), and :meth:`restore` puts them back. Without it such a storage stays.
    """

    def __init__(self, plan: ReshardPlan, rank: int, shards: Mapping[str, torch.Tensor], *,
                 others: Iterable[torch.Tensor] = (), storages: Mapping[str, torch.Tensor] | None = None,
                 write_back: Callable[[str, torch.Tensor], None] | None = None, aside: bool = False) -> None:
        cells = parking_cells(plan, rank)
        if not aside:
            cells = {name: found for name, found in cells.items() if not found[1]}
        blocked = {_key(t) for t in others if t.untyped_storage().nbytes()}
        owners = shards if storages is None else storages
        by_key: dict[tuple[str, int], _Storage] = {}
        for name in shards:
            tensor = owners[name]
            if not tensor.untyped_storage().nbytes():
                continue
            slot = by_key.setdefault(_key(tensor), _Storage(owner=tensor, members=set()))
            slot.members.add(name)

        def aside_bytes(slot: _Storage) -> int:
            return sum(shards[n][cell].numel() * shards[n].element_size() for n in slot.members for cell in cells[n][1])

        self._homes = {name: found[0] for name, found in cells.items()}
        self._cells = {name: found[1] for name, found in cells.items() if found[1]}
        self._write_back = write_back
        self._shards = dict(shards) if write_back is None else {}
        self._owners = dict(owners)
        self._meta = {name: (tuple(t.shape), t.dtype, t.device) for name, t in shards.items()}
        self._storages = {key: slot for key, slot in by_key.items()
                          if key not in blocked and all(name in cells for name in slot.members)
                          and aside_bytes(slot) < slot.owner.untyped_storage().nbytes()}
        self._by_name = {name: slot for slot in self._storages.values() for name in slot.members}
        self._pending = {name: shards[name] for name in self._by_name if name in self._cells}  # until copied aside
        self._aside: dict[str, torch.Tensor] = {}
        self._restore: list[tuple[_Storage, list[tuple[str, list[tuple[tuple[slice, ...], torch.Tensor,
                                                                      tuple[slice, ...]]]]]]] = []

    @property
    def parked_bytes(self) -> int:
        """Training storage bytes released now."""
        return sum(slot.nbytes for slot in self._storages.values())

    @property
    def aside_bytes(self) -> int:
        """Bytes held in aside buffers now (``aside=True``): what a parked storage kept that no generation shard
        holds."""
        return sum(t.numel() * t.element_size() for t in self._aside.values())

    def on_release(self, name: str, _targets: Mapping[str, torch.Tensor]) -> None:
        """The executor no longer reads shard ``name`` (it was copied into its generation shards): once every shard
        of its storage is, the storage goes."""
        slot = self._by_name.get(name)
        if slot is None:
            return
        self._set_aside(name)
        slot.released.add(name)
        if slot.released == slot.members:
            self._release(slot)

    def _set_aside(self, name: str) -> None:
        shard = self._pending.pop(name, None)
        if shard is not None:
            self._aside[name] = torch.cat([shard[cell].reshape(-1) for cell in self._cells[name]])

    def _release(self, slot: _Storage) -> None:
        for name in slot.members:
            self._set_aside(name)
            if name in self._aside:
                setattr(self._owners[name], ASIDE_ATTRIBUTE, self._aside[name])
        storage = slot.owner.untyped_storage()
        slot.nbytes = storage.nbytes()
        storage.resize_(0)  # every view of it (the engine's parameters, an optimizer's) sees it go

    def finish(self, targets: MutableMapping[str, torch.Tensor]) -> int:
        """After the handover: release the storages some targets still view (those targets become copies), where a
        shard of the storage was copied out; record where every parked shard lives on. Returns the parked bytes."""
        for key, slot in self._storages.items():
            if slot.nbytes or not slot.released:
                continue
            for name, tensor in targets.items():
                if tensor.untyped_storage().nbytes() and _key(tensor) == key:
                    targets[name] = tensor.clone()
            self._release(slot)
        self._pending.clear()
        for slot in self._storages.values():
            if slot.nbytes:
                places = [(name, [(home.source_slices, targets[home.target], home.target_slices)
                                  for home in self._homes[name]]) for name in sorted(slot.members)]
                self._restore.append((slot, places))
        return self.parked_bytes

    def restore(self) -> int:
        """Give every parked storage its bytes back (zeroed, then each shard copied from its generation shards and
        its aside buffer), one storage at a time, dropping the references to the generation shards; returns the bytes
        restored."""
        restored = 0
        with torch.no_grad():
            while self._restore:
                slot, places = self._restore.pop(0)
                storage = slot.owner.untyped_storage()
                storage.resize_(slot.nbytes)
                torch.empty(0, dtype=torch.uint8, device=slot.owner.device).set_(storage).zero_()
                for name, homes in places:
                    shape, dtype, device = self._meta[name]
                    shard = self._shards[name] if self._write_back is None else torch.zeros(
                        shape, dtype=dtype, device=device)
                    for source_slices, home, target_slices in homes:
                        shard[source_slices].copy_(home[target_slices])
                    self._put_back(name, shard)
                    if self._write_back is not None:
                        self._write_back(name, shard)
                restored += slot.nbytes
                slot.nbytes = 0
                del places
        return restored

    def _put_back(self, name: str, shard: torch.Tensor) -> None:
        buffer = self._aside.pop(name, None)
        if buffer is None:
            return
        delattr(self._owners[name], ASIDE_ATTRIBUTE)
        offset = 0
        for cell in self._cells[name]:
            part = shard[cell]
            part.copy_(buffer[offset: offset + part.numel()].view(part.shape))
            offset += part.numel()
