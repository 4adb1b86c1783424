"""Rollout routing replay (R3) on and off: GRPO on the tiny Qwen3-MoE of examples/grpo_arithmetic_moe.yaml (4
experts, top-2, 2 MoE layers; the hf rollout in bf16, the fsdp actor in fp32), per seed and mode, through the
trainer as a user runs it (``actor.router_replay.mode`` the only difference).

Per run it prints ``RESULT {"mode", "seed", "steps", "flip_ratio", "flip_ratio_own", "probs_diff_mean",
"probs_diff_max", "load_imbalance", "val_mean_at_end", "wall_s"}``: the step means of ``actor/router_flip_ratio``
(recorded response tokens routed differently in the update's forwards than in the rollout, any MoE layer),
``actor/router_flip_ratio_own`` (the training router's own choice against the rollout's, replayed or not),
``training/rollout_probs_diff_{mean,max}`` (|π_rollout − π_old| of the sampled tokens, π_old recomputed by the
actor), ``actor/moe/load_imbalance`` and the held-out accuracy at the last step
(``val-core/hybridflow/arithmetic/acc/mean@<val_n>``). What it simplifies: a from-scratch run of ``--steps`` steps
(the shipped example runs 60), not the SFT → GRPO main job. ``--write PATH`` writes the table (date, machine,
command) to PATH, which docs/benchmarks/moe_replay.md is.

Run: ``OMP_NUM_THREADS=1 python bench/moe_replay.py [--steps 12] [--seeds 0 1]
[--write docs/benchmarks/moe_replay.md]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_arithmetic_moe.yaml"
VAL = "val-core/hybridflow/arithmetic/acc/mean@{n}"
MODES = ("disabled", "R3")


def run(mode: str, seed: int, steps: int, val_n: int, run_dir: Path) -> dict[str, Any]:
    from hybridflow.config import load_config
    from hybridflow.trainer import Trainer

    config = load_config(EXAMPLE, [f"trainer.run_dir={run_dir}", "trainer.progress=false",
                                   "trainer.tensorboard=false", "trainer.resume=never", f"trainer.seed={seed}",
                                   f"trainer.total_steps={steps}", "trainer.checkpoint_every=0",
                                   f"trainer.val_every={steps}", f"trainer.val_n={val_n}",
                                   f"actor.router_replay.mode={mode}"])
    started = time.perf_counter()
    trainer = Trainer(config, progress=False)
    try:
        history = trainer.fit()
        validations = list(trainer.validation_history)
    finally:
        trainer.close()
    wall = time.perf_counter() - started
    rows = [row for row in history if "actor/router_flip_ratio" in row]
    validated = [row[VAL.format(n=val_n)] for row in validations if VAL.format(n=val_n) in row]

    def average(key: str) -> float:
        return mean(float(row[key]) for row in rows)

    return {"mode": mode, "seed": seed, "steps": len(rows), "flip_ratio": average("actor/router_flip_ratio"),
            "flip_ratio_own": average("actor/router_flip_ratio_own"),
            "probs_diff_mean": average("training/rollout_probs_diff_mean"),
            "probs_diff_max": max(float(row["training/rollout_probs_diff_max"]) for row in rows),
            "load_imbalance": average("actor/moe/load_imbalance"),
            "val_mean_at_end": validated[-1] if validated else float("nan"), "wall_s": wall}


def write_table(path: Path, results: list[dict[str, Any]], command: str, val_n: int) -> None:
    lines = [
        "# Rollout routing replay (R3) on a tiny Qwen3-MoE: routing flips and the rollout/actor gap",
        "",
        "Written by `bench/moe_replay.py` (do not edit by hand).",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python "
        f"{platform.python_version()}",
        f"- command: `{command}`",
        "- model and run: examples/grpo_arithmetic_moe.yaml (4 experts, top-2, 2 MoE layers; hf rollout in bf16, "
        "fsdp actor in fp32 on 2 workers), `actor.router_replay.mode` the only difference; values are step means",
        "",
        f"| mode | seed | steps | router_flip_ratio | router_flip_ratio_own | rollout_probs_diff_mean | "
        f"rollout_probs_diff_max | load_imbalance | held-out mean@{val_n} at end | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['mode']} | {r['seed']} | {r['steps']} | {r['flip_ratio']:.4f} | "
                     f"{r['flip_ratio_own']:.4f} | {r['probs_diff_mean']:.2e} | {r['probs_diff_max']:.2e} | "
                     f"{r['load_imbalance']:.3f} | {r['val_mean_at_end']:.3f} | {r['wall_s']:.0f} |")
    lines.append("")
    for mode in MODES:
        own = [r for r in results if r["mode"] == mode]
        if own:
            lines.append(f"- {mode}: router_flip_ratio {mean(r['flip_ratio'] for r in own):.4f}, "
                         f"rollout_probs_diff_mean {mean(r['probs_diff_mean'] for r in own):.2e} "
                         f"(mean over {len(own)} seeds)")
    path.write_text("\n".join(lines) + "\n")


def start_ray(attempts: int = 3) -> None:
    """One local Ray for every run (each Trainer joins it), retried: on a loaded box a start can time out."""
    import ray

    from hybridflow.controller import init_ray

    for attempt in range(attempts):
        try:
            init_ray(num_cpus=4, object_store_memory=300_000_000)
            return
        except Exception as error:  # noqa: BLE001  # Ray raises a bare Exception when its node times out
            print(f"ray start {attempt + 1}/{attempts} failed: {error}", file=sys.stderr, flush=True)
            ray.shutdown()
    raise RuntimeError(f"Ray did not start in {attempts} attempts (see above)")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--val-n", type=int, default=4)
    parser.add_argument("--write", type=Path, default=None)
    args = parser.parse_args()
    results = []
    start_ray()
    with tempfile.TemporaryDirectory(prefix="moe_replay_") as scratch:
        for seed in args.seeds:
            for mode in MODES:
                result = run(mode, seed, args.steps, args.val_n, Path(scratch) / f"{mode}_{seed}")
                print("RESULT " + json.dumps(result), flush=True)
                results.append(result)
    if args.write is not None:
        command = "OMP_NUM_THREADS=1 python " + " ".join(["bench/moe_replay.py", *sys.argv[1:]])
        write_table(args.write, results, command, args.val_n)


if __name__ == "__main__":
    main()
