"""LoRA weight sync: adapter-only (the default with ``actor.lora`` on fsdp + hf) vs the merged model every sync.

GRPO from scratch on examples/grpo_arithmetic_scratch.yaml (2 FSDP ranks, colocated hf rollout, fp32) with rank-8
adapters on every linear layer, at the model sizes of bench/e2e_fixture.py's :data:`SIZES` given by ``--sizes``, once
per ``actor.extra.lora_sync`` mode (``adapters``, ``merged``); the two runs differ in nothing else. Per size and mode
it prints ``RESULT {"size", "parameters", "mode", "steps", "adapter_bytes", "first_sync_bytes_per_rank",
"later_sync_bytes_per_rank", "later_over_adapter", "first_sync_s", "later_sync_s", "wall_s"}``: the bytes each rank
received in a handover, read from the run's ledger (the ``actor.training_engine → actor.rollout_engine`` edge per
step, what the worker counts from the training engine's handover stats): the first step's and the mean of the later
steps', over
``adapter_bytes`` (every LoRA factor, from ``actor/trainable_weight_bytes`` summed over ranks); and the handover's
wall seconds (the actor worker's counters, mean of ranks): the first sync's, and the mean of the later ones'.
What it simplifies: few steps, tiny models, a 2-core CPU box; bytes are exact, seconds are noisy.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/lora_sync.py [--sizes 77k 2.4m] [--steps 6]`` (writes
docs/benchmarks/lora_sync.md; ``--no-write`` prints only).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

import results_page
from e2e_fixture import SIZES

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_arithmetic_scratch.yaml"
MODES = ("adapters", "merged")
EDGE = "actor.rollout_engine"


def run(size: str, mode: str, steps: int, scratch: Path) -> dict[str, Any]:
    from hybridflow.config import load_config
    from hybridflow.ledger import read_ledger
    from hybridflow.presets import save_tiny_model
    from hybridflow.trainer import Trainer

    model_dir = scratch / f"model_{size}"
    if not model_dir.exists():
        save_tiny_model(model_dir, **SIZES[size]["model"])
    run_dir = scratch / f"{size}_{mode}"
    config = load_config(EXAMPLE, [f"trainer.run_dir={run_dir}", "trainer.progress=false",
                                   "trainer.tensorboard=false", "trainer.resume=never", "trainer.val_every=0",
                                   "trainer.val_n=1", "data.task.num_val_prompts=0", f"trainer.total_steps={steps}",
                                   "trainer.checkpoint_every=0", "model.preset=null", f"model.path={model_dir}",
                                   "actor.lora.rank=8", f"actor.extra.lora_sync={mode}", "trainer.seed=0"])
    started = time.perf_counter()
    trainer = Trainer(config, progress=False)
    try:
        history = trainer.fit()
        handover = trainer.groups.role("actor").handover_stats()  # one_to_all, blocking: a list per rank
    finally:
        trainer.close()
    wall = time.perf_counter() - started
    edges = [next(e for e in row["edges"] if e["target"] == EDGE)["bytes_per_rank"] for row in read_ledger(run_dir)]
    ranks = len(edges[0])  # actor/trainable_weight_bytes is one rank's FSDP shard of the factors
    adapter_bytes = int(history[-1]["actor/trainable_weight_bytes"]) * ranks
    later = mean(b for per_rank in edges[1:] for b in per_rank)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return {"size": size, "parameters": sum(p.numel() for p in model.parameters()), "mode": mode, "steps": steps,
            "adapter_bytes": adapter_bytes, "first_sync_bytes_per_rank": max(edges[0]),
            "later_sync_bytes_per_rank": round(later), "later_over_adapter": round(later / adapter_bytes, 3),
            "first_sync_s": round(mean(h["seconds_first"] for h in handover), 4),
            "later_sync_s": round(mean((h["seconds"] - h["seconds_first"]) / (h["count"] - 1) for h in handover), 4),
            "wall_s": round(wall, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["77k", "2.4m"], choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit(f"--steps must be >= 2 (the first sync and at least one later one); got {args.steps}")
    from hybridflow.controller import init_ray

    init_ray(num_cpus=4, object_store_memory=300_000_000)
    with tempfile.TemporaryDirectory(prefix="lora_sync_") as scratch:
        for size in args.sizes:
            for mode in MODES:
                results_page.result(run(size, mode, args.steps, Path(scratch)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(results_page.run(main, title="LoRA weight sync: adapter-only vs merged",
                                      description=(__doc__ or "").split("\n\n")[1]))
