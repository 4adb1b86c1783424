"""Check the placement simulator against real PPO iterations on this CPU box: predicted vs measured ranking.

PPO with actor, critic, reference (kl_coef > 0) and a reward model, all the tiny Qwen2 preset, on 4 CPU worker
slots (0.5 CPU each) of a box with ``os.cpu_count()`` cores. Seven fixed placements (colocated, standalone and five
splits) run ``--warmup`` + ``--steps`` iterations of ``hybridflow train``'s Trainer each, once per seed
(``--seeds 0,1``: two separate runs). Node times are the controller's *busy* seconds (the slowest rank's time
inside the method, as the ledger's ``busy_seconds``). Per run the simulator (CPU profile, the cluster's cores
shared by its 4 slots) is calibrated by ``fit_efficiency_to_runs`` on that run's colocated (DP 4) and standalone
(DP 1) placements and ranks the other five, held out; a second score calibrates on the other seed's run (a held-out
run). The fit includes the controller's own time per iteration (``Efficiency.controller_seconds``: iteration minus
the schedule of that step's node times, from the calibration runs) and the stall of multi-rank stages on the shared
cores (``Efficiency.collective_stall``); ``predicted_no_controller_s`` and ``predicted_no_collective_stall_s`` leave
each out. Spearman uses tie-averaged ranks (two placements predicted equal are not ordered). Layouts are
data-parallel only (the fsdp engine's; the hf rollout has tg = 1). The trainer's lookahead (the next generation
submitted behind the actor's update) is off: the simulator times one iteration's dataflow.
Simplified: medians over few steps on a shared box.
Run:  OMP_NUM_THREADS=1 .venv/bin/python bench/placement_validation.py [--seeds 0,1 --steps 8 --warmup 2]
      ... --run-root DIR --analyse-only    (re-analyse saved runs: DIR/seed<s>/<placement>/{busy.jsonl,measured.json})
Prints ``MEASURED`` per placement (with the median CPU seconds per step of each pool's processes and of the
driver), one ``RESULT {json}`` line per placement and run, ``SPEARMAN {json}`` per run and ``SUMMARY {json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import psutil
import yaml

import results_page
from hybridflow.placement.autoparallel import LayoutPlanner
from hybridflow.placement.calibration import compare_nodes, fit_efficiency, fit_efficiency_to_runs
from hybridflow.placement.dataflow import Dataflow, Stage, get_dataflow
from hybridflow.placement.profiles import Efficiency
from hybridflow.placement.record import PlanInputs, PlanRecord, retime_plan
from hybridflow.placement.search import Plan
from hybridflow.testing.placement_runs import (
    CALIBRATION,
    PLACEMENTS,
    ROLES,
    SLOTS,
    Placement,
    data_parallel_record,
    kendall,
    spearman,
    tiny_ppo_inputs,
)


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


def build_inputs(batch: int, samples: int, prompt_length: int, response_length: int,
                 cores: int | None = None) -> PlanInputs:
    """The bench's search inputs: four tiny Qwen2 models, 4 CPU slots sharing ``cores`` cores (the box's)."""
    return tiny_ppo_inputs(cores=cores or os.cpu_count() or SLOTS, batch=batch, samples=samples,
                           prompt_length=prompt_length, response_length=response_length)


def name_of(placement: Placement, devices: tuple[int, ...]) -> str:
    return " | ".join(f"{'+'.join(g)}:{n}" for g, n in zip(placement, devices))


def predict(inputs: PlanInputs, record: PlanRecord, efficiency: Efficiency, dataflow: Dataflow) -> Plan:
    usable = inputs.cluster.device.memory_bytes * efficiency.usable_memory_fraction
    return retime_plan(LayoutPlanner(inputs.simulator(efficiency), dataflow, inputs.models), record, usable)


# --- measuring ------------------------------------------------------------------------------------------------
def busy_seconds(calls: list[tuple[str, float]]) -> dict[str, float]:
    """Per node: the seconds its slowest rank spent inside the method (the ledger's ``busy_seconds``). Spans from
    dispatch would charge a call submitted ahead (the next generation, queued behind the actor's update in the
    previous step) with its wait too."""
    busy: dict[str, float] = {}
    for node, seconds in calls:
        busy[node] = busy.get(node, 0.0) + seconds
    return busy


def trainer_overrides(run_dir: Path, placement: Placement, devices: tuple[int, ...], args: argparse.Namespace,
                      seed: int) -> list[str]:
    pools = {f"pool{i}": {"devices_per_node": [n], "device": "cpu", "cpus_per_worker": 0.5}
             for i, n in enumerate(devices)}
    roles = [f"{role}.pool=pool{i}" for i, group in enumerate(placement) for role in group]
    return [f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.tensorboard=false",
            "trainer.resume=never", "trainer.val_every=0", "trainer.checkpoint_every=0", f"trainer.seed={seed}",
            "trainer.lookahead=false",
            f"trainer.total_steps={args.warmup + args.steps}",
            "trainer.deadline_s=300", "algorithm.name=ppo", "algorithm.kl_coef=0.01",
            "actor.recompute_log_probs=true", "reward.model={preset: tiny-qwen2}", f"data.batch_size={args.batch}",
            f"rollout.n={args.samples}", f"rollout.max_new_tokens={args.response_length}",
            f"resource_pools={yaml.safe_dump(pools, default_flow_style=True).strip()}", *roles]


def measure(run_dir: Path, placement: Placement, devices: tuple[int, ...], args: argparse.Namespace, seed: int
            ) -> dict[str, Any]:
    """Run the Trainer; return per-step wall seconds and busy rows (written to RUN_DIR/busy.jsonl and
    RUN_DIR/measured.json)."""
    from hybridflow.config import load_config
    from hybridflow.trainer import Trainer

    example = Path(__file__).resolve().parents[1] / "examples" / "grpo_arithmetic_scratch.yaml"
    config = load_config(example, trainer_overrides(run_dir, placement, devices, args, seed))
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
        assert trainer.groups is not None
        processes = {pool: [psutil.Process(pid) for pid in (group.local_process_ids() or {}).values()]
                     for pool, group in trainer.groups.by_pool.items()}
        processes["driver"] = [psutil.Process()]
        for step in range(args.warmup + args.steps):
            calls.clear()
            before = cpu_seconds(processes)
            tick = time.perf_counter()
            trainer.train_step()
            wall = time.perf_counter() - tick
            after = cpu_seconds(processes)
            if step >= args.warmup:
                walls.append(wall)
                rows.append({"iteration": step, "seconds": wall,
                             "nodes": {n: {"busy_seconds": s} for n, s in busy_seconds(calls).items()},
                             # CPU seconds each pool's processes (and the driver) used in the step, busy or not
                             "cpu_seconds": {pool: round(after[pool] - before[pool], 4) for pool in after}})
    finally:
        trainer.close()
    (run_dir / "busy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "measured.json").write_text(json.dumps({"walls": walls, "setup_s": setup, "seed": seed,
                                                       "load": os.getloadavg()}) + "\n")
    return load_measured(run_dir)


def cpu_seconds(processes: dict[str, list[Any]]) -> dict[str, float]:
    """User + system CPU seconds so far of each pool's processes (psutil.Process lists), summed per pool."""
    total: dict[str, float] = {}
    for pool, members in processes.items():
        total[pool] = 0.0
        for process in members:
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                total[pool] += times.user + times.system
    return total


def load_measured(run_dir: Path) -> dict[str, Any]:
    """A saved measurement: per-step wall seconds, busy rows, set-up seconds."""
    saved = json.loads((run_dir / "measured.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "busy.jsonl").read_text().splitlines() if line.strip()]
    return {**saved, "rows": rows, "run_dir": run_dir}


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


def correlations(reports: list[dict[str, Any]], key: str, measured: str = "measured_s") -> dict[str, float]:
    values, observed = [r[key] for r in reports], [r[measured] for r in reports]
    return {"spearman": round(spearman(values, observed), 3), "kendall": round(kendall(values, observed), 3)}




def run_dir_of(root: Path, seed: int, name: str) -> Path:
    return root / f"seed{seed}" / name.replace("|", "_")


def report_of(name: str, inputs: PlanInputs, measured: dict[str, Any], fitted: Efficiency, used_for: str,
              dataflow: Dataflow, no_stall: Efficiency) -> dict[str, Any]:
    placement, devices = PLACEMENTS[name]
    record = data_parallel_record(placement, devices)
    plan = predict(inputs, record, fitted, dataflow)
    no_sharing = replace(inputs, cluster=replace(inputs.cluster, compute_units=None))
    kinds = {s.name: s.kind for s in dataflow.stages}
    return {
        "placement": name, "sets": name_of(placement, devices), "used_for": used_for,
        "measured_s": round(statistics.median(measured["walls"]), 3),
        "measured_steps_s": [round(w, 3) for w in measured["walls"]],
        "measured_fastest_quarter_s": round(statistics.median(sorted(measured["walls"])[:max(1, len(measured["walls"])
                                                                                              // 4)]), 3),
        "predicted_s": round(plan.iteration_seconds, 3),
        "predicted_no_controller_s": round(plan.schedule_seconds, 3),
        "predicted_no_collective_stall_s": round(predict(inputs, record, no_stall, dataflow).iteration_seconds, 3),
        "measured_quartiles_s": [round(q, 3) for q in statistics.quantiles(measured["walls"], n=4)],
        "predicted_prior_s": round(predict(inputs, record, inputs.efficiency, dataflow).iteration_seconds, 3),
        "predicted_serialised_s": round(predict(inputs, record, fitted, serialised_ppo()).iteration_seconds, 3),
        "predicted_no_core_sharing_s": round(predict(no_sharing, record, fitted, dataflow).iteration_seconds, 3),
        "replayed_observed_nodes_s": round(replay(dataflow, placement, measured["rows"]), 3),
        "nodes": [{"node": c.node, "predicted": round(c.predicted, 3), "observed": round(c.observed_median, 3),
                   "ratio": round(c.ratio, 2)} for c in compare_nodes(plan, measured["rows"], kinds)],
        "setup_s": round(measured["setup_s"], 1), "load": measured.get("load"),
    }


def calibrate(inputs: PlanInputs, runs: dict[str, dict[str, Any]], collective_stall: float | None = None
              ) -> Efficiency:
    """``fit_efficiency_to_runs`` on one run's colocated and standalone placements (rows: per step the wall seconds
    of ``train_step`` and each node's busy seconds), ``collective_stall`` fitted unless given."""
    fitted, _ = fit_efficiency_to_runs(inputs, [(data_parallel_record(*PLACEMENTS[n]), runs[n]["rows"])
                                                for n in CALIBRATION], collective_stall=collective_stall)
    return fitted


def analyse(inputs: PlanInputs, measured: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per run: calibrate on its colocated + standalone runs, rank all seven; across runs: calibrate on one run,
    rank the other's seven. Prints RESULT and SPEARMAN lines; returns the summary."""
    dataflow = get_dataflow("ppo")  # the driver dispatches the paper's dataflow
    fits = {seed: calibrate(inputs, runs) for seed, runs in measured.items() if set(CALIBRATION) <= set(runs)}
    summary: dict[str, Any] = {"runs": {}}
    for seed, runs in measured.items():
        if seed not in fits:
            continue
        one_run, _ = fit_efficiency(inputs, data_parallel_record(*PLACEMENTS["colocate"]), runs["colocate"]["rows"])
        reports = []
        for name, result in runs.items():
            report = report_of(name, inputs, result, fits[seed], "calibration" if name in CALIBRATION
                               else "held-out", dataflow, calibrate(inputs, runs, collective_stall=0.0))
            report["predicted_one_run_s"] = round(predict(inputs, data_parallel_record(*PLACEMENTS[name]), one_run,
                                                          dataflow).iteration_seconds, 3)
            others = [s for s in fits if s != seed]
            if others:
                report["predicted_other_run_s"] = round(predict(
                    inputs, data_parallel_record(*PLACEMENTS[name]), fits[others[0]], dataflow).iteration_seconds, 3)
            report["seed"] = seed
            reports.append(report)
            results_page.result(report)
        held_out = [r for r in reports if r["used_for"] == "held-out"]
        scores: dict[str, Any] = {"seed": seed, "placements": len(reports), "held_out": len(held_out),
                                  "fitted": {k: round(v, 5) for k, v in asdict(fits[seed]).items()},
                                  "measured_order": [r["placement"] for r in sorted(reports,
                                                                                    key=lambda r: r["measured_s"])]}
        for key in ("predicted_s", "predicted_no_controller_s", "predicted_no_collective_stall_s",
                    "predicted_other_run_s", "predicted_no_core_sharing_s", "predicted_prior_s",
                    "predicted_one_run_s", "predicted_serialised_s", "replayed_observed_nodes_s"):
            if all(key in r for r in reports):
                scores[key.removesuffix("_s")] = {"all": correlations(reports, key),
                                                  "held_out": correlations(held_out, key)}
        scores["predicted_vs_fastest_quarter"] = {
            "all": correlations(reports, "predicted_s", "measured_fastest_quarter_s"),
            "held_out": correlations(held_out, "predicted_s", "measured_fastest_quarter_s")}
        print("SPEARMAN " + json.dumps(scores), flush=True)
        summary["runs"][seed] = scores
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=24, help="prompts per iteration (24·n divides 1, 2, 3, 4)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--seeds", default="0,1", help="one run of every placement per seed")
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--cores", type=int, default=None, help="cores the 4 slots share (default: this box's)")
    parser.add_argument("--run-root", type=Path, default=None)
    parser.add_argument("--analyse-only", action="store_true", help="re-analyse the runs saved under --run-root")
    args = parser.parse_args()
    root = args.run_root or Path(tempfile.mkdtemp(prefix="placement-validation-"))
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.placements.split(",")
    inputs = build_inputs(args.batch, args.samples, 8, args.response_length, args.cores)
    measured: dict[int, dict[str, dict[str, Any]]] = {seed: {} for seed in seeds}
    for seed in seeds:
        for name in names:
            run_dir = run_dir_of(root, seed, name)
            if (run_dir / "measured.json").exists():
                measured[seed][name] = load_measured(run_dir)
                continue
            if args.analyse_only:
                continue
            from hybridflow.controller import init_ray

            init_ray(num_cpus=4, object_store_memory=300_000_000)
            run_dir.mkdir(parents=True, exist_ok=True)
            measured[seed][name] = measure(run_dir, *PLACEMENTS[name], args, seed)
            result = measured[seed][name]
            print("MEASURED " + json.dumps({"seed": seed, "placement": name, "steps_s": [
                round(w, 3) for w in result["walls"]], "setup_s": round(result["setup_s"], 1),
                "load": result["load"], "cpu_s_per_step_median": {
                    pool: round(statistics.median(row["cpu_seconds"][pool] for row in result["rows"]), 4)
                    for pool in result["rows"][0].get("cpu_seconds", {})} if result["rows"] else {}}), flush=True)
    print("SUMMARY " + json.dumps(analyse(inputs, measured)), flush=True)
    print(f"runs saved under {root}")


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="Placement simulator: predicted vs measured PPO iterations"))
