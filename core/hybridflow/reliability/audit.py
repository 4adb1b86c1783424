"""What the ledger says about an iteration: the policy version each node ran at, which sample uids the updates
consumed, and the checks over a whole run (no mixed versions, every sample consumed exactly once).

It reads journal entries and ledger rows; it never talks to workers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from hybridflow.batch import Batch
from hybridflow.reliability.journal import CallEntry

__all__ = ["versions_of", "uids_of", "RunAudit", "audit_ledger"]


def _is_future(value: Any) -> bool:
    kind = type(value)  # the class: reading ``meta`` on a future of non-Batch outputs raises
    return all(hasattr(kind, name) for name in ("meta", "done", "is_batch")) and not isinstance(value, Batch)


def _meta_version(value: Any) -> int | None:
    if _is_future(value) and not value.is_batch:  # a submitted update's future: per-rank metrics, no meta
        return None
    if isinstance(value, Batch) or _is_future(value):
        version = value.meta.get("policy_version")
        return None if version is None else int(version)
    return None


def versions_of(entry: CallEntry) -> list[int]:
    """The policy version(s) a call ran at: its output's, the version an update consumed, else its inputs'."""
    output = _meta_version(entry.result)
    if output is not None:
        return [output]
    result = entry.result.get() if _is_future(entry.result) else entry.result  # a submitted update's metrics
    results = result if isinstance(result, list) else [result]
    updated = sorted({int(r["actor/policy_version"]) - 1 for r in results
                      if isinstance(r, dict) and "actor/policy_version" in r})
    if updated:
        return updated
    inputs = [_meta_version(v) for v in [*entry.args, *entry.kwargs.values()]]
    return sorted({v for v in inputs if v is not None})


def uids_of(entry: CallEntry) -> list[str]:
    """Sample uids of the batch a call consumed (empty when its input has no ``uid`` column)."""
    for value in [*entry.args, *entry.kwargs.values()]:
        if isinstance(value, Batch) and "uid" in value.non_tensors:
            return [str(uid) for uid in value.non_tensors["uid"]]
    return []


@dataclass(frozen=True, kw_only=True, slots=True)
class RunAudit:
    """Ledger checks over a run; all zero/empty for a healthy one."""

    iterations: list[int]
    mixed_versions: list[int]
    samples_lost: int
    samples_duplicated: int
    recoveries: int


def audit_ledger(rows: list[dict[str, Any]], *, samples_per_prompt: int) -> RunAudit:
    """Check each row: every node ran at the row's policy version; each prompt uid consumed n times by each update."""
    mixed, lost, duplicated, recoveries = [], 0, 0, 0
    for row in rows:
        versions = {v for node in row["nodes"].values() for v in node.get("policy_versions", [])}
        if versions != {row["policy_version"]}:
            mixed.append(row["iteration"])
        consumption = next((n for n in row.get("notes", []) if "consumed_uids" in n), None)
        if consumption is None:
            lost += 1
            continue
        expected = Counter({uid: samples_per_prompt for uid in consumption["prompt_uids"]})
        for uids in consumption["consumed_uids"].values():
            got = Counter(uids)
            lost += sum((expected - got).values())
            duplicated += sum((got - expected).values())
        recoveries += sum(1 for n in row.get("notes", []) if "recovery" in n)
    return RunAudit(iterations=[row["iteration"] for row in rows], mixed_versions=mixed, samples_lost=lost,
                    samples_duplicated=duplicated, recoveries=recoveries)
