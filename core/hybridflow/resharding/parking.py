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
from typing import Literal

import torch

from hybridflow.errors import ReshardError
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
    return dict(plan.memoized(("parking_cells", rank), lambda: _cells_of(plan.source.pieces(rank), plan, rank)))


def _cells_of(sources: Mapping[str, tuple[Piece, ...]], plan: ReshardPlan,
              rank: int) -> dict[str, tuple[tuple[Home, ...], tuple[tuple[slice, ...], ...]]]:
    """:func:`parking_cells` of any named pieces held on ``rank`` (the plan's source pieces, or copies of them that
    the plan does not describe) against ``rank``'s target shards of ``plan``."""
    targets: dict[str, list[tuple[str, Piece]]] = {}
    for name, pieces in plan.target.pieces(rank).items():
        for piece in pieces:
            targets.setdefault(piece.canonical, []).append((name, piece))
    out: dict[str, tuple[tuple[Home, ...], tuple[tuple[slice, ...], ...]]] = {}
    for name, pieces in sources.items():
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

    ``copies``: tensors the plan does not describe that hold a copy of canonical pieces it moves (a tied embedding's
    output-layer copy on a pipeline's last stage), each with those pieces (e.g. the source spec's pieces on the rank
    holding the original): where the pieces lie whole in this rank's generation shards (no aside) the copy is one more
    member of its storage, whose homes are those generation shards. It counts as copied out once :meth:`finish`
    finds it equal, bit for bit, to its homes (the copy the rank keeps is the one the generation shards hold), and
    :meth:`restore` copies it back from there. A copy that differs, or whose pieces lie partly outside the rank's
    generation shards (unless ``aside="fetch"``: those cells are then fetched like a shard's), keeps its storage from
    parking (as ``others`` does; its name is in :attr:`unparked_copies`).

    ``aside=True``: a storage also parks when some of its shards' bytes lie in no generation shard on this rank
    (:func:`parking_cells`), provided they are fewer than the storage's bytes: as each shard is released those cells
    are copied into a small aside buffer (one per shard, set on its ``storages`` tensor as ``parked_aside`` so that
    ``count_storage_bytes`` counts it), and :meth:`restore` puts them back. Without it such a storage stays.
    ``aside="fetch"``: as ``aside=True``, but those cells are not kept anywhere on this rank: :meth:`restore` leaves
    them zero, for the caller to fetch from the ranks whose generation shards hold them (every byte of the storage
    lies in some rank's generation shards; :func:`parking_cells` names the cells), e.g. by a reverse reshard before
    those shards go. The rank then holds its generation shards alone.
    """

    def __init__(self, plan: ReshardPlan, rank: int, shards: Mapping[str, torch.Tensor], *,
                 others: Iterable[torch.Tensor] = (), storages: Mapping[str, torch.Tensor] | None = None,
                 write_back: Callable[[str, torch.Tensor], None] | None = None,
                 aside: bool | Literal["fetch"] = False,
                 copies: Mapping[str, tuple[torch.Tensor, tuple[Piece, ...]]] | None = None) -> None:
        cells = parking_cells(plan, rank)
        if not aside:
            cells = {name: found for name, found in cells.items() if not found[1]}
        copies = dict(copies or {})
        if clash := sorted(set(copies) & set(shards)):
            raise ReshardError(f"StorageParking copies must be named apart from the shards; both name {clash}; rename "
                               "the copies")
        copy_cells = _cells_of({name: pieces for name, (_, pieces) in copies.items()}, plan, rank)
        self._copies = {name: tensor for name, (tensor, _) in copies.items()
                        if aside == "fetch" or not copy_cells[name][1]}
        self.unparked_copies: list[str] = sorted(set(copies) - set(self._copies))
        blocked = {_key(t) for t in [*others, *(copies[n][0] for n in self.unparked_copies)]
                   if t.untyped_storage().nbytes()}
        owners = shards if storages is None else storages
        by_key: dict[tuple[str, int], _Storage] = {}
        for name, tensor in [*((n, owners[n]) for n in shards), *self._copies.items()]:
            if not tensor.untyped_storage().nbytes():
                continue
            slot = by_key.setdefault(_key(tensor), _Storage(owner=tensor, members=set()))
            slot.members.add(name)

        def aside_bytes(slot: _Storage) -> int:
            return sum(shards[n][cell].numel() * shards[n].element_size()
                       for n in slot.members if n in shards for cell in cells[n][1])

        self._homes = {name: found[0] for name, found in [*cells.items(), *copy_cells.items()]}
        self._cells = {name: found[1] for name, found in [*cells.items(), *copy_cells.items()]
                       if found[1] and (name in shards or name in self._copies)}
        self._fetch = aside == "fetch"
        self._write_back = write_back
        self._shards = dict(shards) if write_back is None else {}
        self._owners = dict(owners)
        self._meta = {name: (tuple(t.shape), t.dtype, t.device) for name, t in shards.items()}
        self._storages = {key: slot for key, slot in by_key.items()
                          if key not in blocked and all(name in cells or name in self._copies
                                                        for name in slot.members)
                          and (aside == "fetch" or aside_bytes(slot) < slot.owner.untyped_storage().nbytes())}
        self._by_name = {name: slot for slot in self._storages.values() for name in slot.members}
        self._pending = {name: shards[name] for name in self._by_name  # until copied aside
                         if name in self._cells and aside != "fetch"}
        self._aside: dict[str, torch.Tensor] = {}
        self._restore: list[tuple[_Storage, list[tuple[str, list[tuple[tuple[slice, ...], torch.Tensor,
                                                                      tuple[slice, ...]]]]]]] = []

    @property
    def parked_bytes(self) -> int:
        """Training storage bytes released now."""
        return sum(slot.nbytes for slot in self._storages.values())

    @property
    def fetch_cells(self) -> dict[str, tuple[tuple[slice, ...], ...]]:
        """``aside="fetch"``: per shard or copy of a storage that parks, the slices :meth:`restore` leaves zero
        (no generation shard on this rank holds them); empty otherwise."""
        return {name: cells for name, cells in self._cells.items() if name in self._by_name} if self._fetch else {}

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
        shard of the storage was copied out or a copy in it equals its homes (a storage holding a copy that differs
        stays); record where every parked shard lives on. Returns the parked bytes."""
        for key, slot in list(self._storages.items()):
            if slot.nbytes:
                continue
            held = slot.members & self._copies.keys()
            if held and all(self._equals_homes(name, targets) for name in held):
                slot.released |= held
            elif held:
                self._keep(key, slot)
                continue
            if not slot.released:
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

    def _equals_homes(self, name: str, targets: Mapping[str, torch.Tensor]) -> bool:
        copy = self._copies[name]
        return all(torch.equal(copy[home.source_slices], targets[home.target][home.target_slices])
                   for home in self._homes[name])

    def _keep(self, key: tuple[str, int], slot: _Storage) -> None:
        """``slot`` stays resident (a copy in it differs from its homes): forget it, and its shards' aside copies."""
        del self._storages[key]
        for name in slot.members:
            self._by_name.pop(name, None)
            self._aside.pop(name, None)
            self._pending.pop(name, None)
        self.unparked_copies = sorted({*self.unparked_copies, *(slot.members & self._copies.keys())})

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
                    copy = self._copies.get(name)
                    if copy is not None:  # a copy outside the plan: straight back from its homes
                        for source_slices, home, target_slices in homes:
                            copy[source_slices].copy_(home[target_slices])
                        continue
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
