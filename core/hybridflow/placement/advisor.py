"""The remap advisor: recommend a new plan only when its gain over the remaining iterations pays for the move.

It reads a run's ``plan.json`` and ``ledger.jsonl``, checks for persistent drift from the predictions, calibrates,
re-searches, prices the transition, and appends its decision and arithmetic to ``advisor.jsonl``. Carrying out a
remap (checkpoint, relaunch with the new fragment) is the trainer's job.
Stability: experimental.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError
from hybridflow.placement.autoparallel import LayoutPlanner
from hybridflow.placement.calibration import (
    fit_efficiency,
    fit_efficiency_to_runs,
    match_nodes,
    node_seconds,
    read_ledger,
)
from hybridflow.placement.fragment import build_fragment
from hybridflow.placement.memory import state_bytes
from hybridflow.placement.profiles import Efficiency
from hybridflow.placement.record import PlanInputs, PlanRecord, load_plan_record, retime_plan
from hybridflow.placement.search import Plan, search_placements

__all__ = ["RemapCosts", "Recommendation", "detect_drift", "estimate_remap_seconds", "advise_remap",
           "decide_remap", "calibrate_from_runs", "RunAdvisor", "ADVISOR_FILE"]

ADVISOR_FILE = "advisor.jsonl"


@dataclass(frozen=True, kw_only=True, slots=True)
class RemapCosts:
    """Fixed costs of moving a run to a new plan, beyond moving bytes.

    The defaults are guesses for a GPU cluster; :meth:`measured` takes them from the run itself: its start-up
    (worker processes, process groups, engines and weights of every model) and its first iteration's excess over
    the steady ones (warm-up). ``bytes_per_second`` is the measured rate of moving weights, if known (else the
    profile's inter-node link).
    """

    group_creation_seconds_per_model: float = 10.0
    restart_seconds: float = 60.0
    warmup_iterations: float = 1.0
    warmup_seconds: float | None = None
    bytes_per_second: float | None = None
    source: str = "defaults"

    @classmethod
    def measured(cls, rows: Sequence[Mapping[str, Any]], setup_seconds: float, models: int) -> RemapCosts:
        """Costs measured on this run: ``setup_seconds`` (its start-up, spread over its ``models``) is what a
        restart pays in process-group creation and engine start-up; warm-up is the first ledger row's iteration
        seconds minus the median of the others (0 with fewer than two rows)."""
        seconds = [float(r["seconds"]) for r in rows if isinstance(r.get("seconds"), int | float)]
        warmup = max(0.0, seconds[0] - statistics.median(seconds[1:])) if len(seconds) > 1 else 0.0
        return cls(group_creation_seconds_per_model=setup_seconds / max(1, models), restart_seconds=0.0,
                   warmup_seconds=warmup, source=f"measured: start-up {setup_seconds:.1f} s over {models} models, "
                   f"warm-up {warmup:.2f} s")


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
    calibration: str = ""
    step: int | None = None

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
        rate = costs.bytes_per_second or lanes * device.inter_node.bandwidth * inputs.efficiency.comm
        moved_seconds = max(moved_seconds, nbytes / rate)
    groups = changed * costs.group_creation_seconds_per_model
    warmup = (costs.warmup_seconds if costs.warmup_seconds is not None
              else costs.warmup_iterations * new_iteration_seconds) + (costs.restart_seconds if changed else 0.0)
    return {"weight_movement_seconds": moved_seconds, "process_group_seconds": groups, "warmup_seconds": warmup,
            "models_changed": float(changed), "total_seconds": moved_seconds + groups + warmup}


def decide_remap(gain_per_iteration: float, remaining_iterations: int, transition_seconds: float
                 ) -> tuple[bool, str]:
    """The rule: remap only when gain × remaining iterations exceeds the transition's cost."""
    total = gain_per_iteration * remaining_iterations
    if gain_per_iteration <= 0:
        return False, "After calibration the current plan is still the fastest; keep it."
    if total <= transition_seconds:
        return False, (f"Gain {gain_per_iteration:.3f} s/iteration × {remaining_iterations} remaining = {total:.1f} s "
                       f"does not pay for the transition ({transition_seconds:.1f} s); keep the plan.")
    return True, (f"Gain {gain_per_iteration:.3f} s/iteration × {remaining_iterations} remaining = {total:.1f} s "
                  f"exceeds the transition ({transition_seconds:.1f} s)")


def _data_parallel_sizes(record: PlanRecord) -> set[tuple[str, int]]:
    return {(role, parallel.data) for role, parallel in record.parallel.items()}


def calibrate_from_runs(inputs: PlanInputs, runs: Sequence[tuple[PlanRecord, Sequence[Mapping[str, Any]]]]
                        ) -> tuple[Efficiency, str]:
    """Calibrate on every run seen: :func:`fit_efficiency_to_runs` when some model ran at two data-parallel sizes
    (compute and sharded-sync latency are then separable), else :func:`fit_efficiency` on the last run, saying so."""
    sizes = {size for record, _ in runs for size in _data_parallel_sizes(record)}
    roles = {role for role, _ in sizes}
    if len(runs) > 1 and len(sizes) > len(roles):
        efficiency, _ = fit_efficiency_to_runs(inputs, runs)
        return efficiency, (f"fit_efficiency_to_runs on {len(runs)} runs (data-parallel sizes "
                            f"{sorted({d for _, d in sizes})}: sync latency {efficiency.sync_latency_seconds:.4f} s)")
    record, rows = runs[-1]
    efficiency, _ = fit_efficiency(inputs, record, rows)
    return efficiency, ("fit_efficiency on this run only: every model ran at one data-parallel size, so compute and "
                        "sync latency are not separable; give trainer.advisor_runs a run at another data-parallel "
                        "size (or a short probe run)")


def advise_remap(run_dir: str | Path, remaining_iterations: int, *, window: int = 5, threshold: float = 0.15,
                 persistence: float = 0.8, costs: RemapCosts | None = None, write: bool = True,
                 calibration_runs: Sequence[str | Path] = (), step: int | None = None) -> Recommendation:
    """Decide whether the run in ``run_dir`` should move to a new plan, and append the decision to advisor.jsonl.

    Calibration uses this run's last ``window`` rows and every run in ``calibration_runs`` (run directories with
    ``plan.json`` and ``ledger.jsonl``): see :func:`calibrate_from_runs`.
    """
    costs = costs or RemapCosts()
    run_dir = Path(run_dir)
    inputs, record = load_plan_record(run_dir)
    rows = read_ledger(run_dir)
    steady = rows[1:] if len(rows) > 1 else rows  # the first iteration carries the warm-up
    dataflow = inputs.dataflow
    usable = inputs.cluster.device.memory_bytes * inputs.efficiency.usable_memory_fraction
    predicted_plan = retime_plan(LayoutPlanner(inputs.simulator(), dataflow, inputs.models), record, usable)
    drift = detect_drift(predicted_plan, steady, window=window, threshold=threshold, persistence=persistence)
    describe = predicted_plan.describe()
    if not drift:
        result = Recommendation(remap=False, remaining_iterations=remaining_iterations, drift={},
                                current_plan=describe, current_seconds=predicted_plan.iteration_seconds, step=step,
                                reason=f"Observed node times stay within ±{threshold:.0%} of the predictions over "
                                       f"the last {min(window, len(steady))} iterations; keep the plan.")
        return _write(run_dir, result, write)
    seen: list[tuple[PlanRecord, Sequence[Mapping[str, Any]]]] = []
    for other in calibration_runs:
        other_inputs, other_record = load_plan_record(other)
        if other_inputs.algorithm != inputs.algorithm or other_inputs.models != inputs.models:
            raise ConfigError(f"Calibration run {other} planned {other_inputs.algorithm} with other models than "
                              f"{run_dir}; calibrate only from runs of the same models and algorithm.")
        other_rows = read_ledger(other)
        seen.append((other_record, (other_rows[1:] if len(other_rows) > 1 else other_rows)[-window:]))
    seen.append((record, steady[-window:]))
    efficiency, calibration = calibrate_from_runs(inputs, seen)
    calibrated = inputs.simulator(efficiency)
    current = retime_plan(LayoutPlanner(calibrated, dataflow, inputs.models), record, usable)
    best = search_placements(calibrated, dataflow, inputs.models).best
    gain = current.iteration_seconds - best.iteration_seconds
    if PlanRecord.from_plan(best) == record:
        gain = 0.0
    transition = estimate_remap_seconds(inputs, record, best, best.iteration_seconds, costs)
    transition["measured"] = float(costs.source.startswith("measured"))
    remap, reason = decide_remap(gain, remaining_iterations, transition["total_seconds"])
    result = Recommendation(
        remap=remap, remaining_iterations=remaining_iterations, drift=drift, current_plan=describe,
        current_seconds=current.iteration_seconds, new_plan=best.describe(), new_seconds=best.iteration_seconds,
        gain_per_iteration=gain, total_gain_seconds=gain * remaining_iterations, transition=transition,
        reason=reason + (f"; remap to {best.describe()}." if remap else ""), calibration=calibration, step=step,
        fragment=build_fragment(best, inputs.cluster) if remap else None)
    return _write(run_dir, result, write)


class RunAdvisor:
    """The trainer's periodic check (``trainer.advisor_every``): after every ``every``-th step, run
    :func:`advise_remap` on the run's own ledger with the transition costs measured on this run, and keep the
    latest decision for the end-of-run summary."""

    def __init__(self, run_dir: str | Path, *, every: int, total_steps: int, setup_seconds: float = 0.0,
                 calibration_runs: Sequence[str | Path] = ()) -> None:
        self.run_dir = Path(run_dir)
        if every < 1:
            raise ConfigError(f"trainer.advisor_runs lists runs to calibrate from, but trainer.advisor_every={every} "
                              "runs no check; fix: set trainer.advisor_every to a number of steps, or drop "
                              "trainer.advisor_runs.")
        for other in calibration_runs:
            missing = [name for name in ("plan.json", "ledger.jsonl") if not (Path(other) / name).exists()]
            if missing:
                raise ConfigError(f"trainer.advisor_runs: {other} lacks {' and '.join(missing)}; expected the run "
                                  "directory of an earlier `hybridflow train` with trainer.plan set.")
        if not (self.run_dir / "plan.json").exists():
            raise ConfigError(f"trainer.advisor_every={every} compares a plan's predictions with the run, but "
                              f"{self.run_dir} has no plan.json; fix: set trainer.plan to the output of "
                              "`hybridflow plan --output DIR`, or trainer.advisor_every=0.")
        self.every, self.total_steps, self.setup_seconds = every, total_steps, setup_seconds
        self.calibration_runs = [Path(p) for p in calibration_runs]
        self.models = len(load_plan_record(self.run_dir)[1].parallel)
        self.history: list[Recommendation] = []

    def after_step(self, steps_done: int) -> Recommendation | None:
        """Check when ``steps_done`` is a multiple of ``every`` (and not the last step); returns the decision."""
        if self.every <= 0 or steps_done % self.every or steps_done >= self.total_steps:
            return None
        rows = read_ledger(self.run_dir)
        costs = RemapCosts.measured(rows, self.setup_seconds, self.models)
        recommendation = advise_remap(self.run_dir, self.total_steps - steps_done, costs=costs,
                                      calibration_runs=self.calibration_runs, step=steps_done)
        self.history.append(recommendation)
        return recommendation

    def summary(self) -> str:
        """One line per check for the end of the run."""
        if not self.history:
            return "placement advisor: no check ran (trainer.advisor_every is larger than the run)"
        lines = [f"placement advisor ({len(self.history)} checks, {self.run_dir / ADVISOR_FILE}):"]
        for r in self.history:
            lines.append(f"  step {r.step}: {'REMAP' if r.remap else 'keep'}: {r.reason}")
        return "\n".join(lines)


def _write(run_dir: Path, result: Recommendation, write: bool) -> Recommendation:
    if write:
        with (run_dir / ADVISOR_FILE).open("a") as handle:
            handle.write(json.dumps(result.to_json()) + "\n")
    return result
