"""The remap advisor: recommend a new plan only when its gain over the remaining iterations pays for the move.

It reads a run's ``plan.json`` and ``ledger.jsonl``, checks for persistent drift from the predictions, calibrates,
re-searches, prices the transition, and appends its decision and arithmetic to ``advisor.jsonl``. Carrying out a
remap (checkpoint, relaunch with the new fragment) is the trainer's job.
Stability: experimental.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.placement.autoparallel import LayoutPlanner
from hybridflow.placement.calibration import fit_efficiency, match_nodes, node_seconds, read_ledger
from hybridflow.placement.fragment import build_fragment
from hybridflow.placement.memory import state_bytes
from hybridflow.placement.record import PlanInputs, PlanRecord, load_plan_record, retime_plan
from hybridflow.placement.search import Plan, search_placements

__all__ = ["RemapCosts", "Recommendation", "detect_drift", "estimate_remap_seconds", "advise_remap",
           "ADVISOR_FILE"]

ADVISOR_FILE = "advisor.jsonl"


@dataclass(frozen=True, kw_only=True, slots=True)
class RemapCosts:
    """Fixed costs of moving a run to a new plan, beyond moving bytes."""

    group_creation_seconds_per_model: float = 10.0
    restart_seconds: float = 60.0
    warmup_iterations: float = 1.0


@dataclass(kw_only=True, slots=True)
class Recommendation:
    """The advisor's decision and every number behind it."""

    remap: bool
    reason: str
    remaining_iterations: int
    drift: dict[str, float]
    current_plan: str
    current_seconds: float | None = None
    new_plan: str | None = None
    new_seconds: float | None = None
    gain_per_iteration: float = 0.0
    total_gain_seconds: float = 0.0
    transition: dict[str, float] = field(default_factory=dict)
    fragment: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"time": time.time(), **asdict(self)}


def detect_drift(record_plan: Plan, rows: list[dict[str, Any]], *, window: int, threshold: float,
                 persistence: float) -> dict[str, float]:
    """Nodes whose observed/predicted ratio is off by more than ``threshold``, in the same direction, in at least
    ``persistence`` of the last ``window`` rows; maps each to its median ratio."""
    predicted = {t.name: t.seconds for t in record_plan.timings}
    measured = node_seconds(rows[-window:])
    drifting: dict[str, float] = {}
    for name, stages in match_nodes(predicted, measured).items():
        expected = sum(predicted[s] for s in stages)
        if expected <= 0:
            continue
        ratios = [v / expected for v in measured[name]]
        slow = sum(r > 1 + threshold for r in ratios)
        fast = sum(r < 1 - threshold for r in ratios)
        if max(slow, fast) >= persistence * len(ratios):
            drifting[name] = sorted(ratios)[len(ratios) // 2]
    return drifting


def estimate_remap_seconds(inputs: PlanInputs, current: PlanRecord, new: Plan, new_iteration_seconds: float,
                           costs: RemapCosts) -> dict[str, float]:
    """Price a remap: moving each changed model's state, creating its process groups, restart and warm-up."""
    dataflow = inputs.dataflow
    new_record = PlanRecord.from_plan(new)
    device = inputs.cluster.device
    moved_seconds = 0.0
    changed = 0
    for role in dataflow.roles:
        old_set = next(i for i, g in enumerate(current.placement) if role in g)
        new_set = next(i for i, g in enumerate(new_record.placement) if role in g)
        same = (current.parallel.get(role) == new_record.parallel.get(role)
                and current.devices[old_set] == new_record.devices[new_set]
                and current.generation.get(role) == new_record.generation.get(role))
        if same:
            continue
        changed += 1
        nbytes = state_bytes(inputs.models[role], role in dataflow.trainable)
        lanes = min(current.devices[old_set], new_record.devices[new_set])
        moved_seconds = max(moved_seconds,
                            nbytes / (lanes * device.inter_node.bandwidth * inputs.efficiency.comm))
    groups = changed * costs.group_creation_seconds_per_model
    warmup = costs.warmup_iterations * new_iteration_seconds + (costs.restart_seconds if changed else 0.0)
    return {"weight_movement_seconds": moved_seconds, "process_group_seconds": groups, "warmup_seconds": warmup,
            "models_changed": float(changed), "total_seconds": moved_seconds + groups + warmup}


def advise_remap(run_dir: str | Path, remaining_iterations: int, *, window: int = 5, threshold: float = 0.15,
                 persistence: float = 0.8, costs: RemapCosts | None = None, write: bool = True) -> Recommendation:
    """Decide whether the run in ``run_dir`` should move to a new plan, and append the decision to advisor.jsonl."""
    costs = costs or RemapCosts()
    run_dir = Path(run_dir)
    inputs, record = load_plan_record(run_dir)
    rows = read_ledger(run_dir)
    dataflow = inputs.dataflow
    usable = inputs.cluster.device.memory_bytes * inputs.efficiency.usable_memory_fraction
    predicted_plan = retime_plan(LayoutPlanner(inputs.simulator(), dataflow, inputs.models), record, usable)
    drift = detect_drift(predicted_plan, rows, window=window, threshold=threshold, persistence=persistence)
    describe = predicted_plan.describe()
    if not drift:
        result = Recommendation(remap=False, remaining_iterations=remaining_iterations, drift={},
                                current_plan=describe, current_seconds=predicted_plan.iteration_seconds,
                                reason=f"Observed node times stay within ±{threshold:.0%} of the predictions over "
                                       f"the last {min(window, len(rows))} iterations; keep the plan.")
        return _write(run_dir, result, write)
    efficiency, _ = fit_efficiency(inputs, record, rows[-window:])
    calibrated = inputs.simulator(efficiency)
    current = retime_plan(LayoutPlanner(calibrated, dataflow, inputs.models), record, usable)
    best = search_placements(calibrated, dataflow, inputs.models).best
    gain = current.iteration_seconds - best.iteration_seconds
    transition = estimate_remap_seconds(inputs, record, best, best.iteration_seconds, costs)
    total_gain = gain * remaining_iterations
    result = Recommendation(
        remap=False, remaining_iterations=remaining_iterations, drift=drift, current_plan=describe,
        current_seconds=current.iteration_seconds, new_plan=best.describe(), new_seconds=best.iteration_seconds,
        gain_per_iteration=gain, total_gain_seconds=total_gain, transition=transition, reason="")
    if PlanRecord.from_plan(best) == record or gain <= 0:
        result.reason = "After calibration the current plan is still the fastest; keep it."
    elif total_gain <= transition["total_seconds"]:
        result.reason = (f"Gain {gain:.2f} s/iteration × {remaining_iterations} remaining = {total_gain:.0f} s does "
                         f"not pay for the transition ({transition['total_seconds']:.0f} s); keep the plan.")
    else:
        result.remap = True
        result.fragment = build_fragment(best, inputs.cluster)
        result.reason = (f"Gain {gain:.2f} s/iteration × {remaining_iterations} remaining = {total_gain:.0f} s "
                         f"exceeds the transition ({transition['total_seconds']:.0f} s); remap to {best.describe()}.")
    return _write(run_dir, result, write)


def _write(run_dir: Path, result: Recommendation, write: bool) -> Recommendation:
    if write:
        with (run_dir / ADVISOR_FILE).open("a") as handle:
            handle.write(json.dumps(result.to_json()) + "\n")
    return result
