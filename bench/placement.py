"""The paper's placement grid (Fig. 13-style): Llama 7B/13B/34B/70B × 16–128 80 GB GPUs, PPO, all four models one size.

Simplified: the cost is this repo's analytical simulator (uncalibrated A100 profile), not measured iterations; the
workload is the paper's (1024 prompts, 1024 + 1024 tokens, 8 mini batches). Run:
    PYTHONPATH=core python bench/placement.py [--profile a100] [--algorithm ppo]
Prints per cell the chosen placement kind, its predicted iteration time, the best colocated plan's time for
comparison, and the search's wall time.
"""

from __future__ import annotations

import argparse
import time

from hybridflow.errors import PlacementError
from hybridflow.placement import LLAMA_PRESETS, Simulator, Workload, build_cluster, get_dataflow, search_placements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="a100-80gb")
    parser.add_argument("--algorithm", default="ppo")
    parser.add_argument("--sizes", default="7b,13b,34b,70b")
    parser.add_argument("--devices", default="16,32,64,96,128")
    args = parser.parse_args()
    dataflow = get_dataflow(args.algorithm)
    print(f"{'model':<6}{'GPUs':>5}  {'chosen':<11}{'iter s':>8}{'colocate s':>11}{'speedup':>8}{'search s':>9}  plan")
    slowest = 0.0
    for size in args.sizes.split(","):
        models = {role: LLAMA_PRESETS[size] for role in dataflow.roles}
        for devices in (int(n) for n in args.devices.split(",")):
            simulator = Simulator(cluster=build_cluster(args.profile, devices), workload=Workload())
            started = time.perf_counter()
            try:
                result = search_placements(simulator, dataflow, models, top=20)
            except PlacementError:
                print(f"{size:<6}{devices:>5}  {'infeasible':<11}{'-':>8}{'-':>11}{'-':>8}"
                      f"{time.perf_counter() - started:>9.2f}  memory floors exceed {devices} GPUs")
                continue
            wall = time.perf_counter() - started
            slowest = max(slowest, wall)
            best = result.best
            colocated = [p for p in [best, *result.runners_up] if p.kind == "colocate"]
            colocate_s = f"{colocated[0].iteration_seconds:.1f}" if colocated else "infeas."
            ratio = f"{colocated[0].iteration_seconds / best.iteration_seconds:.2f}×" if colocated else "-"
            print(f"{size:<6}{devices:>5}  {best.kind:<11}{best.iteration_seconds:>8.1f}{colocate_s:>11}{ratio:>8}"
                  f"{wall:>9.2f}  {best.describe()}")
    print(f"slowest search: {slowest:.2f} s (target < 10 s for 128 devices, four models)")


if __name__ == "__main__":
    main()
