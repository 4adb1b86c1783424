"""torch distributed checkpoints (DCP) read as data, never as code.

torch's own ``FileSystemReader`` reads ``.metadata`` with ``pickle.load`` and its ``DefaultLoadPlanner`` reads every
non-tensor value of a ``.distcp`` file (optimizer hyper-parameters, say) with ``torch.load(weights_only=False)``
(torch 2.13), so a crafted checkpoint would run code on load. Here:

- ``.metadata`` (and a rank-local ``__<rank>.metadata``) goes through
  :class:`hybridflow.checkpoint_files.safe_load.RestrictedUnpickler` over :func:`metadata_globals`, the classes torch's
  writer pickles there; every data file it names must lie in the checkpoint directory;
- every item of a ``.distcp`` file, tensor or value, is read with ``torch.load(weights_only=True)``.

A refused or unreadable file raises :class:`hybridflow.errors.UnsafeCheckpointError` /
:class:`hybridflow.errors.CheckpointError` naming it, on every rank (torch's collective wrapping taken off).
"""

from __future__ import annotations

import io
import pathlib
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from hybridflow.checkpoint_files.safe_load import global_name, load_torch_stream, refusal, restricted_pickle_load
from hybridflow.errors import CheckpointError

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "load_distributed", "read_metadata", "metadata_globals"]


def metadata_globals() -> dict[str, Any]:
    """The globals a DCP ``.metadata`` may name (``module.name`` → object): torch's metadata dataclasses, the
    memory-format enum, ``torch.Size``, dtypes, the layout helper and the ``PosixPath`` of ``StorageMeta.checkpoint_id``
    (under the names Python 3.11-3.13 pickle it by). Found by reading the checkpoints of the fsdp engine."""
    from torch.distributed.checkpoint import metadata

    classes: list[Any] = [metadata.Metadata, metadata.MetadataIndex, metadata.TensorStorageMetadata,
                          metadata.BytesStorageMetadata, metadata.ChunkStorageMetadata, metadata.TensorProperties,
                          metadata.StorageMeta, metadata._MEM_FORMAT_ENCODING, _StorageInfo, torch.Size,
                          torch.serialization._get_layout, pathlib.PosixPath]
    allowed = {global_name(value): value for value in classes}
    allowed.update({"pathlib.PosixPath": pathlib.PosixPath, "pathlib._local.PosixPath": pathlib.PosixPath})
    allowed.update({f"torch.{name}": value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
    return allowed


def read_metadata(path: Path) -> Metadata:
    """The :class:`Metadata` pickled in ``path`` (a DCP ``.metadata``), read with the restricted unpickler; every
    data file it names must be a file name in the same directory."""
    metadata = restricted_pickle_load(path, allowed=metadata_globals())
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint file {path} should hold torch distributed checkpoint metadata; it holds a "
                              f"{type(metadata).__name__}. Fix: resume or export from another checkpoint")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str) or Path(name).name != name or name in (
                "", ".", ".."):
            raise CheckpointError(f"checkpoint file {path} names data file {name!r}, which is not a file of its own "
                                  "directory; the metadata was altered. Fix: delete this checkpoint")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` with :func:`read_metadata`, and errors that name the file being read.

    ``failure`` keeps the first such error, which :func:`load_distributed` raises when torch wrapped it."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.failure: CheckpointError | None = None
        self._reading: _StorageInfo | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        if not path.exists():
            raise FileNotFoundError(path)  # torch then tries the rank-local metadata file, as its own reader does
        try:
            metadata = read_metadata(path)
        except CheckpointError as exc:
            self.failure = self.failure or exc
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]  # set just above when None
        return metadata

    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> IO[bytes]:
        self._reading = sinfo  # which item of which file read_data is reading (for its errors)
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except CheckpointError as exc:
            self.failure = self.failure or exc
            raise
        except Exception as exc:  # a tensor item torch's weights_only refused, or one that does not fit
            if self._reading is None:
                raise
            file = Path(str(self.path)) / self._reading.relative_path
            with file.open("rb") as handle:
                handle.seek(self._reading.offset)
                item = io.BytesIO(handle.read(self._reading.length))
            error = refusal(file, exc, item)
            self.failure = self.failure or error
            raise error from exc


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` whose non-tensor values are read with ``torch.load(weights_only=True)`` (torch's
    own reads them with ``weights_only=False``)."""

    def __init__(self, reader: SafeFileSystemReader) -> None:
        super().__init__()
        self._reader = reader

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        info = self._reader.storage_data[read_item.storage_index]
        loaded = load_torch_stream(value, path=Path(str(self._reader.path)) / info.relative_path)
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes does
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_distributed(state: dict[str, Any], directory: Path, *, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load(state, ...)`` from ``directory`` through :class:`SafeFileSystemReader` and
    :class:`SafeLoadPlanner`; ``no_dist`` reads in this process alone (no process group).

    Raises:
        UnsafeCheckpointError: a file of the checkpoint holds a global outside the allow-list (file and global
            named); nothing of it ran.
        CheckpointError: a file is missing, unreadable or does not fit ``state``.
    """
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = SafeFileSystemReader(directory)
    reader.read_metadata()  # refused here, torch would only warn and wrap the error
    try:
        load(state, storage_reader=reader, planner=SafeLoadPlanner(reader), no_dist=no_dist)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # torch wraps what a rank raised in a CheckpointException (a
        if reader.failure is not None:                # BaseException): raise our own error instead
            raise reader.failure from exc
        raise
