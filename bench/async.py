"""Asynchronous RL on a split rollout pool against the synchronous loops: prompt+response tokens/s and reward per
wall-second of GRPO (examples/grpo_arithmetic_scratch.yaml, shortened) for

- ``colocated``: the synchronous hybrid engine, actor training and generating on one pool of ``--colocated-workers``;
- ``split-k0/k1/k2``: the actor on one pool of 1 worker, generation on a rollout pool of 1 worker
  (``rollout.pool``), ``trainer.max_staleness`` = 0, 1, 2.

Timing covers the training steps (Σ ``time/step_s``, the first step excluded as warm-up: it also pays the first
weight sync); worker start-up is not counted. ``reward_per_wall_s`` = Σ over the timed steps of ``reward/mean`` /
their seconds (reward collected per second); ``reward_last`` the mean reward of the last quarter of the steps.
Prints ``RESULT {json}`` per (setting, seed). Simplified: one tiny random-init model, CPU workers, a few steps; on a
shared box the numbers move with the load, so compare settings of one invocation.

Run: ``OMP_NUM_THREADS=1 python bench/async.py [--steps 12] [--seeds 0 1] [--settings colocated split-k0 ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import yaml

from hybridflow.config import load_config
from hybridflow.controller import init_ray
from hybridflow.trainer import Trainer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_arithmetic_scratch.yaml"
SETTINGS = ("colocated", "split-k0", "split-k1", "split-k2")


def setting_overrides(setting: str, *, colocated_workers: int, cpus_per_worker: float) -> list[str]:
    if setting == "colocated":
        pools = {"main": {"devices_per_node": [colocated_workers], "device": "cpu",
                          "cpus_per_worker": cpus_per_worker}}
        return [f"resource_pools={yaml.safe_dump(pools, default_flow_style=True).strip()}"]
    staleness = int(setting.removeprefix("split-k"))
    pools = {name: {"devices_per_node": [1], "device": "cpu", "cpus_per_worker": cpus_per_worker}
             for name in ("main", "gen")}
    return [f"resource_pools={yaml.safe_dump(pools, default_flow_style=True).strip()}", "rollout.pool=gen",
            f"trainer.max_staleness={staleness}"]


def run_setting(setting: str, seed: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    overrides = [
        f"trainer.run_dir={root / f'{setting}-{seed}'}", f"trainer.seed={seed}", f"trainer.total_steps={args.steps}",
        "trainer.checkpoint_every=0", "trainer.val_every=0", "trainer.val_n=1", "data.task.num_val_prompts=0",
        "trainer.progress=false", "trainer.tensorboard=false", "trainer.resume=never", "trainer.log_rollouts=0",
        f"data.batch_size={args.batch_size}", f"rollout.max_new_tokens={args.max_new_tokens}",
        *setting_overrides(setting, colocated_workers=args.colocated_workers, cpus_per_worker=args.cpus_per_worker),
    ]
    trainer = Trainer(load_config(EXAMPLE, overrides), progress=False)
    started = time.perf_counter()
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    total_s = time.perf_counter() - started
    timed = history[1:] or history
    seconds = sum(row["time/step_s"] for row in timed)
    tokens = sum(row["tokens/prompt_and_response"] for row in timed)
    last = history[-max(1, len(history) // 4):]
    result = {
        "setting": setting, "seed": seed, "steps": len(history), "timed_steps": len(timed),
        "step_s": seconds / len(timed), "tokens_per_s": tokens / seconds,
        "reward_per_wall_s": sum(row["reward/mean"] for row in timed) / seconds,
        "reward_mean": sum(row["reward/mean"] for row in history) / len(history),
        "reward_last": sum(row["reward/mean"] for row in last) / len(last),
        "run_s_with_startup": total_s,
    }
    if setting.startswith("split"):
        result.update({
            "staleness_mean": sum(row["async/staleness_mean"] for row in history) / len(history),
            "staleness_max": max(row["async/staleness_max"] for row in history),
            "dropped_stale_samples": history[-1]["async/dropped_stale_samples_total"],
            "weight_sync_s_per_step": sum(row["async/weight_sync_s"] for row in timed) / len(timed),
        })
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--colocated-workers", type=int, default=2, help="workers of the colocated pool (split: 1+1)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    args = parser.parse_args()
    init_ray(num_cpus=4, object_store_memory=300_000_000)
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as directory:
        for seed in args.seeds:
            for setting in args.settings:
                result = run_setting(setting, seed, args, Path(directory))
                results.setdefault(setting, []).append(result)
                print("RESULT " + json.dumps(result), flush=True)
    base = results.get("split-k0")
    if base:
        base_tokens = sum(r["tokens_per_s"] for r in base) / len(base)
        for setting, rows in results.items():
            tokens = sum(r["tokens_per_s"] for r in rows) / len(rows)
            print("RESULT " + json.dumps({"setting": setting, "summary": True, "tokens_per_s": tokens,
                                          "speedup_vs_split_k0": tokens / base_tokens,
                                          "reward_mean": sum(r["reward_mean"] for r in rows) / len(rows)}))


if __name__ == "__main__":
    main()
