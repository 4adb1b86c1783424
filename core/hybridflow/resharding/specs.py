"""Per-parameter shard specs: which tensor dim splits along which mesh axis, fused layouts (qkv with GQA groups,
gate_up), FSDP dim-0 shards and replicated params, and the pieces of the full weights each rank holds.

Everything is expressed against *canonical* tensors (the unfused, unsharded weights, e.g. Hugging Face names), so
two layouts with different fusion can be compared. This module plans no communication. Stability: public.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from hybridflow.errors import LayoutError
from hybridflow.resharding.layout import MESH_AXES, GenerationLayout, MeshAxis, ParallelLayout

__all__ = ["Box", "Piece", "FusedLayout", "ParamShardSpec", "ModelLayout", "Mesh", "box_numel", "intersect_boxes"]

Box = tuple[tuple[int, int], ...]
"""Half-open ``(start, stop)`` per tensor dim, in the coordinates of a canonical tensor."""
Mesh = ParallelLayout | GenerationLayout


def box_numel(box: Box) -> int:
    """Number of elements in ``box``."""
    return math.prod(stop - start for start, stop in box)


def intersect_boxes(a: Box, b: Box) -> Box | None:
    """Intersection of two boxes, or None when it is empty."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(start < stop for start, stop in out) else None


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of canonical tensor ``canonical`` stored in a local shard starting at ``offset``."""

    canonical: str
    box: Box
    offset: tuple[int, ...]

    def local_slices(self, box: Box) -> tuple[slice, ...]:
        """Slices of the local shard that hold sub-box ``box`` of this piece."""
        return tuple(
            slice(off + start - p_start, off + stop - p_start)
            for (start, stop), (p_start, _), off in zip(box, self.box, self.offset, strict=True)
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class FusedLayout:
    """Dim 0 of a parameter is several canonical tensors fused together (stability: public).

    With ``groups == 1`` the full tensor is ``cat(components)`` and a split over ``n`` ranks gives rank ``k`` the
    ``k``-th part of every component, concatenated (vLLM ``QKVParallelLinear`` / ``MergedColumnParallelLinear``).
    With ``groups > 1`` each component is cut into ``groups`` blocks interleaved as ``[c0_g, c1_g, ...]`` per group
    (Megatron's GQA qkv), and a split hands whole groups to ranks. A component name without a dot replaces the
    module name of the fused parameter (``...self_attn.qkv_proj.weight`` + ``q_proj`` → ``...self_attn.q_proj.weight``).
    """

    components: tuple[str, ...]
    sizes: tuple[int, ...]
    units: tuple[int, ...]
    groups: int = 1

    def __post_init__(self) -> None:
        if not self.components or len(self.components) != len(self.sizes) or len(self.sizes) != len(self.units):
            raise LayoutError(
                f"FusedLayout needs one size and one unit per component; got components={self.components}, "
                f"sizes={self.sizes}, units={self.units}."
            )
        for size, unit in zip(self.sizes, self.units, strict=True):
            if unit < 1 or size % unit or (size // unit) % self.groups:
                raise LayoutError(
                    f"FusedLayout component size {size} must be a multiple of its unit {unit} times groups "
                    f"{self.groups}; check num_heads / num_kv_heads / head_dim."
                )

    @classmethod
    def qkv(cls, num_heads: int, num_kv_heads: int, head_dim: int, *, interleaved: bool = False,
            names: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")) -> FusedLayout:
        """Fused q, k, v projections with GQA; ``interleaved=True`` is Megatron's per-group order."""
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise LayoutError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}).")
        return cls(
            components=names,
            sizes=(num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim),
            units=(head_dim * (num_heads // num_kv_heads), head_dim, head_dim),
            groups=num_kv_heads if interleaved else 1,
        )

    @classmethod
    def gate_up(cls, intermediate_size: int, *, names: tuple[str, str] = ("gate_proj", "up_proj")) -> FusedLayout:
        """Fused gate and up projections of a SwiGLU MLP."""
        return cls(components=names, sizes=(intermediate_size, intermediate_size), units=(1, 1))

    def blocks(self, part: int, parts: int) -> list[tuple[int, int, int]]:
        """``(component, row start, row stop)`` of part ``part`` of ``parts``, in local order."""
        if self.groups == 1:
            out = []
            for index, (size, unit) in enumerate(zip(self.sizes, self.units, strict=True)):
                if (size // unit) % parts:
                    raise LayoutError(
                        f"cannot split fused component {self.components[index]!r} ({size // unit} units of {unit} "
                        f"rows) over {parts} ranks; the tensor-parallel size must divide the number of (kv) heads."
                    )
                step = size // parts
                out.append((index, part * step, (part + 1) * step))
            return out
        if self.groups % parts:
            raise LayoutError(f"cannot split {self.groups} interleaved groups over {parts} ranks; use a divisor.")
        per = self.groups // parts
        return [
            (index, group * (size // self.groups), (group + 1) * (size // self.groups))
            for group in range(part * per, (part + 1) * per)
            for index, size in enumerate(self.sizes)
        ]


def resolve_component(param_name: str, component: str) -> str:
    """Canonical name of ``component`` of fused parameter ``param_name``."""
    if "." in component:
        return component
    parts = param_name.split(".")
    if len(parts) < 2:
        return component
    parts[-2] = component
    return ".".join(parts)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamShardSpec:
    """How one parameter is laid out over a mesh (stability: public).

    ``splits`` lists ``(tensor dim, mesh axis)`` pairs, outer first; a ``tensor``/``pipeline`` split must divide the
    dim evenly, a ``data`` split chunks like FSDP2 (shard ``i`` holds rows ``[i*ceil(n/d), (i+1)*ceil(n/d))``,
    clipped, unpadded). ``pipeline_stage`` is the stage holding the parameter, None for every stage.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    splits: tuple[tuple[int, MeshAxis], ...] = ()
    fused: FusedLayout | None = None
    pipeline_stage: int | None = None

    def __post_init__(self) -> None:
        if not self.shape or any(size < 1 for size in self.shape):
            raise LayoutError(f"parameter {self.name!r}: shape must be non-empty and positive; got {self.shape}.")
        for dim, axis in self.splits:
            if not 0 <= dim < len(self.shape) or axis not in MESH_AXES:
                raise LayoutError(
                    f"parameter {self.name!r}: split ({dim}, {axis!r}) needs a dim in [0, {len(self.shape)}) and an "
                    f"axis in {MESH_AXES}."
                )
        if self.fused is not None:
            if sum(self.fused.sizes) != self.shape[0]:
                raise LayoutError(
                    f"parameter {self.name!r}: fused components add up to {sum(self.fused.sizes)} rows but dim 0 "
                    f"is {self.shape[0]}."
                )
            if sum(1 for dim, _ in self.splits if dim == 0) > 1:
                raise LayoutError(f"parameter {self.name!r}: a fused dim 0 may be split along one mesh axis only.")

    @property
    def nbytes(self) -> int:
        """Bytes of the full parameter."""
        return math.prod(self.shape) * self.dtype.itemsize

    def canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical tensors this parameter is made of, with their full shapes."""
        if self.fused is None:
            return {self.name: self.shape}
        return {
            resolve_component(self.name, component): (size, *self.shape[1:])
            for component, size in zip(self.fused.components, self.fused.sizes, strict=True)
        }

    def pieces(self, mesh: Mesh, rank: int) -> tuple[Piece, ...]:
        """Pieces of the canonical tensors held by ``rank``, empty when its pipeline stage does not hold them."""
        if self.pipeline_stage is not None and mesh.axis_index(rank, "pipeline") != self.pipeline_stage:
            return ()
        ranges = [(0, size) for size in self.shape]
        fused_split: tuple[int, int] = (0, 1)
        for dim, axis in self.splits:
            parts, part = mesh.axis_size(axis), mesh.axis_index(rank, axis)
            if dim == 0 and self.fused is not None:
                fused_split = (part, parts)
                continue
            start, stop = ranges[dim]
            length = stop - start
            if axis == "data":
                step = -(-length // parts)
            elif length % parts:
                raise LayoutError(
                    f"parameter {self.name!r}: dim {dim} of size {length} does not split evenly over the {parts} "
                    f"ranks of mesh axis {axis!r}; pick a {axis} size that divides {length}."
                )
            else:
                step = length // parts
            ranges[dim] = (start + min(part * step, length), start + min((part + 1) * step, length))
        if self.fused is None:
            return (Piece(self.name, tuple(ranges), (0,) * len(ranges)),)
        out, row = [], 0
        for index, start, stop in self.fused.blocks(fused_split[0], fused_split[1]):
            name = resolve_component(self.name, self.fused.components[index])
            out.append(Piece(name, ((start, stop), *ranges[1:]), (row,) + (0,) * (len(ranges) - 1)))
            row += stop - start
        return tuple(out)

    def local_shape(self, mesh: Mesh, rank: int) -> tuple[int, ...] | None:
        """Shape of the local shard on ``rank``, or None when the rank holds none of it."""
        pieces = self.pieces(mesh, rank)
        if not pieces:
            return None
        return tuple(
            max(off + stop - start for piece in pieces for (start, stop), off in [(piece.box[d], piece.offset[d])])
            for d in range(len(self.shape))
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelLayout:
    """Every parameter's shard spec over one mesh (stability: public)."""

    mesh: Mesh
    params: Mapping[str, ParamShardSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, spec in self.params.items():
            if name != spec.name:
                raise LayoutError(f"ModelLayout key {name!r} differs from its spec name {spec.name!r}.")
        self.canonical_shapes()

    @property
    def world_size(self) -> int:
        """Ranks of the mesh."""
        return self.mesh.world_size

    def canonical_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each canonical tensor; raises when two parameters disagree."""
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        owners: dict[str, str] = {}
        for spec in self.params.values():
            for name, shape in spec.canonical_shapes().items():
                if name in out:
                    raise LayoutError(
                        f"canonical tensor {name!r} appears in both {owners[name]!r} and {spec.name!r}; each "
                        "canonical tensor must belong to one parameter."
                    )
                out[name], owners[name] = (shape, spec.dtype), spec.name
        return out

    def pieces(self, rank: int) -> dict[str, tuple[Piece, ...]]:
        """Pieces held by ``rank``, keyed by parameter name (parameters it does not hold are left out)."""
        out = {}
        for name, spec in self.params.items():
            pieces = spec.pieces(self.mesh, rank)
            if pieces:
                out[name] = pieces
        return out

    def shard_bytes(self, rank: int) -> int:
        """Bytes of all local shards on ``rank``."""
        return sum(
            box_numel(piece.box) * self.params[name].dtype.itemsize
            for name, pieces in self.pieces(rank).items()
            for piece in pieces
        )

    def extract_shards(self, full: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """Reference local shards of ``rank`` sliced out of full canonical weights (fresh, contiguous tensors)."""
        out = {}
        for name, pieces in self.pieces(rank).items():
            spec = self.params[name]
            shape = spec.local_shape(self.mesh, rank)
            assert shape is not None
            local = torch.empty(shape, dtype=spec.dtype)
            for piece in pieces:
                try:
                    source = full[piece.canonical]
                except KeyError as exc:
                    raise LayoutError(f"full weights lack canonical tensor {piece.canonical!r}.") from exc
                local[piece.local_slices(piece.box)] = source[tuple(slice(a, b) for a, b in piece.box)]
            out[name] = local
        return out
