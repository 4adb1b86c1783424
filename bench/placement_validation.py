"""Check the placement simulator against real PPO iterations on this CPU box: predicted vs measured ranking.

PPO with actor, critic, reference (kl_coef > 0) and a reward model, all the tiny Qwen2 preset, on 4 CPU worker
slots (0.5 CPU each). Each placement runs ``--warmup`` + ``--steps`` iterations of ``hybridflow train``'s Trainer;
node times are taken from the controller's call records as *busy* seconds (the slowest rank's time inside the
method, as the ledger's ``busy_seconds``), since spans from dispatch include the wait behind colocated calls and,
for the generation submitted ahead, behind the previous step's actor update. The simulator (CPU profile) is
calibrated two ways: ``fit_efficiency`` on the colocated run alone, and ``fit_efficiency_to_runs`` on the
colocated (DP 4) and standalone (DP 1) runs; the split and the placements the calibrated search ranks fastest and
slowest are held out. Layouts are data-parallel only (the fsdp engine's; the hf rollout has tg = 1).
Simplified: one seed, medians over few steps on a shared box.
Run:  OMP_NUM_THREADS=1 .venv/bin/python bench/placement_validation.py [--steps 8 --warmup 2 --extra 2]
Prints ``MEASURED`` per run, one ``RESULT {json}`` line per placement and ``SUMMARY {json}`` (Spearman, Kendall).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import yaml

from hybridflow.placement import Workload, build_cluster, model_from_hf_config
from hybridflow.placement.autoparallel import LayoutPlanner
from hybridflow.placement.calibration import compare_nodes, fit_efficiency, fit_efficiency_to_runs
from hybridflow.placement.dataflow import Dataflow, Stage, get_dataflow
from hybridflow.placement.parallel import GenerationConfig, ParallelConfig
from hybridflow.placement.profiles import Efficiency
from hybridflow.placement.record import PlanInputs, PlanRecord, plan_inputs, retime_plan
from hybridflow.placement.search import Plan, enumerate_allocations, set_partitions

ROLES = ("actor", "critic", "reference", "reward")
SLOTS = 4
Placement = tuple[tuple[str, ...], ...]
FIXED: dict[str, tuple[Placement, tuple[int, ...]]] = {
    "colocate": ((ROLES,), (4,)),
    "split-ar|cr": ((("actor", "reference"), ("critic", "reward")), (2, 2)),
    "standalone": (tuple((r,) for r in ROLES), (1, 1, 1, 1)),
}


def serialised_ppo() -> Dataflow:
    """PPO as hybridflow's driver dispatched it before it overlapped independent nodes: the reward model scored
    after the gather of log-probs and values, and the critic update finished before the actor update started. The
    driver now dispatches the paper's dataflow (``get_dataflow("ppo")``); this one is kept for comparison."""
    scoring = ("old_log_probs", "ref_log_probs", "values")
    return Dataflow(algorithm="ppo", roles=ROLES, trainable=frozenset({"actor", "critic"}), stages=(
        Stage(name="generate", role="actor", kind="generate"),
        Stage(name="old_log_probs", role="actor", kind="infer", after=("generate",)),
        Stage(name="ref_log_probs", role="reference", kind="infer", after=("generate",)),
        Stage(name="values", role="critic", kind="infer", after=("generate",)),
        Stage(name="reward", role="reward", kind="infer", after=scoring),
        Stage(name="critic_update", role="critic", kind="train", after=(*scoring, "reward")),
        Stage(name="actor_update", role="actor", kind="train", after=("critic_update",)),
        Stage(name="weight_sync", role="actor", kind="transition", after=("actor_update",))))


def build_inputs(batch: int, samples: int, prompt_length: int, response_length: int) -> PlanInputs:
    from hybridflow.testing.fixtures import tiny_model_config

    model = model_from_hf_config({**tiny_model_config(), "torch_dtype": "float32"}, name="tiny-qwen2")
    workload = Workload(prompts=batch, samples_per_prompt=samples, prompt_length=prompt_length,
                        response_length=response_length, mini_batches=1, micro_batch_size=32)
    return plan_inputs("ppo", {r: model for r in ROLES}, build_cluster("cpu", SLOTS, SLOTS), workload)


def data_parallel_record(placement: Placement, devices: tuple[int, ...]) -> PlanRecord:
    parallel = {role: ParallelConfig(pipeline=1, tensor=1, data=n) for group, n in zip(placement, devices)
                for role in group}
    return PlanRecord(placement=placement, devices=devices, parallel=parallel,
                      generation={"actor": GenerationConfig(pipeline=1, tensor=1)})


def predict(inputs: PlanInputs, record: PlanRecord, efficiency: Efficiency, dataflow: Dataflow) -> Plan:
    usable = inputs.cluster.device.memory_bytes * efficiency.usable_memory_fraction
    return retime_plan(LayoutPlanner(inputs.simulator(efficiency), dataflow, inputs.models), record, usable)


def name_of(placement: Placement, devices: tuple[int, ...]) -> str:
    return " | ".join(f"{'+'.join(g)}:{n}" for g, n in zip(placement, devices))


def candidates() -> list[tuple[Placement, tuple[int, ...]]]:
    """Every placement of the four models × every allocation of the 4 slots (data-parallel layouts only)."""
    out = []
    for placement in set_partitions(ROLES):
        for devices in enumerate_allocations(SLOTS, [1] * len(placement)):
            out.append((placement, tuple(devices)))
    return out


# --- measuring ------------------------------------------------------------------------------------------------
def busy_seconds(calls: list[tuple[str, float]]) -> dict[str, float]:
    """Per node: the seconds its slowest rank spent inside the method (the ledger's ``busy_seconds``). Spans from
    dispatch would charge a call submitted ahead (the next generation, queued behind the actor's update in the
    previous step) with its wait too."""
    busy: dict[str, float] = {}
    for node, seconds in calls:
        busy[node] = busy.get(node, 0.0) + seconds
    return busy


def trainer_overrides(run_dir: Path, placement: Placement, devices: tuple[int, ...], args: argparse.Namespace
                      ) -> list[str]:
    pools = {f"pool{i}": {"devices_per_node": [n], "device": "cpu", "cpus_per_worker": 0.5}
             for i, n in enumerate(devices)}
    roles = [f"{role}.pool=pool{i}" for i, group in enumerate(placement) for role in group]
    return [f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.tensorboard=false",
            "trainer.resume=never", "trainer.val_every=0", "trainer.checkpoint_every=0",
            f"trainer.total_steps={args.warmup + args.steps}",
            "trainer.deadline_s=300", "algorithm.name=ppo", "algorithm.kl_coef=0.01",
            "actor.recompute_log_probs=true", "reward.model={preset: tiny-qwen2}", f"data.batch_size={args.batch}",
            f"rollout.n={args.samples}", f"rollout.max_new_tokens={args.response_length}",
            f"resource_pools={yaml.safe_dump(pools, default_flow_style=True).strip()}", *roles]


def measure(run_dir: Path, placement: Placement, devices: tuple[int, ...], args: argparse.Namespace
            ) -> dict[str, Any]:
    """Run the Trainer; return per-step wall seconds and busy rows (also written to RUN_DIR/busy.jsonl)."""
    from hybridflow.config import load_config
    from hybridflow.trainer import Trainer

    example = Path(__file__).resolve().parents[1] / "examples" / "grpo_arithmetic_scratch.yaml"
    config = load_config(example, trainer_overrides(run_dir, placement, devices, args))
    calls: list[tuple[str, float]] = []

    def observe(record: Any) -> None:
        calls.append((f"{record.role}.{record.method}", max(record.compute_seconds_per_rank, default=0.0)))

    started = time.perf_counter()
    trainer = Trainer(config, progress=False)
    trainer.call_observers.append(observe)  # this run's group calls only
    walls, rows = [], []
    try:
        trainer.start()
        setup = time.perf_counter() - started
        for step in range(args.warmup + args.steps):
            calls.clear()
            tick = time.perf_counter()
            trainer.train_step()
            wall = time.perf_counter() - tick
            if step >= args.warmup:
                walls.append(wall)
                rows.append({"iteration": step, "seconds": wall,
                             "nodes": {n: {"busy_seconds": s} for n, s in busy_seconds(calls).items()}})
    finally:
        trainer.close()
    (run_dir / "busy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"walls": walls, "rows": rows, "setup_s": setup, "run_dir": run_dir}


# --- ranking statistics ---------------------------------------------------------------------------------------
def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    for rank, index in enumerate(order):
        out[index] = float(rank)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 1 else float("nan")


def kendall(a: list[float], b: list[float]) -> float:
    pairs = list(itertools.combinations(range(len(a)), 2))
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum(
        (a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs)
    return score / len(pairs) if pairs else float("nan")


def replay(dataflow: Dataflow, placement: Placement, rows: list[dict[str, Any]]) -> float:
    """The simulator's schedule fed with the observed median busy seconds (isolates schedule-model error)."""
    from hybridflow.placement.calibration import TRAINER_NODES, node_seconds
    from hybridflow.placement.search import schedule_dataflow

    observed = {name: statistics.median(v) for name, v in node_seconds(rows).items()}
    seconds = {s.name: 0.0 for s in dataflow.stages}
    for node, value in observed.items():
        stages = [s for s in TRAINER_NODES.get(node, ()) if s in seconds]
        if stages:
            seconds[stages[0]] += value
    set_of_role = {role: i for i, group in enumerate(placement) for role in group}
    return max(t.end for t in schedule_dataflow(dataflow, set_of_role, seconds))


def correlations(reports: list[dict[str, Any]], key: str) -> dict[str, float]:
    values, observed = [r[key] for r in reports], [r["measured_s"] for r in reports]
    return {"spearman": round(spearman(values, observed), 3), "kendall": round(kendall(values, observed), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=24, help="prompts per iteration (24·n divides 1, 2, 3, 4)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--extra", type=int, default=2, help="held-out placements beyond split-ar|cr, picked by the "
                        "calibrated prediction (fastest and slowest not yet measured)")
    parser.add_argument("--run-root", type=Path, default=None)
    args = parser.parse_args()
    from hybridflow.controller import init_ray

    init_ray(num_cpus=4, object_store_memory=300_000_000)
    root = args.run_root or Path(tempfile.mkdtemp(prefix="placement-validation-"))
    inputs = build_inputs(args.batch, args.samples, 8, args.response_length)
    dispatched, serialised = get_dataflow("ppo"), serialised_ppo()  # the driver dispatches the paper's dataflow
    kinds = {s.name: s.kind for s in dispatched.stages}
    todo = [FIXED["colocate"], FIXED["standalone"], FIXED["split-ar|cr"]]
    calibration_runs = set(todo[:2])
    measured: dict[tuple[Placement, tuple[int, ...]], dict[str, Any]] = {}
    one_run: Efficiency | None = None
    two_run: Efficiency | None = None
    while todo:
        placement, devices = todo.pop(0)
        run_dir = root / name_of(placement, devices).replace(" | ", "__").replace(":", "-").replace("+", "_")
        run_dir.mkdir(parents=True, exist_ok=True)
        result = measure(run_dir, placement, devices, args)
        measured[(placement, devices)] = result
        print("MEASURED " + json.dumps({"placement": name_of(placement, devices), "steps_s": [
            round(w, 3) for w in result["walls"]], "setup_s": round(result["setup_s"], 1)}), flush=True)
        if one_run is None:  # the single-run calibration fit_efficiency offers: colocated only
            one_run, _ = fit_efficiency(inputs, data_parallel_record(placement, devices), result["rows"])
        elif two_run is None:  # colocated (DP 4) + standalone (DP 1): separates compute from sync latency
            two_run, _ = fit_efficiency_to_runs(inputs, [(data_parallel_record(*key), m["rows"])
                                                         for key, m in measured.items()])
            ranked = sorted((predict(inputs, data_parallel_record(p, d), two_run, dispatched).iteration_seconds,
                             (p, d)) for p, d in candidates())
            fresh = [c for _, c in ranked if c not in set(FIXED.values())]
            todo += (fresh[:1] + fresh[-1:])[:args.extra]
            print("CALIBRATION " + json.dumps({"one_run": asdict(one_run), "two_runs": asdict(two_run)}))
            print("PREDICTED_ORDER " + json.dumps([[name_of(*c), round(s, 3)] for s, c in ranked]), flush=True)
    assert one_run is not None and two_run is not None, "needs the colocated and standalone runs"
    reports = []
    for (placement, devices), result in measured.items():
        record = data_parallel_record(placement, devices)
        plan = predict(inputs, record, two_run, dispatched)
        report = {
            "placement": name_of(placement, devices), "kind": plan.kind,
            "used_for": "calibration" if (placement, devices) in calibration_runs else "held-out",
            "measured_s": round(statistics.median(result["walls"]), 3),
            "measured_steps_s": [round(w, 3) for w in result["walls"]], "setup_s": round(result["setup_s"], 1),
            "predicted_prior_s": round(predict(inputs, record, inputs.efficiency, dispatched).iteration_seconds, 3),
            "predicted_one_run_s": round(predict(inputs, record, one_run, dispatched).iteration_seconds, 3),
            "predicted_s": round(plan.iteration_seconds, 3),
            "predicted_serialised_s": round(predict(inputs, record, two_run, serialised).iteration_seconds, 3),
            "replayed_observed_nodes_s": round(replay(dispatched, placement, result["rows"]), 3),
            "nodes": [{"node": c.node, "predicted": round(c.predicted, 3), "observed": round(c.observed_median, 3),
                       "ratio": round(c.ratio, 2)} for c in compare_nodes(plan, result["rows"], kinds)],
            "run_dir": str(result["run_dir"]),
        }
        reports.append(report)
        print("RESULT " + json.dumps(report), flush=True)
    held_out = [r for r in reports if r["used_for"] == "held-out"]
    summary: dict[str, Any] = {
        "placements": len(reports), "held_out": len(held_out),
        "measured_order": [r["placement"] for r in sorted(reports, key=lambda r: r["measured_s"])],
        "predicted_order": [r["placement"] for r in sorted(reports, key=lambda r: r["predicted_s"])]}
    for key in ("predicted_prior_s", "predicted_one_run_s", "predicted_s", "predicted_serialised_s",
                "replayed_observed_nodes_s"):
        summary[key.removesuffix("_s")] = {"all": correlations(reports, key), "held_out": correlations(held_out, key)}
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
