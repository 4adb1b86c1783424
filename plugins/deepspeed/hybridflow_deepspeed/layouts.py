"""Per-parameter shard specs of the ``deepspeed`` engine's weights, as :class:`hybridflow.resharding.ModelLayout`:
ZeRO-3's flat partitions described against the canonical (Hugging Face shaped) tensors, and ZeRO-1/2's full copy on
every rank.

ZeRO-3 flattens each parameter, pads it to a multiple of the data-parallel size ``d`` and gives rank ``k`` the flat
elements ``[k·⌈n/d⌉, (k+1)·⌈n/d⌉)`` (``deepspeed.runtime.zero.partition_parameters``). A flat range of a 2-D weight is
up to three boxes (a partial first row, whole rows, a partial last row), so the spec here lists those boxes as pieces
of a small 2-D local buffer (the rows the range touches) and the core planner can move them to any generation layout.
Planning and moving bytes are :mod:`hybridflow.resharding`'s business. Stability: public.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hybridflow.errors import LayoutError
from hybridflow.resharding.layout import ParallelLayout
from hybridflow.resharding.specs import Mesh, ModelLayout, ParamShardSpec, Piece

__all__ = ["ZeroPartitionSpec", "build_deepspeed_training_layout", "flat_partition_range", "pack_partition",
           "unpack_partition"]


def flat_partition_range(numel: int, parts: int, part: int) -> tuple[int, int]:
    """Flat elements ``[start, stop)`` of a ``numel``-element parameter that ZeRO-3 rank ``part`` of ``parts`` holds
    (unpadded: the padding of the last partition is not part of the parameter)."""
    size = -(-numel // parts)
    start = min(part * size, numel)
    return start, min(start + size, numel)


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroPartitionSpec(ParamShardSpec):
    """A parameter of at most 2 dims partitioned ZeRO-3 style (flat, ceil chunks) over the ``data`` mesh axis.

    Rank ``k``'s local shard is the rows its flat range touches, ``[first row, last row]``, of which only the range
    is valid: ``pieces`` names those valid boxes, so a plan never reads the rest of the buffer.
    """

    def __post_init__(self) -> None:
        ParamShardSpec.__post_init__(self)  # zero-argument super() does not work in a slots dataclass
        if len(self.shape) > 2 or self.splits or self.fused is not None or self.pipeline_stage is not None:
            raise LayoutError(
                f"parameter {self.name!r}: a ZeRO-3 partition spec describes a plain 1-D or 2-D tensor split only by "
                f"its flat partition; got shape {self.shape}, splits {self.splits}, fused {self.fused}"
            )

    def pieces(self, mesh: Mesh, rank: int) -> tuple[Piece, ...]:
        start, stop = flat_partition_range(math.prod(self.shape), mesh.axis_size("data"),
                                           mesh.axis_index(rank, "data"))
        if start == stop:
            return ()
        if len(self.shape) == 1:
            return (Piece(self.name, ((start, stop),), (0,)),)
        width = self.shape[1]
        first_row, last_row = start // width, (stop - 1) // width
        if first_row == last_row:
            return (Piece(self.name, ((first_row, first_row + 1), (start % width, stop - first_row * width)),
                          (0, start % width)),)
        pieces = []
        whole_from, whole_to = -(-start // width), stop // width
        if start % width:
            pieces.append(Piece(self.name, ((first_row, first_row + 1), (start % width, width)), (0, start % width)))
        if whole_to > whole_from:
            pieces.append(Piece(self.name, ((whole_from, whole_to), (0, width)), (whole_from - first_row, 0)))
        if stop % width:
            pieces.append(Piece(self.name, ((whole_to, whole_to + 1), (0, stop % width)), (whole_to - first_row, 0)))
        return tuple(pieces)


def build_deepspeed_training_layout(named_shapes: Mapping[str, Sequence[int]], *, data: int, zero_stage: int = 3,
                                    dtype: torch.dtype = torch.float32) -> ModelLayout:
    """The ``deepspeed`` engine's layout over ``data`` ranks: ZeRO-3 flat partitions, or for ZeRO-1/2 every parameter
    whole on every rank (those stages shard optimizer state and gradients, never the parameters).

    The mesh is ``data_sharded`` for every stage: the whole data axis is one shard group, so a tensor-parallel
    generation group may be drawn across data ranks (under ZeRO-1/2 each of its ranks then slices what it holds).
    """
    if zero_stage not in (1, 2, 3):
        raise LayoutError(f"zero_stage must be 1, 2 or 3; got {zero_stage!r}")
    mesh = ParallelLayout(data=data, data_sharded=True)
    params: dict[str, ParamShardSpec] = {}
    for name, shape in named_shapes.items():
        if zero_stage == 3:
            params[name] = ZeroPartitionSpec(name=name, shape=tuple(shape), dtype=dtype)
        else:
            params[name] = ParamShardSpec(name=name, shape=tuple(shape), dtype=dtype)
    return ModelLayout(mesh=mesh, params=params)


def pack_partition(flat: torch.Tensor, spec: ParamShardSpec, mesh: Mesh, rank: int) -> torch.Tensor:
    """This rank's local shard of ``spec`` (shape ``spec.local_shape``) from its ZeRO-3 flat partition ``flat``
    (``param.ds_tensor``, padding included): a local copy of the valid range, no communication."""
    shape = spec.local_shape(mesh, rank)
    if shape is None:
        return flat.new_empty((0,))
    start, _ = flat_partition_range(math.prod(spec.shape), mesh.axis_size("data"), mesh.axis_index(rank, "data"))
    width = spec.shape[1] if len(spec.shape) == 2 else 1
    local = flat.new_empty(shape)
    for piece in spec.pieces(mesh, rank):
        box_shape = tuple(b - a for a, b in piece.box)
        begin = piece.box[0][0] * width + (piece.box[1][0] if len(spec.shape) == 2 else 0) - start
        local[piece.local_slices(piece.box)] = flat[begin: begin + math.prod(box_shape)].view(box_shape)
    return local


def unpack_partition(local: torch.Tensor, flat: torch.Tensor, spec: ParamShardSpec, mesh: Mesh, rank: int) -> None:
    """The inverse of :func:`pack_partition`: write the valid range of local shard ``local`` into this rank's flat
    partition ``flat`` (in place; its padding is left alone)."""
    start, _ = flat_partition_range(math.prod(spec.shape), mesh.axis_size("data"), mesh.axis_index(rank, "data"))
    width = spec.shape[1] if len(spec.shape) == 2 else 1
    for piece in spec.pieces(mesh, rank):
        box_shape = tuple(b - a for a, b in piece.box)
        begin = piece.box[0][0] * width + (piece.box[1][0] if len(spec.shape) == 2 else 0) - start
        flat[begin: begin + math.prod(box_shape)].view(box_shape).copy_(local[piece.local_slices(piece.box)])
