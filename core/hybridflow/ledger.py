"""The iteration ledger: per iteration, seconds per node, bytes per edge with its protocol (and, for the weight
reshard, the lower bound per rank), idle gaps, bytes resident per pool and the actor's resident weight bytes per rank
in the training and generation phases, appended as one JSON line to ``RUN_DIR/ledger.jsonl``.

It records what it is told; the trainer feeds it from the controller's call records and engine statistics.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EdgeRecord", "IterationRecord", "Ledger", "NodeRecord", "read_ledger"]


@dataclass(slots=True)
class NodeRecord:
    name: str
    pool: str
    start: float
    end: float
    tokens: int = 0
    samples: int = 0
    policy_version: int | None = None
    busy_seconds: float | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class EdgeRecord:
    source: str
    target: str
    protocol: str
    bytes_per_rank: list[int]
    lower_bound_bytes_per_rank: list[int] | None = None

    @property
    def bytes(self) -> int:
        return int(sum(self.bytes_per_rank))


@dataclass(slots=True)
class IterationRecord:
    """Everything measured in one iteration; :meth:`to_json` is the ledger row."""

    iteration: int
    policy_version: int | None
    start: float = field(default_factory=time.time)
    end: float | None = None
    nodes: list[NodeRecord] = field(default_factory=list)
    edges: list[EdgeRecord] = field(default_factory=list)
    resident_bytes: dict[str, int] = field(default_factory=dict)
    #: phase (``training``, ``generation``) → per rank, bytes of the distinct storages holding actor weights
    weight_bytes: dict[str, list[int]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    notes: list[dict[str, Any]] = field(default_factory=list)

    def add_node(self, name: str, *, pool: str, start: float, end: float, tokens: int = 0, samples: int = 0,
                 policy_version: int | None = None, busy_seconds: float | None = None) -> NodeRecord:
        """``start``/``end`` span dispatch to collection (queueing included); ``busy_seconds`` is the time the
        slowest rank spent inside the method, when known."""
        record = NodeRecord(name, pool, start, end, tokens, samples, policy_version, busy_seconds)
        self.nodes.append(record)
        return record

    def add_edge(self, source: str, target: str, *, protocol: str, bytes_per_rank: list[int],
                 lower_bound_bytes_per_rank: list[int] | None = None) -> None:
        """``lower_bound_bytes_per_rank``: what each rank had to receive at least (a planned reshard's edge)."""
        bound = None if lower_bound_bytes_per_rank is None else list(lower_bound_bytes_per_rank)
        self.edges.append(EdgeRecord(source, target, protocol, list(bytes_per_rank), bound))

    def idle_gaps(self) -> dict[str, float]:
        """Per pool: seconds of this iteration during which no node ran on it (the gaps between the union of its
        nodes' spans, clipped to the iteration; overlapping nodes count once)."""
        end = self.end if self.end is not None else time.time()
        gaps: dict[str, float] = {}
        for pool in sorted({n.pool for n in self.nodes}):
            intervals = sorted((max(n.start, self.start), min(n.end, end)) for n in self.nodes if n.pool == pool)
            idle, cursor = 0.0, self.start
            for start, stop in intervals:
                if start > cursor:
                    idle += start - cursor
                cursor = max(cursor, stop)
            gaps[pool] = idle + (end - cursor)
        return gaps

    def to_json(self) -> dict[str, Any]:
        nodes: dict[str, dict[str, Any]] = {}
        for node in self.nodes:
            entry = nodes.setdefault(node.name, {"seconds": 0.0, "busy_seconds": 0.0, "tokens": 0, "samples": 0,
                                                 "pool": node.pool, "policy_versions": [], "dispatched_at": node.start})
            entry["dispatched_at"] = min(entry["dispatched_at"], node.start)  # before "start" when submitted ahead
            entry["seconds"] += node.seconds
            entry["busy_seconds"] += node.seconds if node.busy_seconds is None else node.busy_seconds
            entry["tokens"] += node.tokens
            entry["samples"] += node.samples
            if node.policy_version is not None and node.policy_version not in entry["policy_versions"]:
                entry["policy_versions"].append(node.policy_version)
        return {
            "iteration": self.iteration,
            "policy_version": self.policy_version,
            "start": self.start,
            "seconds": (self.end or time.time()) - self.start,
            "nodes": nodes,
            "edges": [{"source": e.source, "target": e.target, "protocol": e.protocol, "bytes": e.bytes,
                       "bytes_per_rank": e.bytes_per_rank,
                       **({} if e.lower_bound_bytes_per_rank is None else {
                           "lower_bound_bytes": int(sum(e.lower_bound_bytes_per_rank)),
                           "lower_bound_bytes_per_rank": e.lower_bound_bytes_per_rank})} for e in self.edges],
            "idle_seconds": self.idle_gaps(),
            "resident_bytes": self.resident_bytes,
            "weight_bytes": self.weight_bytes,
            "metrics": self.metrics,
            "notes": self.notes,
        }


class Ledger:
    """Appends one JSON line per finished iteration to ``ledger.jsonl`` (flushed and fsynced)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "ledger.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def begin(self, iteration: int, policy_version: int | None) -> IterationRecord:
        return IterationRecord(iteration=iteration, policy_version=policy_version)

    def commit(self, record: IterationRecord) -> dict[str, Any]:
        record.end = record.end or time.time()
        row = record.to_json()
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return row

    def truncate_after(self, iteration: int) -> None:
        """Drop rows of iterations > ``iteration`` (a resume replays them)."""
        if not self.path.exists():
            return
        rows = [r for r in read_ledger(self.path.parent) if r["iteration"] <= iteration]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def read_ledger(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "ledger.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
