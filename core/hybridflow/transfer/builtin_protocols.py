"""The built-in transfer protocols: ``one_to_all``, ``all_to_all``, ``dp_compute``, ``dp_compute_padded``,
``rank_zero``, ``mesh`` and ``generation_mesh``.

Each only maps arguments to ranks and names the ranks that form the result; the controller moves the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridflow.batch import Batch
from hybridflow.engines import MeshInfo
from hybridflow.errors import ConfigError
from hybridflow.transfer.concat import concat_batches
from hybridflow.transfer.protocol import RankInput, TransferContext, is_row_splittable, split_rows

__all__ = [
    "OneToAll",
    "AllToAll",
    "DataParallelCompute",
    "RankZero",
    "Mesh",
    "GenerationMesh",
    "BUILTIN_PROTOCOLS",
    "concat_or_list",
]


def concat_or_list(outputs: list[Any]) -> Any:
    """Row-concatenate when every output is a Batch, ``None`` when all are ``None``, else the list itself."""
    if outputs and all(isinstance(output, Batch) for output in outputs):
        return concat_batches(outputs)
    if all(output is None for output in outputs):
        return None
    return outputs


class OneToAll:
    """Every rank receives every argument (a Batch is stored once and shared); the result is the list of outputs."""

    concatenates = False

    def distribute(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], context: TransferContext
    ) -> list[RankInput | None]:
        return [RankInput(args=args, kwargs=dict(kwargs)) for _ in range(context.world_size)]

    def collect_ranks(self, context: TransferContext) -> list[int]:
        return list(range(context.world_size))

    def collect(self, outputs: list[Any], context: TransferContext) -> Any:
        return outputs


class AllToAll:
    """Every argument is a sequence of ``world_size`` items; rank ``i`` gets item ``i``. Result: list of outputs."""

    concatenates = False

    def distribute(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], context: TransferContext
    ) -> list[RankInput | None]:
        world = context.world_size
        for name, value in [*enumerate(args), *kwargs.items()]:
            if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or len(value) != world:
                got = (f"{type(value).__name__} of length {len(value)}" if isinstance(value, Sequence)
                       else type(value).__name__)
                raise ConfigError(
                    f"protocol all_to_all needs every argument of {context.role}.{context.method} to be a list of "
                    f"{world} items (one per rank); argument {name!r} is a {got}. Fix: pass one item per rank"
                )
        return [
            RankInput(args=tuple(value[rank] for value in args),
                      kwargs={key: value[rank] for key, value in kwargs.items()})
            for rank in range(world)
        ]

    def collect_ranks(self, context: TransferContext) -> list[int]:
        return list(range(context.world_size))

    def collect(self, outputs: list[Any], context: TransferContext) -> Any:
        return outputs


def _distribute_over_dp(args: tuple[Any, ...], kwargs: dict[str, Any], dp_ranks: Sequence[int], dp_size: int,
                        pad: bool) -> list[RankInput | None]:
    """Split every row-splittable argument into ``dp_size`` chunks; rank r gets chunk ``dp_ranks[r]``."""
    split_args = [split_rows(value, dp_size, pad=pad) if is_row_splittable(value) else None for value in args]
    split_kwargs = {key: split_rows(value, dp_size, pad=pad) if is_row_splittable(value) else None
                    for key, value in kwargs.items()}
    inputs: list[RankInput | None] = []
    for dp_rank in dp_ranks:
        padding = 0
        rank_args = []
        for value, parts in zip(args, split_args):
            if parts is None:
                rank_args.append(value)
            else:
                rank_args.append(parts[dp_rank][0])
                padding = max(padding, parts[dp_rank][1])
        rank_kwargs = {}
        for key, value in kwargs.items():
            parts = split_kwargs[key]
            if parts is None:
                rank_kwargs[key] = value
            else:
                rank_kwargs[key] = parts[dp_rank][0]
                padding = max(padding, parts[dp_rank][1])
        inputs.append(RankInput(args=tuple(rank_args), kwargs=rank_kwargs, padding_rows=padding))
    return inputs


class DataParallelCompute:
    """Rows split evenly over all ranks (rank i gets chunk i); outputs concatenated in rank order.

    With ``pad=True`` (``dp_compute_padded``) uneven batches are padded with copies of the last row and the
    padding is stripped from each rank's output before it is stored.
    """

    concatenates = True

    def __init__(self, *, pad: bool = False) -> None:
        self.pad = pad

    def distribute(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], context: TransferContext
    ) -> list[RankInput | None]:
        world = context.world_size
        return _distribute_over_dp(args, kwargs, list(range(world)), world, self.pad)

    def collect_ranks(self, context: TransferContext) -> list[int]:
        return list(range(context.world_size))

    def collect(self, outputs: list[Any], context: TransferContext) -> Any:
        return concat_or_list(outputs)


class RankZero:
    """Only rank 0 runs, with every argument; the result is its output."""

    concatenates = True

    def distribute(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], context: TransferContext
    ) -> list[RankInput | None]:
        return [RankInput(args=args, kwargs=dict(kwargs))] + [None] * (context.world_size - 1)

    def collect_ranks(self, context: TransferContext) -> list[int]:
        return [0]

    def collect(self, outputs: list[Any], context: TransferContext) -> Any:
        return outputs[0]


class Mesh:
    """Rows split over data-parallel groups, replicated inside each group (TP/PP), collected from one rank per group.

    Each worker reports ``MeshInfo(dp_rank, dp_size, is_collect)`` (``Worker.mesh_info``); for Megatron 3D the
    collect rank is the last pipeline stage at tensor-parallel rank 0.
    """

    concatenates = True

    def __init__(self, *, pad: bool = False) -> None:
        self.pad = pad

    def _infos(self, context: TransferContext) -> list[MeshInfo]:
        return list(context.mesh)

    def _validated(self, context: TransferContext) -> tuple[int, list[int]]:
        mesh = self._infos(context)
        sizes = {info.dp_size for info in mesh}
        if len(mesh) != context.world_size or len(sizes) != 1:
            raise ConfigError(
                f"protocol mesh for {context.role}.{context.method}: expected {context.world_size} workers reporting "
                f"one dp_size, got {len(mesh)} reports with dp_size {sorted(sizes)}. Fix the workers' mesh_info()"
            )
        dp_size = sizes.pop()
        collectors = sorted((info.dp_rank, rank) for rank, info in enumerate(mesh) if info.is_collect)
        if [dp for dp, _ in collectors] != list(range(dp_size)):
            raise ConfigError(
                f"protocol mesh for {context.role}.{context.method}: expected exactly one collect rank per dp_rank "
                f"0..{dp_size - 1}, got collect ranks at dp_ranks {[dp for dp, _ in collectors]}. "
                f"Fix: mark one rank per data-parallel group is_collect=True"
            )
        return dp_size, [rank for _, rank in collectors]

    def distribute(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], context: TransferContext
    ) -> list[RankInput | None]:
        dp_size, _ = self._validated(context)
        return _distribute_over_dp(args, kwargs, [info.dp_rank for info in self._infos(context)], dp_size, self.pad)

    def collect_ranks(self, context: TransferContext) -> list[int]:
        return self._validated(context)[1]

    def collect(self, outputs: list[Any], context: TransferContext) -> Any:
        return concat_or_list(outputs)


class GenerationMesh(Mesh):
    """Protocol ``mesh`` over each worker's *generation* position (``MeshInfo.generation``): rows split over the
    generation replicas (the micro-DP groups' members of the 3D-HybridEngine), the same rows to every rank of a
    tensor group, collected from each group's tensor rank 0. A worker reporting no generation position is its own
    replica, so without any it is ``dp_compute``.
    """

    def _infos(self, context: TransferContext) -> list[MeshInfo]:
        infos = list(context.mesh)
        return [info.generation if info.generation is not None else
                MeshInfo(dp_rank=rank, dp_size=context.world_size, is_collect=True)
                for rank, info in enumerate(infos)]


#: name → protocol instance registered by the core (``hybridflow.builtins``)
BUILTIN_PROTOCOLS: dict[str, Any] = {
    "one_to_all": OneToAll(),
    "all_to_all": AllToAll(),
    "dp_compute": DataParallelCompute(),
    "dp_compute_padded": DataParallelCompute(pad=True),
    "rank_zero": RankZero(),
    "mesh": Mesh(),
    "generation_mesh": GenerationMesh(),
}
