"""Save and load a plan with the inputs that produced it (``plan.json``), and re-time a fixed plan.

The advisor and calibration read this record from a run directory; copying it there is the trainer's job.
Stability: experimental.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError, PlacementError
from hybridflow.placement.autoparallel import LayoutPlanner, RoleLayout
from hybridflow.placement.dataflow import Dataflow, Workload, get_dataflow
from hybridflow.placement.models import ModelSpec
from hybridflow.placement.parallel import GenerationConfig, ParallelConfig
from hybridflow.placement.profiles import Cluster, DeviceProfile, Efficiency, InterconnectProfile
from hybridflow.placement.search import Placement, Plan, schedule_dataflow
from hybridflow.placement.simulator import Simulator

__all__ = ["PlanInputs", "PlanRecord", "save_plan_record", "load_plan_record", "retime_plan", "plan_inputs",
           "PLAN_FILE"]

PLAN_FILE = "plan.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanInputs:
    """Everything a search needs besides the search itself."""

    algorithm: str
    models: dict[str, ModelSpec]
    cluster: Cluster
    workload: Workload
    efficiency: Efficiency

    @property
    def dataflow(self) -> Dataflow:
        return get_dataflow(self.algorithm)

    def simulator(self, efficiency: Efficiency | None = None) -> Simulator:
        return Simulator(cluster=self.cluster, workload=self.workload, efficiency=efficiency or self.efficiency)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRecord:
    """A plan's shape (sets, devices, layouts) without timings, so it can be re-timed under another simulator."""

    placement: Placement
    devices: tuple[int, ...]
    parallel: dict[str, ParallelConfig]
    generation: dict[str, GenerationConfig]

    @classmethod
    def from_plan(cls, plan: Plan) -> PlanRecord:
        return cls(placement=plan.placement, devices=plan.devices,
                   parallel={r: layout.parallel for r, layout in plan.layouts.items()},
                   generation={r: layout.generation for r, layout in plan.layouts.items()
                               if layout.generation is not None})


def _plan_dict(plan: Plan) -> dict[str, Any]:
    return {
        "placement": [list(group) for group in plan.placement],
        "devices": list(plan.devices),
        "layouts": {role: {"parallel": asdict(layout.parallel),
                           "generation": asdict(layout.generation) if layout.generation else None}
                    for role, layout in plan.layouts.items()},
        "iteration_seconds": plan.iteration_seconds,
        "stages": {t.name: {"start": t.start, "seconds": t.seconds, "set": t.set_index} for t in plan.timings},
    }


def save_plan_record(path: str | Path, inputs: PlanInputs, plan: Plan) -> Path:
    """Write ``inputs`` and ``plan`` as JSON to ``path``."""
    record = {"algorithm": inputs.algorithm, "models": {r: asdict(m) for r, m in inputs.models.items()},
              "cluster": asdict(inputs.cluster), "workload": asdict(inputs.workload),
              "efficiency": asdict(inputs.efficiency), "plan": _plan_dict(plan)}
    path = Path(path)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def load_plan_record(path: str | Path) -> tuple[PlanInputs, PlanRecord]:
    """Read a ``plan.json`` written by :func:`save_plan_record`."""
    path = Path(path)
    if path.is_dir():
        path = path / PLAN_FILE
    try:
        data = json.loads(path.read_text())
        cluster = dict(data["cluster"])
        device = dict(cluster.pop("device"))
        device["intra_node"] = InterconnectProfile(**device["intra_node"])
        device["inter_node"] = InterconnectProfile(**device["inter_node"])
        inputs = PlanInputs(algorithm=data["algorithm"],
                            models={r: ModelSpec(**m) for r, m in data["models"].items()},
                            cluster=Cluster(device=DeviceProfile(**device), **cluster),
                            workload=Workload(**data["workload"]), efficiency=Efficiency(**data["efficiency"]))
        plan = data["plan"]
        record = PlanRecord(
            placement=tuple(tuple(group) for group in plan["placement"]), devices=tuple(plan["devices"]),
            parallel={r: ParallelConfig(**v["parallel"]) for r, v in plan["layouts"].items()},
            generation={r: GenerationConfig(**v["generation"]) for r, v in plan["layouts"].items()
                        if v.get("generation")})
    except FileNotFoundError as exc:
        raise ConfigError(f"No plan record at {path}. Write one with `hybridflow plan ... --output DIR` and copy "
                          f"{PLAN_FILE} into the run directory.") from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"Plan record {path} is malformed ({type(exc).__name__}: {exc}); regenerate it with "
                          "`hybridflow plan`.") from exc
    return inputs, record


def retime_plan(planner: LayoutPlanner, record: PlanRecord, usable_bytes: float) -> Plan:
    """Time a fixed plan's layouts under ``planner``'s simulator (no search); memory limits are not re-checked,
    except that the generating model's KV cache gets what the set's other residents leave.

    Raises:
        PlacementError: the plan names a role the dataflow lacks, or generation has no room for one sequence.
    """
    layouts: dict[str, RoleLayout] = {}
    set_of_role: dict[str, int] = {}
    for index, group in enumerate(record.placement):
        pending: list[str] = []
        for role in group:
            if role not in planner.models or role not in record.parallel:
                raise PlacementError(f"Plan places {role!r}, which the {planner.dataflow.algorithm} dataflow or "
                                     "the record lacks.")
            set_of_role[role] = index
            if role in record.generation:
                pending.append(role)
                continue
            layout = planner.evaluate(role, record.parallel[role], None, float("inf"))
            if layout is None:
                raise PlacementError(f"Could not time {role} with {record.parallel[role]}.")
            layouts[role] = layout
        for role in pending:
            others = sum(layouts[r].resident_bytes for r in group if r in layouts)
            layout = planner.evaluate(role, record.parallel[role], record.generation[role], usable_bytes - others)
            if layout is None:
                raise PlacementError(f"{role} with {record.parallel[role]} / {record.generation[role]} leaves no "
                                     "KV cache for one sequence under this simulator.")
            layouts[role] = layout
    seconds = {name: s for layout in layouts.values() for name, s in layout.stage_seconds.items()}
    efficiency = planner.simulator.efficiency
    timings = schedule_dataflow(planner.dataflow, set_of_role, seconds, set_devices=record.devices,
                                compute_units=planner.simulator.cluster.compute_units,
                                collective_stall=efficiency.collective_stall)
    return Plan(placement=record.placement, devices=record.devices, layouts=layouts, timings=tuple(timings),
                controller_seconds=efficiency.controller_seconds)


def plan_inputs(algorithm: str, models: Mapping[str, ModelSpec], cluster: Cluster, workload: Workload,
                efficiency: Efficiency | None = None, roles: Sequence[str] | None = None) -> PlanInputs:
    """Build :class:`PlanInputs`, keeping only the models the algorithm uses."""
    dataflow = get_dataflow(algorithm)
    wanted = roles or dataflow.roles
    return PlanInputs(algorithm=dataflow.algorithm, models={r: models[r] for r in wanted if r in models},
                      cluster=cluster, workload=workload, efficiency=efficiency or Efficiency())
