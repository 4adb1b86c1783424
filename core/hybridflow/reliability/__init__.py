"""Reliability: fault injection points, the call journal, the recovery policy and the ledger audit.

The controller detects failures (errors, deadlines, stack dumps); this package decides what to redo.
"""

from __future__ import annotations

from hybridflow.reliability.audit import RunAudit, audit_ledger
from hybridflow.reliability.faults import (
    ENV_VAR,
    FAULT_POINTS,
    FaultPlan,
    FaultSpec,
    InjectedFault,
    maybe_fail,
    parse_fault_specs,
)
from hybridflow.reliability.recovery import RecoveryPolicy, RunStoppedError, Supervisor, attach_fault_plan
from hybridflow.reliability.supervised import RestartableGroup, Supervised, SupervisedGroups

__all__ = ["ENV_VAR", "FAULT_POINTS", "FaultPlan", "FaultSpec", "InjectedFault", "maybe_fail", "parse_fault_specs",
           "RecoveryPolicy", "RunStoppedError", "Supervisor", "attach_fault_plan", "RunAudit", "audit_ledger",
           "Supervised", "SupervisedGroups", "RestartableGroup"]
