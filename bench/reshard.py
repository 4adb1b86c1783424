"""Benchmark of the 3D-HybridEngine reshard: bytes each scheme moves, measured from the collectives actually run.

Runs every case on 4 or 8 local CPU processes (gloo) with a tiny Llama-shaped model (hidden 256, 4 layers,
8/4 heads, vocab 512, fp32; the generation side uses vLLM's fused qkv_proj / gate_up_proj). Simplified: CPU and
gloo only, so only byte counts and memory are meaningful, not wall time. Prints one line per case:
``RESULT {json}`` with the worst-rank measured bytes, the worst-rank lower bound, their ratio, the peak extra memory
and each baseline's measured bytes.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=core python bench/reshard.py`` (about a minute on 2 cores; ``--quick`` skips
the 8-process cases).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

import results_page
from hybridflow.resharding import (
    STRATEGIES,
    GenerationLayout,
    ModelLayout,
    ParallelLayout,
    build_fsdp_layout,
    build_tensor_parallel_layout,
    execute_reshard,
    plan_reshard,
    tiny_llama_shapes,
)
from hybridflow.resharding.local_cluster import GlooCluster

HEADS, KV_HEADS, HIDDEN = 8, 4, 256
SHAPES = tiny_llama_shapes(hidden=HIDDEN, intermediate=512, layers=4, num_heads=HEADS, num_kv_heads=KV_HEADS,
                           vocab=512)
BUCKET_BYTES = 1 << 20


def _job(rank: int, world: int, group: Any, source: ModelLayout, target: ModelLayout, strategy: str) -> dict:
    """Reshard seeded weights on this rank; report measured bytes, lower bound and correctness."""
    generator = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=generator) for n, (s, _) in sorted(source.canonical_shapes().items())}
    plan = plan_reshard(source, target, strategy=strategy, bucket_bytes=BUCKET_BYTES)  # type: ignore[arg-type]
    out, stats = execute_reshard(plan, source.extract_shards(full, rank), rank=rank, group=group)
    reference = plan.target.extract_shards(full, rank)
    exact = set(out) == set(reference) and all(torch.equal(out[n], reference[n]) for n in reference)
    return {"received": stats.bytes_received, "lower_bound": plan.lower_bound_bytes(rank),
            "peak_extra": stats.peak_extra_bytes, "exact": exact, "max_bucket_cost": plan.max_bucket_cost()}


def _cases(max_world: int) -> list[tuple[str, ModelLayout, ModelLayout]]:
    cases = []
    for (p, t, d), generation in [((1, 4, 1), [(1, 1), (1, 2)]), ((2, 2, 1), [(1, 2), (1, 1)]),
                                  ((1, 2, 2), [(1, 1)]), ((1, 8, 1), [(1, 2), (1, 4)]), ((2, 2, 2), [(1, 2)])]:
        training = ParallelLayout(pipeline=p, tensor=t, data=d)
        if training.world_size > max_world:
            continue
        source = build_tensor_parallel_layout(SHAPES, mesh=training)
        for pg, tg in generation:
            target = build_tensor_parallel_layout(
                SHAPES, mesh=GenerationLayout(pipeline=pg, tensor=tg, training=training),
                fuse_attention=(HEADS, KV_HEADS, HIDDEN // HEADS), fuse_mlp=True)
            cases.append((f"3d p={p} t={t} d={d} -> pg={pg} tg={tg}", source, target))
    for d in (4, 8):
        if d > max_world:
            continue
        source = build_fsdp_layout(SHAPES, data=d)
        for tg in (1, 2, 4):
            target = build_tensor_parallel_layout(SHAPES, mesh=GenerationLayout(tensor=tg, training=source.mesh),
                                                  fuse_attention=(HEADS, KV_HEADS, HIDDEN // HEADS), fuse_mlp=True)
            cases.append((f"fsdp d={d} -> tg={tg}", source, target))
    return cases


def main() -> None:
    """Run every case and print its RESULT line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4-process cases only")
    args = parser.parse_args()
    worlds = (4,) if args.quick else (4, 8)
    model_bytes = sum(s.numel() * 4 for s in [torch.empty(shape) for shape in SHAPES.values()])
    for world in worlds:
        cases = [c for c in _cases(world) if c[1].world_size == world]
        if not cases:
            continue
        with GlooCluster(world, timeout=300.0) as cluster:
            for name, source, target in cases:
                measured = {s: cluster.run(_job, source, target, s) for s in STRATEGIES}
                hybrid = measured["hybridflow"]
                received = max(r["received"] for r in hybrid)
                bound = max(r["lower_bound"] for r in hybrid)
                ratio = max((r["received"] / r["lower_bound"]) if r["lower_bound"] else
                            (1.0 if r["received"] == 0 else float("inf")) for r in hybrid)
                result = {
                    "case": name,
                    "world": world,
                    "model_bytes": model_bytes,
                    "bytes_received_max": received,
                    "lower_bound_max": bound,
                    "ratio": round(ratio, 4),
                    "peak_extra_bytes": max(r["peak_extra"] for r in hybrid),
                    "bucket_bytes": BUCKET_BYTES,
                    "all_exact": all(r["exact"] for rs in measured.values() for r in rs),
                    **{f"{s}_bytes_received_max": max(r["received"] for r in measured[s])
                       for s in STRATEGIES if s != "hybridflow"},
                    **{f"{s}_peak_extra_bytes": max(r["peak_extra"] for r in measured[s])
                       for s in STRATEGIES if s != "hybridflow"},
                }
                per_tensor = result["per_tensor_allgather_bytes_received_max"]
                result["per_tensor_over_hybridflow"] = round(per_tensor / received, 2) if received else None
                results_page.result(result)


if __name__ == "__main__":
    raise SystemExit(results_page.run(
        main, title="Reshard bytes per rank vs the lower bound",
        description="Worst-rank bytes each rank receives in the handover (measured from the collectives run) against "
                    "the layouts' lower bound, and what the baselines move; model of "
                    f"{sum(s.numel() * 4 for s in [torch.empty(shape) for shape in SHAPES.values()]) / 2**20:.1f} "
                    "MiB (fp32), buckets of 1 MiB. Every received shard is checked equal to the target layout's "
                    "(`all_exact`).",
        columns=("case", "world", "bytes_received_max", "lower_bound_max", "ratio", "all_exact",
                 "full_gather_bytes_received_max", "per_tensor_allgather_bytes_received_max",
                 "per_tensor_over_hybridflow", "peak_extra_bytes")))
