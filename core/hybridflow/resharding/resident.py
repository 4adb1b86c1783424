"""Resident weight bytes counted from storages: the distinct ``untyped_storage()`` buffers a set of tensors lives
in, each counted once at its full size, so views and aliases of one buffer are never counted twice.

It counts what it is given; which tensors a phase holds is the caller's business. Stability: public.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["count_storage_bytes"]


def count_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Σ ``nbytes`` over the distinct storages (by device and data pointer) behind ``tensors``; empty storages
    (freed parameters) count 0. DTensors count their local shard; DeepSpeed ZeRO-3 parameters their partition
    (``ds_tensor``, whose storage may be a flat buffer shared by several partitions: counted once) besides their
    own data (empty unless gathered), and a parked storage's aside buffer (``parked_aside`` on the tensor or its
    partition: the bytes :class:`~hybridflow.resharding.StorageParking` kept that no generation shard holds)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        # a DTensor's shard: its ``_local_tensor`` attribute where it has one (to_local() builds a new tensor through
        # an autograd function, ~8 us a parameter: the trainer counts twice a step)
        local = getattr(tensor, "_local_tensor", None)
        if not isinstance(local, torch.Tensor):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        partition = getattr(tensor, "ds_tensor", None)
        held_tensors = [local, partition] if isinstance(partition, torch.Tensor) else [local]
        held_tensors += [aside for t in held_tensors if isinstance(aside := getattr(t, "parked_aside", None),
                                                                    torch.Tensor)]
        for held in held_tensors:
            storage = held.untyped_storage()
            if storage.nbytes() == 0:
                continue
            seen[(str(held.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())
