"""How a ``WorkerGroup`` call's arguments travel to its ranks: a Batch inside the call when small, else stored once in
the object store and fetched zero-copy by each rank; a future as the refs of each rank's shard."""

from __future__ import annotations

from typing import Any

import ray

from hybridflow.batch import Batch
from hybridflow.controller.future import BatchFuture
from hybridflow.controller.host import FetchArg

__all__ = ["INLINE_BATCH_BYTES", "settle_argument", "stage_argument"]


def settle_argument(value: Any) -> Any:
    """A future whose result cannot stay lazy (not a row-concatenated Batch) is fetched; everything else kept."""
    if isinstance(value, BatchFuture) and not value.is_batch:
        return value.get()
    return value


#: batches up to this many tensor bytes travel inside the call (Ray's own inline limit is 100 KiB); larger ones are
#: stored once in the object store and fetched zero-copy by each rank
INLINE_BATCH_BYTES = 90 * 1024


def stage_argument(value: Any, puts: dict[int, tuple[Any, Any]], slices: dict[tuple[Any, int, int], Any]) -> Any:
    """Replace a Batch by a ref the rank fetches (stored once per call; small ones inline) and a future by its
    shard's refs."""
    if isinstance(value, BatchFuture):
        return value.to_fetch_arg(slices)
    if isinstance(value, Batch) and value.nbytes() <= INLINE_BATCH_BYTES:
        return FetchArg(refs=(), inline=value)
    if isinstance(value, Batch):
        key = id(value)
        if key not in puts:
            puts[key] = (value, ray.put(value))  # keep the batch alive so id() stays unique during this call
        return FetchArg(refs=(puts[key][1],))
    return value
