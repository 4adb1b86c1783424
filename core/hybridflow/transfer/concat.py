"""Fast row concatenation of Batches for collecting outputs: one numpy copy per column, split over threads only where
spare cores make that pay.

``torch.cat`` with one intra-op thread is 3–5× slower than ``numpy.concatenate`` on this data; collecting a
B=8192 batch is one full copy, so it must run at memcpy speed, and it is the only copy the driver makes of a
collected result. Batch semantics (version checks) stay in :mod:`hybridflow.batch`; this module only moves bytes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import numpy as np
import torch

from hybridflow.batch import Batch, check_versions

__all__ = ["concat_batches", "copy_threads", "PARALLEL_COPY_BYTES", "COPY_STATS"]

#: copies larger than this are split over :func:`copy_threads` threads (numpy releases the GIL while copying)
PARALLEL_COPY_BYTES = 8 << 20
#: at most this many copy threads
MAX_COPY_THREADS = 4
#: bytes copied and column copies made by :func:`concat_batches` in this process, cumulative (tests count them: a
#: collected result costs exactly one copy of its bytes)
COPY_STATS = {"bytes": 0, "columns": 0}

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def copy_threads() -> int:
    """Threads one large copy is split over: half the cores this process may use, 1 to 4.

    On a 2-core box the other core runs the worker processes and Ray's object store: a second copy thread there
    cost ~1.7× the CPU of one (measured collecting B=8192) and finished no sooner."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_COPY_THREADS, cores // 2))


def _copy_pool(threads: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers != threads:
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="hybridflow-concat")
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
    threads = copy_threads()
    if total_bytes < PARALLEL_COPY_BYTES or threads == 1:
        return np.concatenate(arrays)
    out = np.empty((sum(len(array) for array in arrays), *arrays[0].shape[1:]), dtype=arrays[0].dtype)
    jobs: list[tuple[int, np.ndarray]] = []
    offset = 0
    for array in arrays:
        step = max(1, -(-len(array) // threads))
        jobs.extend((offset + start, array[start:start + step]) for start in range(0, len(array), step))
        offset += len(array)

    def copy(job: tuple[int, np.ndarray]) -> None:
        start, block = job
        out[start:start + len(block)] = block

    list(_copy_pool(threads).map(copy, jobs))
    return out


def _concat_column(tensors: list[torch.Tensor]) -> torch.Tensor:
    COPY_STATS["columns"] += 1
    COPY_STATS["bytes"] += sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    maybe_arrays = [_as_numpy(tensor) for tensor in tensors]
    arrays = [array for array in maybe_arrays if array is not None]
    if len(arrays) != len(maybe_arrays) or len({t.dtype for t in tensors}) != 1 or \
            len({tuple(t.shape[1:]) for t in tensors}) != 1:
        return torch.cat(tensors, dim=0)
    result = torch.from_numpy(_concat_arrays(arrays))
    return result.view(torch.bfloat16) if tensors[0].dtype == torch.bfloat16 else result


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """Same result as :meth:`Batch.concat` (version keys must agree; other meta from the first), faster: one numpy
    copy per column at any size (no TensorDict ``torch.cat``)."""
    if len(batches) <= 1:
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
