"""Per-call records (time per node, bytes per edge) and how they reach observers.

There is no process-wide observer list: each worker group carries its own (``WorkerGroup(observers=...)``), so two
runs in one process never hear each other's calls. The worker group fills records, the ledger consumes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["CallRecord", "CallObserver", "notify_observers"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CallRecord:
    """One finished group call. Stability: public.

    ``seconds`` runs from dispatch to the last rank finishing; ``bytes_in_per_rank`` is what each rank fetched from
    the object store (its shard, for futures passed between groups); ``bytes_out`` the tensor bytes the ranks
    stored as outputs; ``compute_seconds_per_rank`` the time inside the method on each rank (0 for idle ranks).
    """

    group: str
    role: str
    method: str
    protocol: str
    seconds: float
    bytes_in_per_rank: tuple[int, ...]
    bytes_out: int
    started_at: float
    finished_at: float
    compute_seconds_per_rank: tuple[float, ...] = ()
    ok: bool = True
    #: what each rank's role reported from its ``counters()`` after the call (cumulative, e.g. handover bytes)
    counters_per_rank: tuple[dict[str, float], ...] = ()


CallObserver = Callable[[CallRecord], None]


def notify_observers(record: CallRecord, observers: Sequence[CallObserver]) -> None:
    """Deliver ``record`` to ``observers`` (a group's list: whoever owns the group owns who hears its calls)."""
    for observer in list(observers):  # a copy: an observer may add or remove observers
        observer(record)
