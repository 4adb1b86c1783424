"""The ``TransferProtocol`` contract: how one worker method's inputs are split to ranks and its outputs gathered.

Protocols only decide *which rows go to which rank* and *which ranks' outputs form the result*; moving bytes
(object store puts, shard fetches, slicing at the producer) is the controller's job, so a protocol works the same
on a local :class:`~hybridflow.batch.Batch` and on a lazy ``BatchFuture`` produced by another worker group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from hybridflow.engines import MeshInfo
from hybridflow.errors import ConfigError

__all__ = [
    "TransferProtocol",
    "TransferContext",
    "RankInput",
    "RowSplittable",
    "is_row_splittable",
    "split_rows",
]


@runtime_checkable
class RowSplittable(Protocol):
    """Anything a protocol may split by rows: a ``Batch`` or a ``BatchFuture`` (lazy, nothing fetched).

    ``chunk(parts, pad=True)`` follows :meth:`hybridflow.batch.Batch.chunk`: copies of the last row are appended
    until the length divides ``parts`` and every chunk gets the ``is_padding`` mask column.
    """

    def __len__(self) -> int: ...

    def chunk(self, chunks: int, *, pad: bool = False) -> list[Any]: ...


def is_row_splittable(value: object) -> bool:
    """True for values a data-parallel protocol splits (Batch, BatchFuture); everything else is replicated."""
    return not isinstance(value, (str, bytes, list, tuple, dict)) and isinstance(value, RowSplittable)


def split_rows(value: Any, parts: int, *, pad: bool = False) -> list[tuple[Any, int]]:
    """Split ``value`` into ``parts`` equal row ranges; return ``(chunk, padding_rows)`` per part.

    Uneven lengths raise :class:`ConfigError` unless ``pad=True``; padding rows are trailing within each chunk.
    """
    if parts <= 0:
        raise ConfigError(f"cannot split into {parts} parts; expected a positive data-parallel size")
    total = len(value)
    if total == 0:
        raise ConfigError(f"cannot split an empty batch over {parts} ranks; expected at least one row")
    if total % parts and not pad:
        raise ConfigError(
            f"cannot split {total} rows evenly over {parts} data-parallel ranks; expected a multiple of {parts}. "
            f"Fix: make the batch size a multiple of {parts}, or use protocol 'dp_compute_padded'"
        )
    chunks = value.chunk(parts, pad=pad)
    size = len(chunks[0])
    return [(chunk, max(0, (index + 1) * size - max(total, index * size))) for index, chunk in enumerate(chunks)]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankInput:
    """The arguments one rank receives for one call; ``padding_rows`` trailing rows are stripped from its output."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    padding_rows: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferContext:
    """What a protocol may know about the receiving group: its size and (lazily) each rank's mesh position."""

    world_size: int
    role: str
    method: str
    mesh_provider: Callable[[], Sequence[MeshInfo]] | None = None

    @property
    def mesh(self) -> Sequence[MeshInfo]:
        """Per-rank :class:`MeshInfo` (queried from the workers on first use, then cached by the group)."""
        if self.mesh_provider is None:
            return [MeshInfo(dp_rank=rank, dp_size=self.world_size, is_collect=True) for rank in range(self.world_size)]
        return self.mesh_provider()


class TransferProtocol(Protocol):
    """How a worker method's inputs reach ranks and its outputs come back. Stability: public.

    ``distribute`` returns one :class:`RankInput` per rank (``None``: that rank does not run the method).
    ``collect_ranks`` names the ranks whose outputs form the result, in order; ``collect`` combines their outputs.
    ``concatenates`` is True when the result is the row concatenation of those outputs: only then can a
    non-blocking result stay lazy (a ``BatchFuture`` other groups fetch shard by shard).
    """

    concatenates: bool

    def distribute(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], context: TransferContext
    ) -> list[RankInput | None]:
        ...

    def collect_ranks(self, context: TransferContext) -> list[int]:
        ...

    def collect(self, outputs: list[Any], context: TransferContext) -> Any:
        ...
