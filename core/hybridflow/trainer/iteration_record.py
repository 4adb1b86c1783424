"""The ledger row of the iteration in flight: the nodes and edges of its group calls (as the groups report them),
the bytes each pool holds and the actor's weight hand-over bytes.

Opening, committing and abandoning the row (:class:`hybridflow.ledger.Ledger`) is the trainer's
(:mod:`hybridflow.trainer.loop`).
"""

from __future__ import annotations

from typing import Any

from hybridflow.ledger import IterationRecord
from hybridflow.trainer.build import Groups

__all__ = ["IterationRecorder"]


class IterationRecorder:
    """Fills the ledger row of the iteration in flight (:attr:`record`, None between iterations)."""

    def __init__(self) -> None:
        self.record: IterationRecord | None = None
        self._handover_totals: list[int] | None = None
        self._handover_bounds: list[int] | None = None
        self._actor_counters: tuple[dict[str, float], ...] = ()

    def observe(self, record: Any) -> None:
        """A call observer: the call's node and edge in the row of the iteration in flight (none: ignored)."""
        if self.record is None:
            return
        node = f"{record.role}.{record.method}"
        # the version each node ran at comes from its outputs (Supervisor.annotate), not from this record
        busy = max(record.compute_seconds_per_rank) if record.compute_seconds_per_rank else None
        self.record.add_node(node, pool=record.group, start=record.started_at, end=record.finished_at,
                             busy_seconds=busy)
        self.record.add_edge("driver" if not any(record.bytes_in_per_rank) else "object_store", node,
                             protocol=record.protocol, bytes_per_rank=list(record.bytes_in_per_rank))
        if record.role == "actor" and record.counters_per_rank:
            self._actor_counters = record.counters_per_rank

    def record_process_stats(self, record: IterationRecord, groups: Groups) -> None:
        """Bytes resident per pool (RSS of its worker processes) and this iteration's weight-handover bytes.

        RSS is read from /proc here when the pool's workers share the driver's node, else asked of the workers; the
        handover bytes are the actor's ``counters()``, which come back with every call's report."""
        for pool, group in groups.by_pool.items():
            record.resident_bytes[pool] = _pool_rss(pool, group, groups)
        if "actor" in groups.role_pool:
            counters = self._actor_counters
            totals = [int(c.get("handover_bytes_received", 0)) for c in counters]
            bounds = [int(c.get("handover_lower_bound_bytes", 0)) for c in counters]
            previous = self._handover_totals or [0] * len(totals)
            previous_bounds = self._handover_bounds or [0] * len(bounds)
            self._handover_totals, self._handover_bounds = totals, bounds

            def delta(now: list[int], before: list[int]) -> list[int]:
                return [n - b if n >= b else n for n, b in zip(now, before)]  # n < b: a restarted worker

            # "reshard": the planner's plan, bytes counted from the executor's buffers, next to its lower bound;
            # "gather": full weights gathered outside the planner (no lower bound to compare with)
            planned = bool(counters) and all(c.get("handover_planned", 0.0) for c in counters)
            record.add_edge("actor.training_engine", "actor.rollout_engine",
                            protocol="reshard" if planned else "gather", bytes_per_rank=delta(totals, previous),
                            lower_bound_bytes_per_rank=delta(bounds, previous_bounds) if planned else None)
            for phase in ("training", "generation"):
                key = f"handover_weight_bytes_{phase}"
                if counters and all(key in c for c in counters):
                    record.weight_bytes[phase] = [int(c[key]) for c in counters]


def _pool_rss(pool: str, group: Any, groups: Groups) -> int:
    import psutil

    local = group.local_process_ids()
    if local:
        try:
            return sum(psutil.Process(pid).memory_info().rss for pid in local.values())
        except psutil.Error:  # a worker exited since: ask the group (a clear error if it is gone)
            pass
    role = next(r for r, p in groups.role_pool.items() if p == pool)
    handle = groups.role(role)
    assert handle is not None  # role_pool lists the hosted roles
    return sum(stats["rss_bytes"] for stats in handle.process_stats())
