"""The built-in transfer protocols: ``one_to_all``, ``all_to_all``, ``dp_compute``, ``dp_compute_padded``,
``rank_zero``, ``mesh``, ``mesh_balanced`` and ``generation_mesh``.

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
    "BalancedMesh",
    "GenerationMesh",
    "balanced_order",
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


class BalancedMesh(Mesh):
    """Protocol ``mesh`` with the rows first reordered so that every data-parallel group gets about the same number of
    tokens (``attention_mask`` sums), as verl's ``trainer.balance_batch``: a rank with long responses would otherwise
    keep the others waiting at every collective of an update. Whole prompt groups (consecutive rows sharing a
    ``uid``: a rollout's n samples) stay together and in order, so each group's prompt is still computed once, and
    every group gets the same number of rows. Groups are dealt largest first to the group with the fewest tokens so
    far (among those with room); the order is kept where it already splits no worse (:func:`balanced_order`).

    The rows come back in the balanced order, so it suits methods whose result is not a row per input row (the
    updates, which return metrics): a method returning a Batch raises on collect. A row-splittable argument that is
    not a Batch on the driver (a future), or whose groups do not divide over the data-parallel groups, is split as
    ``mesh`` splits it.
    """

    concatenates = False  # its rows are reordered: a lazy result (a row-concatenating BatchFuture) would misalign

    def distribute(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], context: TransferContext
    ) -> list[RankInput | None]:
        dp_size, _ = self._validated(context)

        def balanced(value: Any) -> Any:
            if not isinstance(value, Batch) or "attention_mask" not in value:
                return value
            order = balanced_order(value, dp_size)
            return value if order is None else value.index(order)

        return super().distribute(tuple(balanced(value) for value in args),
                                  {key: balanced(value) for key, value in kwargs.items()}, context)

    def collect(self, outputs: list[Any], context: TransferContext) -> Any:
        if any(isinstance(output, Batch) for output in outputs):
            raise ConfigError(
                f"protocol mesh_balanced reorders the rows of {context.role}.{context.method} across its ranks, so "
                "its Batch result would not line up with the input rows; expected a method that returns metrics "
                f"(an update). Fix: set {context.role}.protocols.{context.method}=mesh")
        return concat_or_list(outputs)


def balanced_order(batch: Batch, parts: int) -> list[int] | None:
    """A row order of ``batch`` whose ``parts`` equal consecutive chunks hold about equal token counts, keeping each
    run of consecutive rows with the same ``uid`` (one row each without ``uid``) whole, in order, in one chunk, and
    every chunk the same number of runs; None when the batch's own order splits no worse (the busiest chunk holds no
    more tokens), when it cannot be split so (runs of unequal length, or not a multiple of ``parts``), or with one
    part."""
    rows = len(batch)
    if parts <= 1 or rows % parts:
        return None
    tokens = batch["attention_mask"].reshape(rows, -1).sum(-1).tolist()
    uids = batch.non_tensors.get("uid")
    starts = [0] + [row for row in range(1, rows) if uids is None or uids[row] != uids[row - 1]]
    runs = [(start, stop) for start, stop in zip(starts, [*starts[1:], rows])]
    size = runs[0][1] - runs[0][0]
    if len(runs) % parts or any(stop - start != size for start, stop in runs):
        return None
    run_tokens = [sum(tokens[start:stop]) for start, stop in runs]
    per_part = len(runs) // parts
    loads = [0] * parts
    members: list[list[int]] = [[] for _ in range(parts)]
    for run in sorted(range(len(runs)), key=lambda r: -run_tokens[r]):  # largest first; ties in order
        part = min((p for p in range(parts) if len(members[p]) < per_part), key=lambda p: (loads[p], p))
        loads[part] += run_tokens[run]
        members[part].append(run)
    contiguous = max(sum(run_tokens[p * per_part:(p + 1) * per_part]) for p in range(parts))
    if contiguous <= max(loads):
        return None
    return [row for part in members for run in sorted(part) for row in range(*runs[run])]


#: name → protocol instance registered by the core (``hybridflow.builtins``)
BUILTIN_PROTOCOLS: dict[str, Any] = {
    "one_to_all": OneToAll(),
    "all_to_all": AllToAll(),
    "dp_compute": DataParallelCompute(),
    "dp_compute_padded": DataParallelCompute(pad=True),
    "rank_zero": RankZero(),
    "mesh": Mesh(),
    "mesh_balanced": BalancedMesh(),
    "generation_mesh": GenerationMesh(),
}
