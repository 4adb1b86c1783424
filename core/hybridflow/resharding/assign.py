"""Decides, box by box, where each rank's staged bytes come from: its own source shard, or which other rank.

It knows canonical boxes and ranks only; grouping transfers into collectives and buckets is the planner's job.
Stability: developer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hybridflow.errors import ReshardError
from hybridflow.resharding.specs import Box, ModelLayout, box_numel, intersect_boxes

__all__ = ["Transfer", "collect_boxes", "assign_minimal", "assign_contributions", "staged_canonicals"]

RankBoxes = dict[int, list[Box]]


@dataclass(frozen=True, slots=True)
class Transfer:
    """``box`` of canonical tensor ``canonical`` moves from ``source_rank`` to ``target_rank`` (equal: local copy)."""

    source_rank: int
    target_rank: int
    canonical: str
    box: Box
    nbytes: int


def collect_boxes(layout: ModelLayout) -> dict[str, RankBoxes]:
    """Canonical name → rank → non-empty boxes that rank holds."""
    out: dict[str, RankBoxes] = {}
    for rank in range(layout.world_size):
        for pieces in layout.pieces(rank).values():
            for piece in pieces:
                if box_numel(piece.box) == 0:
                    continue
                out.setdefault(piece.canonical, {}).setdefault(rank, []).append(piece.box)
    return out


def _cuts(target: Box, boxes: Sequence[Box]) -> list[list[int]]:
    cuts = []
    for dim, (lo, hi) in enumerate(target):
        points = {lo, hi}
        for box in boxes:
            for point in box[dim]:
                if lo < point < hi:
                    points.add(point)
        cuts.append(sorted(points))
    return cuts


def _contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def assign_minimal(
    canonical: str,
    itemsize: int,
    sources: RankBoxes,
    staging: RankBoxes,
    preference: Callable[[int, int], tuple[int, ...] | None],
) -> list[Transfer]:
    """Transfers that fill every staged box exactly once: own bytes copied locally, the rest from one holder each.

    ``preference(receiver, holder)`` ranks candidate holders (smaller is better) or returns None to forbid one.
    """
    out: list[Transfer] = []
    all_sources = [(rank, box) for rank, boxes in sorted(sources.items()) for box in boxes]
    for rank, targets in sorted(staging.items()):
        own = sources.get(rank, [])
        for target in targets:
            held = [hit for box in own if (hit := intersect_boxes(target, box)) is not None]
            out.extend(Transfer(rank, rank, canonical, box, box_numel(box) * itemsize) for box in held)
            if sum(map(box_numel, held)) == box_numel(target):
                continue
            touching = [(h, box, hit) for h, box in all_sources if (hit := intersect_boxes(target, box)) is not None]
            cuts = _cuts(target, [hit for _, _, hit in touching])
            chosen: dict[tuple[int, int], list[Box]] = {}
            for cell in itertools.product(*[list(itertools.pairwise(c)) for c in cuts]):
                if any(_contains(box, cell) for box in held):
                    continue
                candidates = [
                    (key, index)
                    for index, (holder, box, _) in enumerate(touching)
                    if holder != rank and _contains(box, cell) and (key := preference(rank, holder)) is not None
                ]
                if not candidates:
                    raise ReshardError(
                        f"no allowed source rank holds part {cell} of {canonical!r} needed by rank {rank}; the source "
                        "layout does not cover the tensor, or the strategy forbids every holder."
                    )
                index = min(candidates)[1]
                chosen.setdefault((touching[index][0], index), []).append(cell)
            for (holder, index), cells in sorted(chosen.items()):
                region = touching[index][2]
                whole = sum(map(box_numel, cells)) == box_numel(region)
                for box in [region] if whole else cells:
                    out.append(Transfer(holder, rank, canonical, box, box_numel(box) * itemsize))
    return out


def assign_contributions(
    canonical: str, itemsize: int, sources: RankBoxes, receivers: Sequence[int], staging_box: Box
) -> list[Transfer]:
    """Full-gather transfers: ranks holding the same box split it and each sends its chunk to every receiver.

    Ranks also receive chunks of bytes they already hold, as a ZeRO-3 style full gather does.
    """
    holders: dict[Box, list[int]] = {}
    for rank, boxes in sources.items():
        for box in boxes:
            holders.setdefault(box, []).append(rank)
    unique = sorted(holders)
    for a, b in itertools.combinations(unique, 2):
        if intersect_boxes(a, b) is not None:
            raise ReshardError(
                f"full_gather needs source shards of {canonical!r} that are identical or disjoint; {a} and {b} "
                "overlap. Use strategy='hybridflow'."
            )
    if sum(map(box_numel, unique)) != box_numel(staging_box):
        raise ReshardError(f"source shards of {canonical!r} do not cover the tensor; check the source layout.")
    out: list[Transfer] = []
    for box in unique:
        ranks = sorted(holders[box])
        dim = max(range(len(box)), key=lambda d: box[d][1] - box[d][0])
        lo, hi = box[dim]
        step = -(-(hi - lo) // len(ranks))
        for index, holder in enumerate(ranks):
            start, stop = min(lo + index * step, hi), min(lo + (index + 1) * step, hi)
            if start >= stop:
                continue
            chunk = box[:dim] + ((start, stop),) + box[dim + 1:]
            nbytes = box_numel(chunk) * itemsize
            out.extend(Transfer(holder, receiver, canonical, chunk, nbytes) for receiver in receivers)
    return out


def staged_canonicals(layout: ModelLayout) -> Mapping[str, str]:
    """Canonical name → parameter of ``layout`` that holds it."""
    return {
        canonical: name for name, spec in layout.params.items() for canonical in spec.canonical_shapes()
    }
