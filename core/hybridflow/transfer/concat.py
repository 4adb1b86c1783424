"""Fast row concatenation of Batches for collecting outputs: numpy copies, split over a few threads when large.

``torch.cat`` with one intra-op thread is 3–5× slower than ``numpy.concatenate`` on this data; collecting a
B=8192 batch is one full copy, so it must run at memcpy speed. Batch semantics (version checks) stay in
:mod:`hybridflow.batch`; this module only moves bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import numpy as np
import torch

from hybridflow.batch import Batch, check_versions

__all__ = ["concat_batches", "PARALLEL_COPY_BYTES", "COPY_THREADS"]

#: copies larger than this are split over :data:`COPY_THREADS` threads (numpy releases the GIL while copying)
PARALLEL_COPY_BYTES = 8 << 20
COPY_THREADS = 4

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _copy_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="hybridflow-concat")
        return _pool


def _as_numpy(tensor: torch.Tensor) -> np.ndarray | None:
    if tensor.device.type != "cpu" or tensor.dtype in (torch.complex32,):
        return None
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy()
    try:
        return tensor.contiguous().numpy()
    except (TypeError, RuntimeError):
        return None


def _concat_arrays(arrays: list[np.ndarray]) -> np.ndarray:
    total_bytes = sum(array.nbytes for array in arrays)
    if total_bytes < PARALLEL_COPY_BYTES:
        return np.concatenate(arrays)
    out = np.empty((sum(len(array) for array in arrays), *arrays[0].shape[1:]), dtype=arrays[0].dtype)
    jobs: list[tuple[int, np.ndarray]] = []
    offset = 0
    for array in arrays:
        step = max(1, -(-len(array) // COPY_THREADS))
        jobs.extend((offset + start, array[start:start + step]) for start in range(0, len(array), step))
        offset += len(array)

    def copy(job: tuple[int, np.ndarray]) -> None:
        start, block = job
        out[start:start + len(block)] = block

    list(_copy_pool().map(copy, jobs))
    return out


def _concat_column(tensors: list[torch.Tensor]) -> torch.Tensor:
    maybe_arrays = [_as_numpy(tensor) for tensor in tensors]
    arrays = [array for array in maybe_arrays if array is not None]
    if len(arrays) != len(maybe_arrays) or len({t.dtype for t in tensors}) != 1 or \
            len({tuple(t.shape[1:]) for t in tensors}) != 1:
        return torch.cat(tensors, dim=0)
    result = torch.from_numpy(_concat_arrays(arrays))
    return result.view(torch.bfloat16) if tensors[0].dtype == torch.bfloat16 else result


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """Same result as :meth:`Batch.concat` (version keys must agree; other meta from the first), faster."""
    if len(batches) <= 1 or sum(batch.nbytes() for batch in batches) < PARALLEL_COPY_BYTES:
        return Batch.concat(batches)
    agreed = check_versions((batch.meta for batch in batches), what="concatenated batches")
    keys = [set(batch.keys()) for batch in batches]
    if any(k != keys[0] for k in keys):
        raise ValueError(f"cannot concatenate batches with different columns: {[sorted(k) for k in keys]}")
    first = batches[0]
    tensors = {cast(str, key): _concat_column([batch.tensors[key] for batch in batches])
               for key in first.tensors.keys()}
    non_tensors = {key: np.concatenate([batch.non_tensors[key] for batch in batches]) for key in first.non_tensors}
    return Batch(tensors, non_tensors, {**first.meta, **agreed}, batch_size=sum(len(batch) for batch in batches))
