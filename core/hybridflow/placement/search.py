"""The auto-device-mapping search (paper §6, Algorithm 1): placements × allocations × per-model layouts.

Enumerates set partitions of the models, sizes each colocated set by its memory floor, enumerates device
allocations, asks :class:`LayoutPlanner` for each model's layout and schedules the dataflow (disjoint sets run
concurrently where dependencies allow, colocated models one after another). Launching the plan is the trainer's job.
Stability: experimental.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from hybridflow.errors import PlacementError
from hybridflow.placement.autoparallel import LayoutPlanner, RoleLayout
from hybridflow.placement.dataflow import Dataflow
from hybridflow.placement.memory import MemoryFloor, compute_memory_floor, memory_shares, state_bytes
from hybridflow.placement.models import ModelSpec
from hybridflow.placement.simulator import Simulator

__all__ = ["set_partitions", "classify_placement", "enumerate_allocations", "schedule_dataflow", "StageTiming",
           "Plan", "SearchResult", "search_placements", "evaluate_placement", "choose_allocation_unit"]

Placement = tuple[tuple[str, ...], ...]


def set_partitions(items: Sequence[str]) -> Iterator[Placement]:
    """Every partition of ``items`` into non-empty sets (Bell(n) of them), each set in ``items`` order."""
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield ((first,), *partition)
        for index in range(len(partition)):
            yield (*partition[:index], (first, *partition[index]), *partition[index + 1:])


def classify_placement(placement: Placement) -> str:
    """The paper's names: "colocate" (one set), "standalone" (every model alone) or "split" (anything between)."""
    if len(placement) == 1:
        return "colocate"
    if all(len(group) == 1 for group in placement):
        return "standalone"
    return "split"


def enumerate_allocations(total_units: int, minimum_units: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every way to give all ``total_units`` to the sets, each set at least its ``minimum_units``."""
    if not minimum_units:
        if total_units == 0:
            yield ()
        return
    head, tail = minimum_units[0], minimum_units[1:]
    for units in range(head, total_units - sum(tail) + 1):
        for rest in enumerate_allocations(total_units - units, tail):
            yield (units, *rest)


def choose_allocation_unit(num_devices: int, devices_per_node: int, num_sets: int) -> int:
    """Largest divisor of the node size that divides the cluster and still gives every set at least one unit."""
    for unit in sorted((u for u in range(1, devices_per_node + 1) if devices_per_node % u == 0), reverse=True):
        if num_devices % unit == 0 and num_devices // unit >= num_sets:
            return unit
    return 1


@dataclass(frozen=True, kw_only=True, slots=True)
class StageTiming:
    """When a stage starts and how long it runs, on which colocated set."""

    name: str
    role: str
    set_index: int
    start: float
    seconds: float

    @property
    def end(self) -> float:
        return self.start + self.seconds


def schedule_dataflow(dataflow: Dataflow, set_of_role: Mapping[str, int], stage_seconds: Mapping[str, float],
                      *, set_devices: Sequence[int] | None = None, compute_units: float | None = None,
                      collective_stall: float = 0.0) -> list[StageTiming]:
    """List-schedule stages in dispatch order: each waits for its dependencies and for its set to be free.

    With ``compute_units`` (devices that share fewer cores than they are, :attr:`Cluster.compute_units`) and each
    set's device count in ``set_devices``, stages that run at the same time share the compute: while the running
    stages' sets hold D devices, each progresses at min(1, compute_units / D) of its full speed (processor
    sharing), so its seconds stretch; a stage on more than one device also waits for its preempted ranks at every
    collective and progresses at that share / (1 + ``collective_stall``) (:attr:`Efficiency.collective_stall`).
    Without them every set computes on its own (the GPU case).
    """
    if compute_units is None or set_devices is None or sum(set_devices) <= compute_units:
        end: dict[str, float] = {}
        free: dict[int, float] = {}
        timings = []
        for stage in dataflow.stages:
            index = set_of_role[stage.role]
            start = max([free.get(index, 0.0), *(end[dep] for dep in stage.after)])
            seconds = stage_seconds[stage.name]
            timings.append(StageTiming(name=stage.name, role=stage.role, set_index=index, start=start,
                                       seconds=seconds))
            end[stage.name] = free[index] = start + seconds
        return timings
    return _shared_schedule(dataflow, set_of_role, stage_seconds, set_devices, compute_units, collective_stall)


def _shared_schedule(dataflow: Dataflow, set_of_role: Mapping[str, int], stage_seconds: Mapping[str, float],
                     set_devices: Sequence[int], compute_units: float, collective_stall: float = 0.0
                     ) -> list[StageTiming]:
    """Event simulation of :func:`schedule_dataflow` under processor sharing (same dispatch order per set)."""
    queues: dict[int, list[str]] = {}
    for stage in dataflow.stages:
        queues.setdefault(set_of_role[stage.role], []).append(stage.name)
    after = {stage.name: stage.after for stage in dataflow.stages}
    role = {stage.name: stage.role for stage in dataflow.stages}
    done: dict[str, float] = {}
    started: dict[str, float] = {}
    remaining: dict[str, float] = {}  # running stages: seconds left at full speed
    now = 0.0
    while len(done) < len(after):
        for index, queue in queues.items():
            busy = any(set_of_role[role[name]] == index for name in remaining)
            if queue and not busy and all(dep in done for dep in after[queue[0]]):
                name = queue.pop(0)
                started[name], remaining[name] = now, stage_seconds[name]
        if not remaining:  # a dependency cycle cannot happen (Dataflow checks order); guard anyway
            raise PlacementError(f"Dataflow {dataflow.algorithm!r} cannot make progress at t={now:.3f} s.")
        demand = sum(set_devices[set_of_role[role[name]]] for name in remaining)
        share = min(1.0, compute_units / demand)
        rate = {name: share / (1 + collective_stall) if set_devices[set_of_role[role[name]]] > 1 else share
                for name in remaining}
        step = min(left / rate[name] for name, left in remaining.items())
        now += step
        for name in list(remaining):
            remaining[name] -= step * rate[name]
            if remaining[name] <= 1e-12 * max(1.0, stage_seconds[name]):
                del remaining[name]
                done[name] = now
    return [StageTiming(name=s.name, role=s.role, set_index=set_of_role[s.role], start=started[s.name],
                        seconds=done[s.name] - started[s.name]) for s in dataflow.stages]


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """One placement with its device allocation, per-model layouts and the scheduled iteration."""

    placement: Placement
    devices: tuple[int, ...]
    layouts: dict[str, RoleLayout]
    timings: tuple[StageTiming, ...]
    controller_seconds: float = 0.0  # the driver's own time per iteration (Efficiency.controller_seconds)

    @property
    def kind(self) -> str:
        return classify_placement(self.placement)

    @property
    def schedule_seconds(self) -> float:
        """When the last stage ends."""
        return max((t.end for t in self.timings), default=0.0)

    @property
    def iteration_seconds(self) -> float:
        """The scheduled stages plus the controller's own time between them."""
        return self.schedule_seconds + self.controller_seconds

    def describe(self) -> str:
        sets = " | ".join(f"{{{', '.join(group)}}}:{n}" for group, n in zip(self.placement, self.devices))
        return f"{self.kind} {sets}"

    @property
    def overlap_seconds(self) -> float:
        """Stage seconds that ran while another set was busy: Σ stage seconds − schedule (0 when colocated)."""
        return sum(t.seconds for t in self.timings) - self.schedule_seconds

    def idle_fraction(self) -> float:
        """Share of the plan's device-seconds that no stage uses: Σ devices·(iteration − busy) over Σ devices·it."""
        total = sum(self.devices) * self.iteration_seconds
        busy = sum(self.devices[t.set_index] * t.seconds for t in self.timings)
        return max(0.0, 1 - busy / total) if total > 0 else 0.0

    def idle_seconds_per_set(self) -> dict[str, float]:
        """Per set (named by its models): seconds of the iteration in which it runs no stage."""
        busy: dict[int, float] = {}
        for t in self.timings:
            busy[t.set_index] = busy.get(t.set_index, 0.0) + t.seconds
        return {"+".join(group): self.iteration_seconds - busy.get(i, 0.0) for i, group in enumerate(self.placement)}


@dataclass(kw_only=True, slots=True)
class SearchResult:
    """The fastest plan, the best plan of every other feasible placement, and why the rest were rejected."""

    best: Plan
    runners_up: list[Plan]
    infeasible: dict[Placement, str]
    placements_considered: int
    allocations_evaluated: int
    wall_seconds: float
    floors: dict[Placement, list[MemoryFloor]] = field(default_factory=dict)


def _layout_set(planner: LayoutPlanner, group: tuple[str, ...], devices: int, usable_bytes: float
                ) -> tuple[dict[str, RoleLayout] | None, str]:
    """Lay out one colocated set, whose residents add up while only one stage's transient memory is live.

    Two budgets are tried and the faster feasible result kept: a share of memory proportional to each model's
    state, and a greedy pass (forward-only models, then trainers, then the generating model, which gets what is
    left for its KV cache) where each model assumes the not-yet-chosen ones are fully sharded.
    """
    dataflow, models = planner.dataflow, planner.models
    shares = memory_shares(group, models, dataflow)
    chosen: dict[str, RoleLayout] = {}
    proportional: dict[str, RoleLayout] | None = chosen
    reason = ""
    for role in group:
        layout = planner.best_layout(role, devices, usable_bytes * shares[role])
        if layout is None:
            reason = (f"no layout of {role} ({models[role].name}) fits {devices} devices with "
                      f"{usable_bytes * shares[role] / 1e9:.1f} GB per device")
            proportional = None
            break
        chosen[role] = layout
    greedy = _layout_set_greedy(planner, group, devices, usable_bytes)
    feasible = [c for c in (proportional, greedy) if c is not None]
    if not feasible:
        return None, reason or f"no combination of layouts of {{{', '.join(group)}}} fits {devices} devices"
    return min(feasible, key=lambda c: sum(layout.seconds for layout in c.values())), ""


def _layout_set_greedy(planner: LayoutPlanner, group: tuple[str, ...], devices: int, usable_bytes: float
                       ) -> dict[str, RoleLayout] | None:
    dataflow, models = planner.dataflow, planner.models
    generating = {s.role for s in dataflow.stages if s.kind == "generate"}
    order = sorted(group, key=lambda r: (r in generating, r in dataflow.trainable))
    floors = {r: state_bytes(models[r], r in dataflow.trainable) / devices for r in group}
    layouts: dict[str, RoleLayout] = {}
    for role in order:
        budget = usable_bytes - sum(layouts[r].resident_bytes for r in layouts) - sum(
            floors[r] for r in order if r != role and r not in layouts)
        layout = planner.best_layout(role, devices, budget) if budget > 0 else None
        if layout is None:
            return None
        layouts[role] = layout
    resident = sum(layout.resident_bytes for layout in layouts.values())
    if all(resident - layout.resident_bytes + layout.peak_bytes <= usable_bytes for layout in layouts.values()):
        return layouts
    return None


def evaluate_placement(planner: LayoutPlanner, placement: Placement, devices: Sequence[int],
                       usable_bytes: float) -> tuple[Plan | None, str]:
    """Lay out every model of ``placement`` on its set's devices and schedule the iteration; None + reason if not."""
    layouts: dict[str, RoleLayout] = {}
    set_of_role: dict[str, int] = {}
    for index, (group, count) in enumerate(zip(placement, devices)):
        group_layouts, reason = _layout_set(planner, group, count, usable_bytes)
        if group_layouts is None:
            return None, reason
        layouts.update(group_layouts)
        set_of_role.update({role: index for role in group})
    stage_seconds = {name: s for layout in layouts.values() for name, s in layout.stage_seconds.items()}
    efficiency = planner.simulator.efficiency
    timings = schedule_dataflow(planner.dataflow, set_of_role, stage_seconds, set_devices=devices,
                                compute_units=planner.simulator.cluster.compute_units,
                                collective_stall=efficiency.collective_stall)
    return Plan(placement=placement, devices=tuple(devices), layouts=layouts, timings=tuple(timings),
                controller_seconds=efficiency.controller_seconds), ""


def search_placements(simulator: Simulator, dataflow: Dataflow, models: Mapping[str, ModelSpec], *,
                      top: int = 5, allocation_unit: int | None = None,
                      placements: Sequence[Placement] | None = None) -> SearchResult:
    """Return the fastest plan for ``models`` on ``simulator.cluster``, plus the best plan of up to ``top`` others.

    Raises:
        PlacementError: no placement fits; the message gives each placement's reason.
    """
    missing = [role for role in dataflow.roles if role not in models]
    if missing:
        raise PlacementError(f"Algorithm {dataflow.algorithm!r} needs models for {missing}; got {sorted(models)}.")
    started = time.perf_counter()
    cluster = simulator.cluster
    usable = cluster.device.memory_bytes * simulator.efficiency.usable_memory_fraction
    planner = LayoutPlanner(simulator, dataflow, models)
    best_per_placement: list[Plan] = []
    infeasible: dict[Placement, str] = {}
    floors: dict[Placement, list[MemoryFloor]] = {}
    evaluated = 0
    candidates = list(placements) if placements is not None else list(set_partitions(dataflow.roles))
    for placement in candidates:
        unit = allocation_unit or choose_allocation_unit(cluster.num_devices, cluster.devices_per_node,
                                                         len(placement))
        set_floors = [compute_memory_floor(group, models, dataflow, simulator.workload, cluster,
                                           simulator.efficiency.usable_memory_fraction) for group in placement]
        floors[placement] = set_floors
        minimum = [max(1, math.ceil(f.devices / unit)) for f in set_floors]
        total_units = cluster.num_devices // unit
        if sum(minimum) > total_units:
            infeasible[placement] = (
                f"memory floors need {sum(m * unit for m in minimum)} devices > {cluster.num_devices} available: "
                + "; ".join(f.describe() for f in set_floors))
            continue
        best: Plan | None = None
        reason = ""
        for allocation in enumerate_allocations(total_units, minimum):
            evaluated += 1
            plan, why = evaluate_placement(planner, placement, [u * unit for u in allocation], usable)
            if plan is None:
                reason = reason or why
            elif best is None or plan.iteration_seconds < best.iteration_seconds:
                best = plan
        if best is None:
            infeasible[placement] = f"every allocation failed, e.g. {reason}"
        else:
            best_per_placement.append(best)
    if not best_per_placement:
        details = "\n  ".join(f"{_name(p)}: {why}" for p, why in infeasible.items())
        raise PlacementError(
            f"No placement of {dataflow.algorithm} fits {cluster.num_devices} × {cluster.device.name} "
            f"({cluster.device.memory_bytes / 1e9:.0f} GB):\n  {details}\n"
            "Add devices, use devices with more memory, or shrink the models or micro batch.")
    best_per_placement.sort(key=lambda plan: plan.iteration_seconds)
    return SearchResult(best=best_per_placement[0], runners_up=best_per_placement[1:1 + top], infeasible=infeasible,
                        placements_considered=len(candidates), allocations_evaluated=evaluated,
                        wall_seconds=time.perf_counter() - started, floors=floors)


def _name(placement: Placement) -> str:
    return " | ".join("{" + ", ".join(group) + "}" for group in placement)
