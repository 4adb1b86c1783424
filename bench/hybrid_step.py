"""The hybrid engine's two-rank step without Ray or the trainer: 2 gloo ranks, each with the ``fsdp`` actor (one FSDP
unit, the default) and the ``hf`` rollout engine binding its weights at tg = 1, running the worker's sequence —
handover (``generation_weights(park=True)`` + ``update_weights(bind=True)``), generate (the e2e_grpo fixture's shape:
16 prompts × 4 samples × 16 new tokens over the ranks), sleep + ``end_generation``, update (one train step over the
rollout) — for both handovers, interleaved step by step: FSDP's own all-gather (default) and the planner's executor
(``actor.extra.handover_unshard=false``). ``--mixed-precision bf16`` runs the actor in bf16 (and generation in bf16,
as ``rollout.dtype: auto`` does), ``--world-size 1`` the same sequence on one rank. Each rank tunes malloc as a worker
does (``tune_malloc``). Per rank and phase: process CPU
seconds (``time.process_time``, robust to other load on the box), wall seconds, and the bytes every
``torch.distributed`` collective received (:class:`hybridflow.testing.collectives.CollectiveCounter`). Prints
``RESULT {json}``.

    OMP_NUM_THREADS=1 PYTHONPATH=core:plugins/fsdp python bench/hybrid_step.py --size 20m --steps 7
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import results_page

sys.path.insert(0, str(Path(__file__).resolve().parent))

PHASES = ("handover", "generate", "update")


def _rank(rank: int, world_size: int, size: str, steps: int, out: str, precision: str = "none",
          reduce_dtype: str = "auto") -> None:
    import torch

    from e2e_fixture import model_config_of
    from hybridflow.batch import Batch
    from hybridflow.controller.host import tune_malloc
    from hybridflow.engines import ModelSpec, OptimConfig, RolloutEngineConfig, SamplingParams, TrainingEngineConfig
    from hybridflow.testing.collectives import CollectiveCounter
    from hybridflow.testing.contracts.training import sequence_mean_nll
    from hybridflow_fsdp.rollout import HFRolloutEngine
    from hybridflow_fsdp.training import FSDPTrainingEngine

    torch.set_num_threads(1)
    tune_malloc()  # as every worker does at start-up
    counter = CollectiveCounter()
    spec = ModelSpec(config=model_config_of(size), seed=0)
    generation_spec = ModelSpec(config=spec.config, seed=0, dtype="bfloat16" if precision == "bf16" else "float32")
    # 16 prompts over the ranks
    ids = torch.randint(3, 40, (16 // world_size, 8), generator=torch.Generator().manual_seed(rank))
    prompts = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    sampling = SamplingParams(n=4, max_new_tokens=16, seed=1)
    engines: dict[bool, tuple[Any, Any]] = {}
    rows: dict[bool, list[dict[str, Any]]] = {}
    for unshard in (True, False):
        actor = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
            model=spec, optim=OptimConfig(lr=1e-3), micro_batch_size=32, mixed_precision=precision,  # type: ignore[arg-type]
            extra={"handover_unshard": unshard, "reduce_dtype": reduce_dtype}))
        # EOS = the vocabulary's size: an id never sampled, so every row generates all 16 tokens as the trained
        # fixture's rows do (with EOS = 1 the random model ended rows early and the update saw short sequences)
        rollout = HFRolloutEngine(config=RolloutEngineConfig(model=generation_spec, pad_token_id=0,
                                                             eos_token_id=int(spec.config["vocab_size"]),
                                                             max_prompt_length=8))
        rollout.sleep()
        engines[unshard], rows[unshard] = (actor, rollout), []
    for step in range(steps):
        for unshard in (True, False) if step % 2 == 0 else (False, True):
            actor, rollout = engines[unshard]
            counter.take()
            marks = [(time.perf_counter(), time.process_time())]
            counter.phase = "handover"
            rollout.wake()
            rollout.update_weights(actor.generation_weights(park=True), version=actor.state_version(), bind=True)
            marks.append((time.perf_counter(), time.process_time()))
            counter.phase = "generate"
            rollout_batch = rollout.generate(prompts, sampling)
            rollout.sleep()
            actor.end_generation()
            marks.append((time.perf_counter(), time.process_time()))
            counter.phase = "update"
            actor.train_step(rollout_batch, loss_fn=sequence_mean_nll)
            marks.append((time.perf_counter(), time.process_time()))
            rows[unshard].append({"response_tokens": int(rollout_batch["response_mask"].sum()),
                                  "wall": [b[0] - a[0] for a, b in itertools.pairwise(marks)],
                                  "cpu": [b[1] - a[1] for a, b in itertools.pairwise(marks)], "counts": counter.take()})
    counter.close()
    Path(f"{out}.{rank}").write_text(json.dumps({str(k): v for k, v in rows.items()}))


def main() -> None:
    from hybridflow.testing.contracts.spawn import run_rank_groups

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="20m", help="bench/e2e_grpo.py model size (77k, 2.4m, 20m)")
    parser.add_argument("--steps", type=int, default=7, help="steps of each handover; the first is left out")
    parser.add_argument("--mixed-precision", default="none", choices=("none", "bf16"),
                        help="the actor's mixed_precision; bf16 also generates in bf16 (rollout.dtype auto)")
    parser.add_argument("--reduce-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="the actor's extra.reduce_dtype (auto: bfloat16 on CPU under bf16)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (1: the one-rank step, same sequence)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="hybrid_step_"))
    load = os.getloadavg()[0]
    run_rank_groups([(_rank, args.world_size, (args.size, args.steps, str(workdir / "rank"), args.mixed_precision,
                                                args.reduce_dtype))],
                    workdir=workdir, timeout_s=1800)
    result: dict[str, Any] = {"size": args.size, "steps": args.steps, "mixed_precision": args.mixed_precision,
                              "reduce_dtype": args.reduce_dtype,
                              "world_size": args.world_size, "load_avg_1m": [load, os.getloadavg()[0]]}
    for rank in range(args.world_size):
        runs = json.loads((workdir / f"rank.{rank}").read_text())
        for unshard, rows in runs.items():
            kept = rows[1:] or rows
            key = f"rank{rank}_{'fsdp_all_gather' if unshard == 'True' else 'executor'}"
            cpu = {p: round(statistics.median(r["cpu"][i] for r in kept), 4) for i, p in enumerate(PHASES)}
            wall = {p: round(statistics.median(r["wall"][i] for r in kept), 4) for i, p in enumerate(PHASES)}
            result[key] = {"cpu_s": cpu, "cpu_s_step": round(sum(cpu.values()), 4), "wall_s": wall,
                           "response_tokens": statistics.median(r["response_tokens"] for r in kept),
                           "collectives": kept[-1]["counts"]}
    results_page.result(result)


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="The hybrid engine's two-rank step without Ray"))
