"""Device meshes of the 3D-HybridEngine: the training mesh ``(p, t, d)``, the generation mesh ``(pg, tg)``, rank ↔
coordinates for both, and the stride grouping that keeps every training shard inside its generation shard.

This module knows ranks and axes only; which tensor dims a parameter splits along which axis lives in
:mod:`hybridflow.resharding.specs`. Stability: public.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridflow.errors import LayoutError

__all__ = [
    "MeshAxis",
    "MESH_AXES",
    "Grouping",
    "ParallelLayout",
    "GenerationLayout",
    "TrainingCoords",
    "GenerationCoords",
]

MeshAxis = Literal["pipeline", "tensor", "data"]
MESH_AXES: tuple[MeshAxis, ...] = ("pipeline", "tensor", "data")
Grouping = Literal["stride", "consecutive"]


def _check_size(owner: str, field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"{owner}.{field} must be a positive int; got {value!r}. Pass e.g. {field}=1.")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingCoords:
    """Coordinates of one rank in a training mesh."""

    pipeline: int
    tensor: int
    data: int


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationCoords:
    """Coordinates of one rank in a generation mesh; ``data`` is the generation data-parallel index.

    ``micro_data`` is the index inside the micro-DP group (the ranks of one training shard group that hold the same
    generation shard); ``replica`` is the index of the training shard group.
    """

    pipeline: int
    tensor: int
    data: int
    micro_data: int
    replica: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """Training mesh of ``pipeline`` × ``tensor`` × ``data`` ranks (stability: public).

    Rank order is tensor fastest, then pipeline, then data: ``rank = (data * pipeline + pp) * tensor + tp``, so one
    model-parallel group is a run of consecutive ranks. ``data_sharded=True`` marks FSDP / ZeRO-3, where parameters
    are also split along the data axis and a "shard group" spans every axis.
    """

    pipeline: int = 1
    tensor: int = 1
    data: int = 1
    data_sharded: bool = False

    def __post_init__(self) -> None:
        for field in ("pipeline", "tensor", "data"):
            _check_size("ParallelLayout", field, getattr(self, field))

    @property
    def world_size(self) -> int:
        """Number of ranks, ``p * t * d``."""
        return self.pipeline * self.tensor * self.data

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one model-parallel group, ``p * t``."""
        return self.pipeline * self.tensor

    @property
    def shard_group_size(self) -> int:
        """Ranks whose shards together hold the model once: ``p * t``, or the whole world when data-sharded."""
        return self.world_size if self.data_sharded else self.model_parallel_size

    def axis_size(self, axis: MeshAxis) -> int:
        """Size of mesh axis ``axis``."""
        return int(getattr(self, _check_axis(axis)))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank must be in [0, {self.world_size}) for {self}; got {rank}.")

    def coords(self, rank: int) -> TrainingCoords:
        """Coordinates of ``rank``."""
        self._check_rank(rank)
        return TrainingCoords(
            pipeline=(rank // self.tensor) % self.pipeline,
            tensor=rank % self.tensor,
            data=rank // self.model_parallel_size,
        )

    def rank(self, *, pipeline: int = 0, tensor: int = 0, data: int = 0) -> int:
        """Rank at the given coordinates."""
        coordinates: tuple[tuple[MeshAxis, int], ...] = (("pipeline", pipeline), ("tensor", tensor), ("data", data))
        for axis, value in coordinates:
            if not 0 <= value < self.axis_size(axis):
                raise LayoutError(f"{axis} coordinate must be in [0, {self.axis_size(axis)}); got {value}.")
        return (data * self.pipeline + pipeline) * self.tensor + tensor

    def axis_index(self, rank: int, axis: MeshAxis) -> int:
        """Coordinate of ``rank`` along ``axis``."""
        return int(getattr(self.coords(rank), _check_axis(axis)))

    def shard_index(self, rank: int) -> int:
        """Position of ``rank`` inside its shard group (``pp * t + tp``, or the rank itself when data-sharded)."""
        return rank if self.data_sharded else rank % self.model_parallel_size

    def replica(self, rank: int) -> int:
        """Index of the shard group of ``rank`` (ranks of different replicas hold identical shards)."""
        return 0 if self.data_sharded else rank // self.model_parallel_size

    def group(self, rank: int, axis: MeshAxis) -> tuple[int, ...]:
        """Ranks that differ from ``rank`` only along ``axis`` (its tensor, pipeline or data group)."""
        coords = self.coords(rank)
        values = {"pipeline": coords.pipeline, "tensor": coords.tensor, "data": coords.data}
        members = []
        for index in range(self.axis_size(axis)):
            values[_check_axis(axis)] = index
            members.append(self.rank(**values))
        return tuple(members)

    def groups(self, axis: MeshAxis) -> tuple[tuple[int, ...], ...]:
        """All groups along ``axis``, sorted."""
        return tuple(sorted({self.group(rank, axis) for rank in range(self.world_size)}))

    def shard_group(self, rank: int) -> tuple[int, ...]:
        """Ranks of the shard group of ``rank``."""
        size = self.shard_group_size
        start = self.replica(rank) * size
        return tuple(range(start, start + size))


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationLayout:
    """Generation mesh ``(pg, tg)`` drawn inside a training mesh (stability: public).

    With ``training`` set, each training shard group of ``S`` ranks holds ``S / (pg * tg)`` generation replicas (the
    micro-DP size). ``grouping="stride"`` (HybridFlow) gives the rank at shard index ``s`` the generation position
    that contains its training shard: for ``t=4, tg=2`` the tensor groups are ``{0,2},{1,3}`` and the micro-DP groups
    ``{0,1},{2,3}``. ``"consecutive"`` (the paper's vanilla variant) gives ``{0,1},{2,3}`` as tensor groups. Without
    ``training`` the mesh is one replica of ``pg * tg`` ranks, tensor fastest.
    """

    pipeline: int = 1
    tensor: int = 1
    training: ParallelLayout | None = None
    grouping: Grouping = "stride"

    def __post_init__(self) -> None:
        _check_size("GenerationLayout", "pipeline", self.pipeline)
        _check_size("GenerationLayout", "tensor", self.tensor)
        if self.grouping not in ("stride", "consecutive"):
            raise LayoutError(f'grouping must be "stride" or "consecutive"; got {self.grouping!r}.')
        if self.training is not None and self.training.shard_group_size % self.model_parallel_size:
            raise LayoutError(
                f"generation pipeline*tensor = {self.pipeline}*{self.tensor} = {self.model_parallel_size} must divide "
                f"the training shard group size {self.training.shard_group_size} of {self.training}. "
                f"Pick pg*tg among the divisors of {self.training.shard_group_size}."
            )

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one generation replica, ``pg * tg``."""
        return self.pipeline * self.tensor

    @property
    def world_size(self) -> int:
        """Number of ranks: the training world, or ``pg * tg`` without a training mesh."""
        return self.training.world_size if self.training is not None else self.model_parallel_size

    @property
    def micro_data_size(self) -> int:
        """Micro-DP size ``dg``: generation replicas per training shard group."""
        if self.training is None:
            return 1
        return self.training.shard_group_size // self.model_parallel_size

    @property
    def data(self) -> int:
        """Generation data-parallel size, ``world_size / (pg * tg)``."""
        return self.world_size // self.model_parallel_size

    def axis_size(self, axis: MeshAxis) -> int:
        """Size of mesh axis ``axis`` (``data`` is the generation data-parallel size)."""
        return int(getattr(self, _check_axis(axis)))

    def _position(self, shard_index: int) -> tuple[int, int]:
        """(model-parallel position ``pp * tg + tp``, micro-DP index) of a training shard index."""
        dg = self.micro_data_size
        if self.grouping == "consecutive":
            return shard_index % self.model_parallel_size, shard_index // self.model_parallel_size
        training = self.training
        if training is not None and not training.data_sharded and _aligned(training, self):
            # Containment per axis: tensor shard tp lies in tp // (t/tg), stage pp in pp // (p/pg).
            t_ratio, p_ratio = training.tensor // self.tensor, training.pipeline // self.pipeline
            pp, tp = divmod(shard_index, training.tensor)
            position = (pp // p_ratio) * self.tensor + tp // t_ratio
            return position, (pp % p_ratio) * t_ratio + tp % t_ratio
        return shard_index // dg, shard_index % dg

    def coords(self, rank: int) -> GenerationCoords:
        """Generation coordinates of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank must be in [0, {self.world_size}) for {self}; got {rank}.")
        if self.training is None:
            shard_index, replica = rank, 0
        else:
            shard_index, replica = self.training.shard_index(rank), self.training.replica(rank)
        position, micro = self._position(shard_index)
        return GenerationCoords(
            pipeline=position // self.tensor,
            tensor=position % self.tensor,
            data=replica * self.micro_data_size + micro,
            micro_data=micro,
            replica=replica,
        )

    def rank(self, *, pipeline: int = 0, tensor: int = 0, data: int = 0) -> int:
        """Rank at the given generation coordinates."""
        for candidate in range(self.world_size):
            c = self.coords(candidate)
            if (c.pipeline, c.tensor, c.data) == (pipeline, tensor, data):
                return candidate
        raise LayoutError(
            f"no rank at pipeline={pipeline}, tensor={tensor}, data={data} in {self}; valid ranges are "
            f"[0, {self.pipeline}), [0, {self.tensor}), [0, {self.data})."
        )

    def axis_index(self, rank: int, axis: MeshAxis) -> int:
        """Coordinate of ``rank`` along ``axis``."""
        return int(getattr(self.coords(rank), _check_axis(axis)))

    def replica(self, rank: int) -> int:
        """Generation data-parallel index of ``rank``."""
        return self.coords(rank).data

    def _groups_by(self, key: str) -> tuple[tuple[int, ...], ...]:
        buckets: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            values = {"pipeline": c.pipeline, "tensor": c.tensor, "data": c.data, "replica": c.replica}
            if key == "micro_data":
                label: tuple[int, ...] = (c.replica, c.pipeline, c.tensor)
            else:
                label = tuple(v for name, v in values.items() if name not in (key, "replica"))
            buckets.setdefault(label, []).append(rank)
        return tuple(sorted(tuple(sorted(members)) for members in buckets.values()))

    def tensor_groups(self) -> tuple[tuple[int, ...], ...]:
        """Generation tensor-parallel groups."""
        return self._groups_by("tensor")

    def pipeline_groups(self) -> tuple[tuple[int, ...], ...]:
        """Generation pipeline-parallel groups."""
        return self._groups_by("pipeline")

    def micro_data_groups(self) -> tuple[tuple[int, ...], ...]:
        """Micro-DP groups: ranks of one training shard group holding the same generation shard."""
        return self._groups_by("micro_data")


def _aligned(training: ParallelLayout, generation: GenerationLayout) -> bool:
    return training.tensor % generation.tensor == 0 and training.pipeline % generation.pipeline == 0


def _check_axis(axis: str) -> str:
    if axis not in MESH_AXES:
        raise LayoutError(f"unknown mesh axis {axis!r}; known: {', '.join(MESH_AXES)}.")
    return axis
