"""GRPO learns at the generation layouts the 3D-HybridEngine hands over to, through the trainer: a Megatron actor at
t = 2 generating at tg = 1 and at tg = 2 (``rollout.tensor_parallel_size``), from scratch on the arithmetic example
(``examples/grpo_arithmetic_scratch.yaml``, ``model.preset=tiny-qwen2-4h``: one KV group per tensor rank at t = 2).

The CI tests run these layouts for 2 steps (``tests/e2e/test_megatron_generation_layouts.py``: exact bytes and
resident weights, greedy tg = 2 = tg = 1) and show learning for Megatron only at t = 1 and for FSDP d = 2 → tg = 2
(``tests/e2e/test_hybrid_engine_trainer.py``); this bench runs the Megatron t = 2 layouts long enough to learn.

Prints one ``RESULT {json}`` per case and exits 1 unless in each: the mean reward of the last ``--window`` steps
exceeds that of the first by ``--min-rise`` (0.02, the margin ``tests/e2e/test_megatron_grpo.py`` asks of the t = 1
run), every step made one policy update, and every iteration's handover (the ledger's ``reshard`` edge) moved bytes
equal to the lower bound on every rank.

Run: ``.venv/bin/python bench/layouts_learn.py`` (``--cases fsdp-d2-tg2`` runs the FSDP case of the CI test).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import results_page

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_arithmetic_scratch.yaml"
PRESET = "model.preset=tiny-qwen2-4h"

#: case → the overrides that make its layout
CASES: dict[str, list[str]] = {
    "megatron-t2-tg1": ["actor.engine=megatron", "actor.parallel.tensor_parallel_size=2", PRESET,
                        "rollout.tensor_parallel_size=1"],
    "megatron-t2-tg2": ["actor.engine=megatron", "actor.parallel.tensor_parallel_size=2", PRESET,
                        "rollout.tensor_parallel_size=2"],
    "fsdp-d2-tg2": [PRESET, "rollout.tensor_parallel_size=2"],
}


def run_case(name: str, run_dir: Path, steps: int, window: int, min_rise: float) -> dict[str, Any]:
    from hybridflow.config import load_config
    from hybridflow.ledger import read_ledger
    from hybridflow.trainer import Trainer
    from hybridflow.trainer.cli import fit_and_close

    overrides = [f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.tensorboard=false",
                 "trainer.resume=never", "trainer.val_every=0", "trainer.val_n=1", "data.task.num_val_prompts=0",
                 f"trainer.total_steps={steps}", "trainer.checkpoint_every=0", "trainer.seed=0", *CASES[name]]
    started = time.time()
    history = fit_and_close(Trainer(load_config(EXAMPLE, overrides), progress=False))
    seconds = time.time() - started
    rewards = [float(m["reward/mean"]) for m in history]
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    handovers = [edge for row in read_ledger(run_dir) for edge in row["edges"] if edge["protocol"] == "reshard"]
    at_bound = sum(h["bytes_per_rank"] == h["lower_bound_bytes_per_rank"] for h in handovers)
    versions = [m["actor/policy_version"] for m in history]
    checks = {"learns": last > first + min_rise,
              "one_update_per_step": versions == [float(step + 1) for step in range(steps)],
              "reshard_at_lower_bound": len(handovers) == steps and at_bound == steps}
    return {"case": name, "steps": steps, "reward_first": round(first, 4), "reward_last": round(last, 4),
            "rise": round(last - first, 4), "min_rise": min_rise,
            "handover_bytes_per_rank": handovers[-1]["bytes_per_rank"] if handovers else None,
            "lower_bound_bytes_per_rank": handovers[-1]["lower_bound_bytes_per_rank"] if handovers else None,
            "rewards": [round(r, 4) for r in rewards], "seconds": round(seconds, 1), "checks": checks,
            "ok": all(checks.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="megatron-t2-tg1,megatron-t2-tg2", help=f"comma-separated: {list(CASES)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--min-rise", type=float, default=0.02)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    names = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    if args.steps < 2 * args.window:
        parser.error(f"--steps must be at least twice --window ({args.window}), got {args.steps}")
    from hybridflow.controller import init_ray

    init_ray(num_cpus=4, object_store_memory=300_000_000)
    base = Path(args.workdir or tempfile.mkdtemp(prefix="hybridflow-layouts-"))
    results = []
    for name in names:
        results.append(run_case(name, base / name, args.steps, args.window, args.min_rise))
        results_page.result(results[-1])
    return 0 if all(result["ok"] for result in results) else 1


if __name__ == "__main__":
    raise SystemExit(results_page.run(
        main, title="GRPO learning at the generation layouts the hybrid engine hands over to"))
