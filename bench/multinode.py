"""GRPO learning on a two-node Ray cluster: the loopback cluster of ``tests/e2e/test_multinode.py`` (``ray start
--head`` and ``ray start --address``, token authentication on; :mod:`hybridflow.testing.ray_cluster`), joined by
``hybridflow train`` with ``ray.address`` and ``resource_pools.main.devices_per_node=[1,1]`` (one rank per node;
``--per-node 2``: ``[2,2]``), long enough for the reward to rise; by default then the same run with all ranks on one
node of that cluster (``devices_per_node=[2]``, or ``[4]``) as reference.

Prints ``RESULT {json}`` per run and a final ``RESULT`` with the checks, and exits 1 if one fails:
- ``learns``: the mean reward of the last ``--window`` steps exceeds that of the first by ``--min-rise`` (0.04, the
  margin ``tests/e2e/test_train.py::test_grpo_reward_rises`` asks of the one-node run of the same 40 steps);
- ``ranks_on_distinct_nodes``: the manifest's placement (each worker's own Ray node id) puts the ranks of each
  ``devices_per_node`` entry on one node and the two entries on the cluster's two nodes, the run joined the cluster
  (``local_ray`` false, the head's GCS address) and the rendezvous is rank 0's node address as registered with Ray;
- ``reshard_at_lower_bound``: every iteration's weight handover (the ledger's ``reshard`` edge) moved bytes, counted
  from the buffers sent and received, equal to the lower bound on every rank;
- ``same_as_one_node`` (with the reference): the reward of every step equals the one-node run's.

Run: ``.venv/bin/python bench/multinode.py`` (about 4 minutes on an idle 2-core box; ``--no-reference`` halves it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import results_page
from hybridflow.testing.ray_cluster import BIN, LoopbackCluster, start_head

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_arithmetic_scratch.yaml"


def train(cluster: LoopbackCluster, run_dir: Path, devices_per_node: str, steps: int, timeout_s: float) -> float:
    """``hybridflow train`` of the example joining ``cluster`` (the command docs/guide/operations.md §9 gives);
    seconds."""
    command = [str(BIN / "hybridflow"), "train", str(EXAMPLE), f"ray.address={cluster.address}",
               f"resource_pools.main.devices_per_node={devices_per_node}", f"trainer.run_dir={run_dir}",
               f"trainer.total_steps={steps}", "trainer.checkpoint_every=0", "trainer.val_every=0",
               "trainer.tensorboard=false", "trainer.resume=never", "--no-progress"]
    started = time.time()
    result = subprocess.run(command, env=cluster.driver_env(), capture_output=True, text=True, cwd=ROOT,
                            timeout=timeout_s, check=False)
    output = result.stdout + result.stderr
    if result.returncode != 0 or f"done: {steps} steps" not in output:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}:\n{output[-5000:]}")
    return time.time() - started


def summarize(run_dir: Path, window: int) -> dict[str, Any]:
    """Reward windows, placement and handover bytes of one run, read from its run directory."""
    from hybridflow.ledger import read_ledger
    from hybridflow.trainer.progress import read_metrics

    rewards = [float(m["reward/mean"]) for m in read_metrics(run_dir)]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    placement = manifest["placement"]["main"]
    handovers = [edge for row in read_ledger(run_dir) for edge in row["edges"] if edge["protocol"] == "reshard"]
    return {
        "rewards": rewards,
        "reward_first": sum(rewards[:window]) / window, "reward_last": sum(rewards[-window:]) / window,
        "ranks": [{"rank": p["rank"], "node_index": p["node_index"], "node_id": p["node_id"]}
                  for p in placement["ranks"]],
        "local_ray": placement["local_ray"], "rendezvous": placement["rendezvous"],
        "gcs_address": (manifest["ray"] or {}).get("gcs_address"),
        "handovers": len(handovers),
        "handover_bytes_per_rank": handovers[-1]["bytes_per_rank"] if handovers else None,
        "handovers_at_lower_bound": sum(h["bytes_per_rank"] == h["lower_bound_bytes_per_rank"] for h in handovers),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=10, help="steps averaged at the start and at the end")
    parser.add_argument("--min-rise", type=float, default=0.04)
    parser.add_argument("--per-node", type=int, default=1, help="ranks per node (2 CPUs each, 0.5 per rank)")
    parser.add_argument("--no-reference", action="store_true", help="skip the one-node reference run")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per training run")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    if args.steps < 2 * args.window:
        parser.error(f"--steps must be at least twice --window ({args.window}), got {args.steps}")
    base = Path(args.workdir or tempfile.mkdtemp(prefix="hybridflow-multinode-"))
    started = time.time()
    cluster = start_head(num_cpus=2, resources={"node_a": 1})
    try:
        node_b = cluster.add_node(num_cpus=2, resources={"node_b": 1})
        nodes = {cluster.head.node_id: cluster.head.address, node_b.node_id: node_b.address}
        print(f"# two-node cluster at {cluster.address} up in {time.time() - started:.0f}s: {sorted(nodes)}",
              flush=True)
        runs: dict[str, dict[str, Any]] = {}
        layouts = {"two_nodes": f"[{args.per_node},{args.per_node}]", "one_node": f"[{2 * args.per_node}]"}
        if args.no_reference:
            del layouts["one_node"]
        for name, layout in layouts.items():
            seconds = train(cluster, base / name, layout, args.steps, args.timeout_s)
            runs[name] = {"run": name, "devices_per_node": layout, "seconds": round(seconds, 1),
                          **summarize(base / name, args.window)}
            results_page.result(runs[name])
    finally:
        cluster.stop()
    two = runs["two_nodes"]
    rank_nodes = [p["node_id"] for p in sorted(two["ranks"], key=lambda p: p["rank"])]
    entry_nodes = [{p["node_id"] for p in two["ranks"] if p["node_index"] == index} for index in (0, 1)]
    checks: dict[str, bool] = {
        "learns": two["reward_last"] > two["reward_first"] + args.min_rise,
        "ranks_on_distinct_nodes": (all(len(ids) == 1 for ids in entry_nodes) and entry_nodes[0] | entry_nodes[1]
                                    == set(nodes) and len(rank_nodes) == 2 * args.per_node
                                    and two["local_ray"] is False and two["gcs_address"] == cluster.address
                                    and two["rendezvous"].rsplit(":", 1)[0] == nodes[rank_nodes[0]]),
        "reshard_at_lower_bound": two["handovers"] == args.steps and two["handovers_at_lower_bound"] == args.steps,
    }
    if "one_node" in runs:
        checks["same_as_one_node"] = two["rewards"] == runs["one_node"]["rewards"]
    results_page.result({
        "bench": "multinode", "devices_per_node": layouts["two_nodes"], "steps": args.steps, "window": args.window,
        "reward_first": round(two["reward_first"], 4), "reward_last": round(two["reward_last"], 4),
        "rise": round(two["reward_last"] - two["reward_first"], 4), "min_rise": args.min_rise,
        "checks": checks, "ok": all(checks.values()), "seconds": round(time.time() - started, 1)})
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(results_page.run(main, title="GRPO learning on a two-node Ray cluster vs one node"))
