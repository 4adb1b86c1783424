"""Per-call records (time per node, bytes per edge) and the observers that receive them.

Only the record type and the observer list live here; the worker group fills records, the ledger consumes them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CallRecord", "CallObserver", "add_call_observer", "remove_call_observer", "notify_observers"]


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

_lock = threading.Lock()
_observers: list[CallObserver] = []


def add_call_observer(observer: CallObserver) -> CallObserver:
    """Call ``observer(record)`` for every group call in this process once its result is collected."""
    with _lock:
        _observers.append(observer)
    return observer


def remove_call_observer(observer: CallObserver) -> None:
    with _lock:
        if observer in _observers:
            _observers.remove(observer)


def notify_observers(record: CallRecord, extra: CallObserver | None = None) -> None:
    """Deliver ``record`` to the module observers and ``extra`` (a group's own observer)."""
    with _lock:
        observers = list(_observers)
    if extra is not None:
        observers.append(extra)
    for observer in observers:
        observer(record)
