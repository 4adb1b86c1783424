"""Benchmark of the hybrid engine's train → generate transition as the trainer runs it, against the two baselines
the HybridFlow paper compares with, all three run for real on the same training shards, for the FSDP, Megatron and
DeepSpeed ZeRO-3 actors.

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
model (hidden 256, 4 layers, 8/4 heads, tied embeddings); wall times say nothing about GPUs.

Then the Megatron (p, t, d) actors on 4 processes — (1, 2, 2) → tg 1, 2; (1, 4, 1) → tg 1, 2, 4; (2, 2, 1) → tg 1, 2,
4 — and DeepSpeed ZeRO-3 d = 4 → tg 1, 2, 4 (every parameter partitioned, and DeepSpeed's default persistence), each
after one train step, with the same figures (``hybrid_engine_engines.py``: the baselines run there through the
executor's ``full_gather`` and ``per_tensor_allgather`` plans on the engine's own source shards).

Exits 1 when hybridflow's bytes differ from the lower bound on any rank, greedy output at tg > 1 differs from tg = 1,
or its peak exceeds M/tg + one bucket in a layout not listed in ``KNOWN_MISSES`` (a listed one prints ``KNOWN MISS``
with its measured ratio and reason, and fails once it stops missing).

Run: ``OMP_NUM_THREADS=1 python bench/hybrid_engine.py`` (``--quick``: FSDP d = 2 only; ``--engines fsdp,megatron``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "deepspeed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "megatron"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "fsdp"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

import results_page
from hybrid_engine_engines import (
    BUCKET_BYTES,
    KNOWN_MISSES,
    build_rollout,
    engine_suites,
    hybridflow_phase,
    model_config,
    prompts_of,
)
from hybridflow.resharding.local_cluster import GlooCluster


def _case(rank: int, world: int, group: Any, tensor: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from hybridflow.engines import ModelSpec, TrainingEngineConfig
    from hybridflow.resharding import GenerationLayout, ModelLayout, ParallelLayout, count_storage_bytes
    from hybridflow_fsdp.layouts import build_hf_rollout_layout, build_hf_tensor_groups
    from hybridflow_fsdp.training import FSDPTrainingEngine

    spec = ModelSpec(config=model_config(), seed=1)
    engine = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
        model=spec, generation_tensor_parallel_size=tensor, extra={"handover_bucket_bytes": BUCKET_BYTES}),
        device="cpu")
    training = list(engine.model.parameters())
    shapes = {name: tuple(p.shape) for name, p in engine.model.named_parameters()}
    model_bytes = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    rollout = build_rollout(spec, tensor, build_hf_tensor_groups(data=world, tensor=tensor) if tensor > 1 else None)
    layout = GenerationLayout(tensor=tensor, training=ParallelLayout(data=world, data_sharded=True))
    target = build_hf_rollout_layout(shapes, data=world, tensor=tensor)

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
    out["replica"], out["tensor_rank"] = layout.coords(rank).data, layout.coords(rank).tensor
    rollout.sleep()
    # --- hybridflow: the trainer's path ---------------------------------------------------------------------
    out["hybridflow"] = hybridflow_phase(engine, rollout, training, tensor, prompts_of(layout, rank))
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


def _report(label: str, tensor: int, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    model = results[0]["model_bytes"]
    bucket = max(BUCKET_BYTES, *(r["bucket_cost"] for r in results))
    budget = model // tensor + bucket  # pg = 1 in every case
    lower = max(r["hybridflow"]["lower_bound"] for r in results)
    rows = []
    for scheme in ("hybridflow", "full_gather", "two_copies"):
        received = max(r[scheme]["received"] for r in results)
        peak = max(r[scheme]["peak_resident"] for r in results)
        row = {"case": f"{label} -> pg=1 tg={tensor}", "scheme": scheme, "model_bytes": model,
               "bytes_received": received, "lower_bound_bytes": lower,
               "bytes_over_lower_bound": round(received / lower, 3) if lower else None,
               "peak_resident_weight_bytes": peak, "bucket_bytes": bucket, "budget_bytes": budget,
               "peak_over_budget": round(peak / budget, 3),
               "training_resident_weight_bytes": max(r[scheme]["training_resident"] for r in results)}
        if scheme == "hybridflow":
            row["generation_seconds"] = round(max(r[scheme]["generation_seconds"] for r in results), 3)
            # while generating (after the handover), counted from storages: training shards + rollout weights
            row["generation_resident_weight_bytes"] = max(r[scheme]["generation_resident"] for r in results)
            row["exact_per_rank"] = all(r[scheme]["received"] == r[scheme]["lower_bound"] for r in results)
            row["parked_bytes_per_rank"] = [r[scheme]["parked"] for r in results]
            # what end_generation() receives to bring the parked storages back (DeepSpeed ZeRO-3 at tg > 1)
            row["restore_bytes_per_rank"] = [r[scheme]["restore"] for r in results]
        rows.append(row)
    return rows


def _check(row: dict[str, Any], failed: list[str]) -> None:
    """The targets for hybridflow: bytes = lower bound on every rank; peak <= M/tg + one bucket unless the layout is
    a known miss (printed with its ratio and reason), and a known miss that now meets the target fails too."""
    case, ratio = row["case"], row["peak_over_budget"]
    if not row["exact_per_rank"] or row["bytes_received"] != row["lower_bound_bytes"]:
        failed.append(f"{case}: bytes {row['bytes_received']} (lower bound {row['lower_bound_bytes']})")
    if case in KNOWN_MISSES:
        if ratio > 1.0:
            print(f"KNOWN MISS {case}: peak / budget {ratio}: {KNOWN_MISSES[case]}", flush=True)
        else:
            failed.append(f"{case}: listed in KNOWN_MISSES but meets the budget (peak / budget {ratio}); unlist it")
    elif ratio > 1.0:
        failed.append(f"{case}: peak / budget {ratio}")


def _merged(results: list[dict[str, Any]]) -> list[Any]:
    """The global greedy output: tensor rank 0 of every generation replica, in replica order."""
    firsts = sorted((r["replica"], r["hybridflow"]["responses"]) for r in results if r["tensor_rank"] == 0)
    return [row for _, rows in firsts for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="FSDP d = 2 only")
    parser.add_argument("--engines", default="fsdp,megatron,deepspeed", help="comma-separated engines to run")
    args = parser.parse_args(argv)
    engines = set(args.engines.split(","))
    responses: dict[str, dict[int, list[Any]]] = {}
    failed: list[str] = []

    def record(label: str, tensor: int, results: list[dict[str, Any]]) -> None:
        for row in _report(label, tensor, results):
            results_page.result(row)
            if row["scheme"] == "hybridflow":
                _check(row, failed)
        responses.setdefault(label, {})[tensor] = _merged(results)

    for world in ((2,) if args.quick else (2, 4)) if "fsdp" in engines else ():
        with GlooCluster(world, timeout=600) as cluster:
            for tensor in [tg for tg in (1, 2, 4) if world % tg == 0]:  # every tg the trainer allows at FSDP d
                record(f"fsdp d={world}", tensor, cluster.run(_case, tensor))
    suites = [s for s in engine_suites(4) if s[0].split()[0] in engines] if not args.quick else []
    for label, function, function_args, tensors in suites:
        with GlooCluster(4, timeout=900) as cluster:  # a fresh group of processes per engine layout
            by_rank = cluster.run(function, *function_args)
        for tensor in tensors:
            record(label, tensor, [result[tensor] for result in by_rank])
    for label, outputs in responses.items():
        for tensor in sorted(t for t in outputs if t > 1):
            equal = outputs[tensor] == outputs[1]
            results_page.result({"case": label, f"greedy_tg{tensor}_equals_tg1": equal})
            if not equal:
                failed.append(f"{label}: greedy tokens at tg={tensor} differ from tg=1")
    for failure in failed:  # the targets: bytes = lower bound, peak <= M/tg + one bucket, tg > 1 generates as tg = 1
        print(f"FAILED {failure}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(results_page.run(
        main, title="The hybrid engine's train -> generate handover vs full gather and two resident copies"))
