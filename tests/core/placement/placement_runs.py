"""Shared helpers: a recorded plan in a run directory and a synthetic ledger timed by a "true" simulator."""

from __future__ import annotations

import json
from pathlib import Path

from hybridflow.placement import LLAMA_PRESETS, Efficiency, Workload, build_cluster, search_placements
from hybridflow.placement.autoparallel import LayoutPlanner
from hybridflow.placement.record import PlanInputs, PlanRecord, plan_inputs, retime_plan, save_plan_record


def make_run(run_dir: Path, *, devices: int = 128, colocate: bool = True) -> tuple[PlanInputs, PlanRecord]:
    """Record the best colocated (or overall best) plan for four 7B models into ``run_dir``/plan.json."""
    models = {role: LLAMA_PRESETS["7b"] for role in ("actor", "critic", "reference", "reward")}
    inputs = plan_inputs("ppo", models, build_cluster("a100", devices), Workload())
    only = [(tuple(inputs.dataflow.roles),)] if colocate else None
    plan = search_placements(inputs.simulator(), inputs.dataflow, inputs.models, placements=only).best
    run_dir.mkdir(parents=True, exist_ok=True)
    save_plan_record(run_dir / "plan.json", inputs, plan)
    return inputs, PlanRecord.from_plan(plan)


def write_ledger(run_dir: Path, inputs: PlanInputs, record: PlanRecord, true_efficiency: Efficiency,
                 iterations: int = 6) -> dict[str, float]:
    """Write ``iterations`` ledger rows whose node seconds come from ``true_efficiency``; return those seconds."""
    usable = inputs.cluster.device.memory_bytes * true_efficiency.usable_memory_fraction
    planner = LayoutPlanner(inputs.simulator(true_efficiency), inputs.dataflow, inputs.models)
    truth = {t.name: t.seconds for t in retime_plan(planner, record, usable).timings}
    with (run_dir / "ledger.jsonl").open("w") as handle:
        for iteration in range(iterations):
            nodes = {name: {"seconds": s * (1 + 0.01 * ((iteration % 3) - 1)), "tokens": 1, "samples": 1}
                     for name, s in truth.items()}
            handle.write(json.dumps({"iteration": iteration, "nodes": nodes, "edges": []}) + "\n")
    return truth
