"""The paper's placement grid (Fig. 13-style): Llama 7B/13B/34B/70B × 16–128 80 GB GPUs, PPO, all four models one size.

Simplified: the cost is this repo's analytical simulator (uncalibrated A100 profile), not measured iterations; the
workload is the paper's (1024 prompts, 1024 + 1024 tokens, 8 mini batches). Run:
    PYTHONPATH=core python bench/placement.py [--profile a100-80gb-hybridflow] [--algorithm ppo] [--paper-mixed]
Prints per cell the chosen placement kind, the best plan of each kind (colocate / split / standalone seconds), the
search's wall time and, on the next lines, the reason in the cost model's terms (``explain_choice``: the stage
seconds each placement overlaps on disjoint sets against the device time it leaves idle) and what the best
standalone plan's separate scoring devices buy (``explain_standalone``: the same devices with the forward-only
models moved onto the critic's set). ``--profile a100-80gb-hybridflow`` is the paper's testbed network (200 Gb/s
between machines; the default ``a100-80gb`` has 800). ``--paper-mixed`` adds the paper's asymmetric case (13B actor
and reference, 70B critic and reward).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import results_page
from hybridflow.errors import PlacementError
from hybridflow.placement import LLAMA_PRESETS, Simulator, Workload, build_cluster, get_dataflow, search_placements
from hybridflow.placement.explain import explain_choice, explain_standalone
from hybridflow.placement.models import ModelSpec

KINDS = ("colocate", "split", "standalone")


def cell(profile: str, algorithm: str, models: dict[str, ModelSpec], devices: int) -> tuple[str, dict[str, Any]]:
    """One cell of the grid: the printed lines and the row of the results page."""
    dataflow = get_dataflow(algorithm)
    simulator = Simulator(cluster=build_cluster(profile, devices), workload=Workload())
    started = time.perf_counter()
    try:
        result = search_placements(simulator, dataflow, models, top=60)
    except PlacementError:
        wall = time.perf_counter() - started
        return (f"{devices:>5}  {'infeasible':<11}{'-':>30}{wall:>9.2f}  memory floors exceed {devices} GPUs",
                {"gpus": devices, "chosen": "infeasible", "search_s": round(wall, 2),
                 "reason": f"memory floors exceed {devices} GPUs"})
    wall = time.perf_counter() - started
    plans = [result.best, *result.runners_up]
    best_of = {kind: next((p.iteration_seconds for p in plans if p.kind == kind), None) for kind in KINDS}
    times = " / ".join(f"{best_of[k]:.1f}" if best_of[k] is not None else "-" for k in KINDS)
    reason = explain_choice(result.best, result.runners_up)
    lines = (f"{devices:>5}  {result.best.kind:<11}{times:>30}{wall:>9.2f}  {result.best.describe()}\n"
             f"       reason: {reason}")
    standalone = next((p for p in plans if p.kind == "standalone"), None)
    merged = explain_standalone(simulator, dataflow, models, standalone) if standalone is not None else None
    row = {"gpus": devices, "chosen": result.best.kind,
           **{f"{kind}_s": round(best_of[kind], 1) if best_of[kind] is not None else None for kind in KINDS},
           "search_s": round(wall, 2), "plan": result.best.describe(), "reason": reason,
           "standalone": merged[1] if merged is not None else None}
    return lines + (f"\n       standalone: {merged[1]}" if merged is not None else ""), row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="a100-80gb")
    parser.add_argument("--algorithm", default="ppo")
    parser.add_argument("--sizes", default="7b,13b,34b,70b")
    parser.add_argument("--devices", default="16,32,64,96,128")
    parser.add_argument("--paper-mixed", action="store_true", help="also 13B actor/reference + 70B critic/reward")
    args = parser.parse_args()
    dataflow = get_dataflow(args.algorithm)
    print(f"{'model':<6}{'GPUs':>5}  {'chosen':<11}{'colocate / split / standalone s':>30}{'search s':>9}  plan")
    grid: list[tuple[str, dict[str, ModelSpec]]] = [
        (size, {role: LLAMA_PRESETS[size] for role in dataflow.roles}) for size in args.sizes.split(",")]
    if args.paper_mixed:
        sizes = {"actor": "13b", "reference": "13b", "critic": "70b", "reward": "70b", "cost": "70b"}
        grid.append(("13/70b", {role: LLAMA_PRESETS[sizes[role]] for role in dataflow.roles}))
    started = time.perf_counter()
    for name, models in grid:
        for devices in (int(n) for n in args.devices.split(",")):
            lines, row = cell(args.profile, args.algorithm, models, devices)
            print(f"{name:<6}" + lines, flush=True)
            results_page.result({"model": name, **row})
    print(f"whole grid: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    raise SystemExit(results_page.run(
        main, title="Auto device mapping on the paper's grid (simulated, not measured)",
        description="The placement search on Llama 7B-70B x 16-128 80 GB GPUs, PPO, all four models one size, costed "
                    "by this repo's analytical simulator (uncalibrated A100 profile): per cell the chosen placement "
                    "kind, the best plan of each kind in seconds per iteration, the search's wall time, the plan and "
                    "the reason in the cost model's terms."))
