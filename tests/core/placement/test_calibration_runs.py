"""Calibrating on several runs separates compute from sharded-data-parallel sync latency; trainer ledger names map
onto the dataflow's stages."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridflow.placement import Efficiency, Workload, build_cluster, compare_nodes, get_dataflow, parse_model
from hybridflow.placement.autoparallel import LayoutPlanner
from hybridflow.placement.calibration import TRAINER_NODES, fit_efficiency_to_runs, match_nodes
from hybridflow.placement.parallel import GenerationConfig, ParallelConfig
from hybridflow.placement.record import PlanInputs, PlanRecord, plan_inputs, retime_plan

ROLES = ("actor", "critic", "reference", "reward")
# the "true" machine: slow compute and 4 ms per ring hop of every sharded collective
TRUTH = replace(Efficiency(), train=0.05, infer=0.08, prefill=0.11, decode_bandwidth=0.12,
                sync_latency_seconds=0.004, transition_overhead_seconds=0.03)


def _inputs() -> PlanInputs:
    workload = Workload(prompts=24, samples_per_prompt=4, prompt_length=8, response_length=16, mini_batches=1,
                        micro_batch_size=32)
    return plan_inputs("ppo", {r: parse_model("tiny") for r in ROLES}, build_cluster("cpu", 4, 4), workload)


def _record(placement: tuple[tuple[str, ...], ...], devices: tuple[int, ...]) -> PlanRecord:
    parallel = {r: ParallelConfig(pipeline=1, tensor=1, data=n) for g, n in zip(placement, devices) for r in g}
    return PlanRecord(placement=placement, devices=devices, parallel=parallel,
                      generation={"actor": GenerationConfig(pipeline=1, tensor=1)})


def _trainer_rows(inputs: PlanInputs, record: PlanRecord, efficiency: Efficiency) -> list[dict]:
    """Ledger rows named the way `hybridflow train` names nodes (role.method), timed by ``efficiency``."""
    usable = inputs.cluster.device.memory_bytes * efficiency.usable_memory_fraction
    stages = {t.name: t.seconds for t in retime_plan(LayoutPlanner(inputs.simulator(efficiency), inputs.dataflow,
                                                                   inputs.models), record, usable).timings}
    nodes = {node: {"seconds": sum(stages[s] for s in covered)}
             for node, covered in match_nodes(stages, TRAINER_NODES).items()}
    return [{"iteration": i, "nodes": nodes} for i in range(3)]


def _iteration(inputs: PlanInputs, record: PlanRecord, efficiency: Efficiency) -> float:
    usable = inputs.cluster.device.memory_bytes * efficiency.usable_memory_fraction
    planner = LayoutPlanner(inputs.simulator(efficiency), inputs.dataflow, inputs.models)
    return retime_plan(planner, record, usable).iteration_seconds


def test_trainer_node_names_cover_the_ppo_stages() -> None:
    stages = [s.name for s in get_dataflow("ppo").stages]
    matched = match_nodes(stages, [*TRAINER_NODES, "driver.other"])
    assert matched["actor.generate"] == ("generate", "weight_sync")
    assert "driver.other" not in matched and "cost_model.compute_scores" not in matched
    assert sorted(s for covered in matched.values() for s in covered) == sorted(stages)


def test_two_data_parallel_sizes_identify_sync_latency_and_predict_a_third_placement() -> None:
    inputs = _inputs()
    colocate, standalone = _record((ROLES,), (4,)), _record(tuple((r,) for r in ROLES), (1, 1, 1, 1))
    runs = [(record, _trainer_rows(inputs, record, TRUTH)) for record in (colocate, standalone)]
    fitted, comparisons = fit_efficiency_to_runs(inputs, runs)
    assert fitted.sync_latency_seconds == pytest.approx(0.004, rel=0.05)
    assert fitted.train == pytest.approx(0.05, rel=0.05) and fitted.infer == pytest.approx(0.08, rel=0.05)
    assert all(c.ratio == pytest.approx(1.0, abs=0.05) for run in comparisons for c in run)
    held_out = _record((("actor", "reference"), ("critic", "reward")), (2, 2))
    assert _iteration(inputs, held_out, fitted) == pytest.approx(_iteration(inputs, held_out, TRUTH), rel=0.05)
    records = (colocate, standalone, held_out)
    assert sorted(records, key=lambda r: _iteration(inputs, r, fitted)) == sorted(
        records, key=lambda r: _iteration(inputs, r, TRUTH))


def test_fit_refuses_runs_with_no_matching_node() -> None:
    from hybridflow.errors import ConfigError

    rows = [{"iteration": 0, "nodes": {"driver.other": {"seconds": 1.0}}}]
    with pytest.raises(ConfigError, match="No measured node"):
        fit_efficiency_to_runs(_inputs(), [(_record((ROLES,), (4,)), rows)])


def test_compare_nodes_sums_the_stages_a_trainer_node_covers() -> None:
    inputs = _inputs()
    record = _record((ROLES,), (4,))
    usable = inputs.cluster.device.memory_bytes * TRUTH.usable_memory_fraction
    plan = retime_plan(LayoutPlanner(inputs.simulator(TRUTH), inputs.dataflow, inputs.models), record, usable)
    stages = {t.name: t.seconds for t in plan.timings}
    compared = {c.node: c for c in compare_nodes(plan, _trainer_rows(inputs, record, TRUTH),
                                                 {s.name: s.kind for s in inputs.dataflow.stages})}
    assert compared["actor.generate"].predicted == pytest.approx(stages["generate"] + stages["weight_sync"])
    assert compared["actor.generate"].kind == "generate" and compared["actor.update_policy"].kind == "train"
