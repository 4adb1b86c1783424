"""DeepSpeed's checkpoint files read as data, never as code, on resume and on export.

DeepSpeed's own loader (``TorchCheckpointEngine.load``, deepspeed 0.19) calls ``torch.load(weights_only=False)`` on
every file of its checkpoint; :func:`files_read_as_data` puts :func:`load_deepspeed_file` in its place for the length
of a load: ``torch.load(weights_only=True)`` plus the few DeepSpeed classes its optimizer state pickles
(:func:`deepspeed_globals`, found by reading the checkpoints of ZeRO-1/2/3 with and without bf16).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hybridflow.checkpoint_files.safe_load import enum_member_by_name, load_torch_file

__all__ = ["deepspeed_globals", "load_deepspeed_file", "files_read_as_data"]


def deepspeed_globals() -> list[Any]:
    """What a DeepSpeed checkpoint file may name beyond torch's ``weights_only`` list: the ZeRO stage enum (and its
    members pickled by name), the loss scaler and ZeRO-1/2's fragment addresses."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address, (enum_member_by_name, "builtins.getattr")]


def load_deepspeed_file(path: str | Path, map_location: Any = "cpu") -> Any:
    """One file of a DeepSpeed checkpoint (module states, optimizer partitions), read as data.

    Raises:
        UnsafeCheckpointError: it holds a global outside the list (file and global named); nothing of it ran.
        CheckpointError: it is missing or unreadable.
    """
    return load_torch_file(path, allowed=deepspeed_globals(), map_location=map_location)


class _DataOnlyCheckpointEngine:
    """Stands in for a DeepSpeed engine's checkpoint engine: ``load`` is :func:`load_deepspeed_file`, everything
    else the engine it wraps."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_deepspeed_file(path, map_location=map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextmanager
def files_read_as_data(engine: Any) -> Iterator[None]:
    """While inside, every file the DeepSpeed ``engine`` loads through its checkpoint engine (all of a dense model's
    checkpoint: module states, ZeRO optimizer partitions, scheduler) is read by :func:`load_deepspeed_file`."""
    original = engine.checkpoint_engine
    engine.checkpoint_engine = _DataOnlyCheckpointEngine(original)
    try:
        yield
    finally:
        engine.checkpoint_engine = original
