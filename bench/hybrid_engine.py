"""Benchmark of the hybrid engine's train → generate transition as the trainer runs it, against the two baselines
the HybridFlow paper compares with, all three run for real on the same FSDP shards.

For each FSDP d → generation (pg = 1, tg) case on d local CPU processes (gloo), d = 2 and 4 and every tg dividing d
(the layouts the trainer allows for an FSDP actor): the ``fsdp`` training engine (row weights sharded on dim 1 at
tg > 1, as the trainer sets it up) and the ``hf`` rollout engine at tg, then

- ``hybridflow``: the engine's default handover as the actor worker runs it (reshard planner, views of the FSDP
  shards where they coincide, every other FSDP shard parked in the generation shard containing it: ``park=True``)
  bound by the rollout engine (no copy), which sleeps after generating (drops every reference), then
  ``end_generation()`` gives the FSDP shards their storage back;
- ``full_gather`` (DeepSpeed-Chat): every rank all-gathers the whole model (``DTensor.full_tensor`` per parameter,
  all kept), cuts its generation shard and copies it into the rollout engine;
- ``two_copies`` (OpenRLHF): the rollout engine keeps its own copy resident in both phases, synchronised each
  iteration parameter by parameter (all-gather, cut, copy).

Prints one ``RESULT {json}`` line per (case, scheme): worst-rank bytes received (counted from the executor's buffers
for ``hybridflow``; the all-gathered tensors' bytes for the baselines) and lower bound, their ratio, worst-rank peak
resident weight bytes (distinct storages of training and rollout weights, plus what a scheme holds gathered) and its
ratio to M/tg + one bucket (the plan's largest: ``BUCKET_BYTES``, or one parameter's cost where that alone is
more), training-phase resident bytes, and for ``hybridflow`` the generation seconds (worst rank, same global prompt
batch: split over d/tg generation replicas). Simplified: CPU and gloo, fp32, a tiny Qwen2-shaped
model (hidden 256, 4 layers, 8/4 heads); wall times say nothing about GPUs.

Exits 1 when hybridflow's bytes differ from the lower bound, its peak exceeds M/tg + one bucket, or greedy output at
tg > 1 differs from tg = 1.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=core:plugins/fsdp python bench/hybrid_engine.py`` (``--quick``: d = 2 only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "fsdp"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from hybridflow.resharding.local_cluster import GlooCluster

BUCKET_BYTES = 1 << 20
PROMPTS = 16
NEW_TOKENS = 16


def _model_config() -> dict[str, Any]:
    from hybridflow.presets import tiny_model_config

    return tiny_model_config(hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=4,
                             vocab_size=64, max_position_embeddings=128)


def _case(rank: int, world: int, group: Any, tensor: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hybridflow.char_tokenizer import EOS_ID, PAD_ID
    from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams, TrainingEngineConfig
    from hybridflow.resharding import GenerationLayout, ModelLayout, ParallelLayout, count_storage_bytes
    from hybridflow.testing.contracts.rollout import build_prompt_batch
    from hybridflow_fsdp.layouts import build_hf_rollout_layout, build_hf_tensor_groups
    from hybridflow_fsdp.rollout import HFRolloutEngine
    from hybridflow_fsdp.training import FSDPTrainingEngine

    spec = ModelSpec(config=_model_config(), seed=1)
    engine = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(model=spec, extra={
        "generation_tensor_parallel_size": tensor, "handover_bucket_bytes": BUCKET_BYTES}), device="cpu")
    training = list(engine.model.parameters())
    shapes = {name: tuple(p.shape) for name, p in engine.model.named_parameters()}
    model_bytes = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    extra = {"tensor_groups": build_hf_tensor_groups(data=world, tensor=tensor)} if tensor > 1 else {}
    rollout = HFRolloutEngine(config=RolloutEngineConfig(model=spec, tensor_parallel_size=tensor, pad_token_id=PAD_ID,
                                                         eos_token_id=EOS_ID, max_prompt_length=16, extra=extra))
    layout = GenerationLayout(tensor=tensor, training=ParallelLayout(data=world, data_sharded=True))
    target = build_hf_rollout_layout(shapes, data=world, tensor=tensor)
    base = build_prompt_batch()
    prompts = base.repeat_interleave(-(-PROMPTS // len(base))).slice(0, PROMPTS)
    mine = prompts.chunk(layout.data)[layout.coords(rank).data]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=NEW_TOKENS, seed=0)

    def rollout_tensors() -> list[torch.Tensor]:
        return list(rollout.model.parameters())

    def full_of(parameter: torch.Tensor) -> torch.Tensor:
        return parameter.full_tensor() if isinstance(parameter, DTensor) else parameter.detach()

    def local_of(parameter: torch.Tensor) -> torch.Tensor:
        return parameter.to_local() if isinstance(parameter, DTensor) else parameter.detach()

    from hybridflow_fsdp.handover import handover_plan

    # "one bucket": the plan's largest (a parameter larger than BUCKET_BYTES gets a bucket of its own)
    out: dict[str, Any] = {"model_bytes": model_bytes, "training_only": count_storage_bytes(training),
                           "bucket_cost": handover_plan(engine, tensor=tensor).max_bucket_cost()}
    rollout.sleep()
    # --- hybridflow: the trainer's path ---------------------------------------------------------------------
    rollout.wake()
    rollout.update_weights(engine.generation_weights(tensor_parallel_size=tensor, park=True), version=1, bind=True)
    stats = engine.last_handover_stats
    assert stats is not None
    resident = count_storage_bytes(training + rollout_tensors())
    rollout.generate(mine, greedy)  # warm-up (first-call allocations)
    dist.barrier()
    started = time.perf_counter()
    generated = rollout.generate(mine, greedy)
    seconds = time.perf_counter() - started
    rollout.sleep()
    engine.end_generation()
    out["hybridflow"] = {"received": stats.bytes_received, "lower_bound": stats.lower_bound_bytes,
                         "peak_resident": resident + stats.peak_gathered_bytes, "generation_resident": resident,
                         "training_resident": count_storage_bytes(training + rollout_tensors()),
                         "generation_seconds": seconds, "responses": generated["responses"].tolist()}
    # --- full gather on every rank (DeepSpeed-Chat) ---------------------------------------------------------
    with torch.no_grad():
        full = {name: full_of(p) for name, p in engine.model.named_parameters()}
        received = sum(full[n].numel() * 4 - local_of(p).numel() * 4 for n, p in engine.model.named_parameters())
        rollout.wake()
        # this rank's generation shards as views of the gathered tensors, copied into the engine's own storage
        rollout.update_weights(((name, full[name][_box_slices(target, name, rank)]) for name in full), version=2)
        peak = count_storage_bytes(training + list(full.values()) + rollout_tensors())
        del full
    rollout.sleep()
    out["full_gather"] = {"received": received, "peak_resident": peak,
                          "training_resident": count_storage_bytes(training + rollout_tensors())}
    # --- two resident copies, synchronised parameter by parameter (OpenRLHF) --------------------------------
    rollout.wake()
    with torch.no_grad():
        received, transient = 0, 0
        copies: list[tuple[str, torch.Tensor]] = []
        for name, p in engine.model.named_parameters():
            whole = full_of(p)
            received += whole.numel() * 4 - local_of(p).numel() * 4
            transient = max(transient, whole.numel() * 4)
            one = ModelLayout(mesh=target.mesh, params={name: target.params[name]})
            copies.append((name, one.extract_shards({name: whole}, rank)[name].clone()))
        rollout.update_weights(copies, version=3)
        del copies
    resident = count_storage_bytes(training + rollout_tensors())  # never slept: resident in both phases
    out["two_copies"] = {"received": received, "peak_resident": resident + transient, "training_resident": resident}
    return out


def _box_slices(layout: Any, name: str, rank: int) -> tuple[slice, ...]:
    """Slices of the full tensor ``name`` holding ``rank``'s (single, unfused) piece of ``layout``."""
    (piece,) = layout.params[name].pieces(layout.mesh, rank)
    return tuple(slice(start, stop) for start, stop in piece.box)


def _report(world: int, tensor: int, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    model = results[0]["model_bytes"]
    bucket = max(BUCKET_BYTES, *(r["bucket_cost"] for r in results))
    budget = model // tensor + bucket
    lower = max(r["hybridflow"]["lower_bound"] for r in results)
    rows = []
    for scheme in ("hybridflow", "full_gather", "two_copies"):
        received = max(r[scheme]["received"] for r in results)
        peak = max(r[scheme]["peak_resident"] for r in results)
        row = {"case": f"fsdp d={world} -> pg=1 tg={tensor}", "scheme": scheme, "model_bytes": model,
               "bytes_received": received, "lower_bound_bytes": lower,
               "bytes_over_lower_bound": round(received / lower, 3) if lower else None,
               "peak_resident_weight_bytes": peak, "bucket_bytes": bucket, "budget_bytes": budget,
               "peak_over_budget": round(peak / budget, 3),
               "training_resident_weight_bytes": max(r[scheme]["training_resident"] for r in results)}
        if scheme == "hybridflow":
            row["generation_seconds"] = round(max(r[scheme]["generation_seconds"] for r in results), 3)
            # while generating (after the handover), counted from storages: training shards + rollout weights
            row["generation_resident_weight_bytes"] = max(r[scheme]["generation_resident"] for r in results)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="d = 2 only")
    args = parser.parse_args(argv)
    responses: dict[tuple[int, int], Any] = {}
    failed: list[str] = []
    for world in (2,) if args.quick else (2, 4):
        with GlooCluster(world, timeout=600) as cluster:
            for tensor in [tg for tg in (1, 2, 4) if world % tg == 0]:  # every tg the trainer allows at FSDP d
                results = cluster.run(_case, tensor)
                for row in _report(world, tensor, results):
                    print("RESULT " + json.dumps(row), flush=True)
                    if row["scheme"] == "hybridflow" and (row["bytes_received"] != row["lower_bound_bytes"]
                                                          or row["peak_over_budget"] > 1.0):
                        failed.append(f"{row['case']}: bytes {row['bytes_received']} (lower bound "
                                      f"{row['lower_bound_bytes']}), peak / budget {row['peak_over_budget']}")
                # tensor rank 0 of every replica, in replica order: the global greedy output
                responses[(world, tensor)] = [r["hybridflow"]["responses"] for r in results]
    for world, tensor in sorted(key for key in responses if key[1] > 1):
        one = [row for rows in responses[(world, 1)] for row in rows]
        # every rank of a tensor group returns its replica's rows; stride groups: replica = rank % (d/tg)
        merged = [row for replica in range(world // tensor) for row in responses[(world, tensor)][replica]]
        print("RESULT " + json.dumps({"case": f"fsdp d={world}", f"greedy_tg{tensor}_equals_tg1": merged == one}),
              flush=True)
        if merged != one:
            failed.append(f"fsdp d={world}: greedy tokens at tg={tensor} differ from tg=1")
    for failure in failed:  # the targets: bytes = lower bound, peak <= M/tg + one bucket, tg > 1 generates as tg = 1
        print(f"FAILED {failure}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
