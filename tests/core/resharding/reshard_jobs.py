"""Helpers shared by the resharding tests: reference weights, the per-rank job run on the gloo cluster, and an
in-process check that a plan fills every target element exactly once."""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.resharding import ModelLayout, ReshardPlan, execute_reshard, plan_reshard
from hybridflow.resharding.specs import box_numel, intersect_boxes


def full_weights(layout: ModelLayout, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic full canonical weights of ``layout`` (distinct values, any dtype)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in sorted(layout.canonical_shapes().items()):
        out[name] = torch.randn(shape, generator=generator).to(dtype)
    return out


def reshard_job(rank: int, world: int, group: Any, source: ModelLayout, target: ModelLayout, strategy: str,
                bucket_bytes: int, seed: int) -> dict[str, Any]:
    """Reshard reference shards on this rank and compare with the reference target slices bit for bit."""
    torch.manual_seed(1234 + rank)
    full = full_weights(source, seed)
    plan = plan_reshard(source, target, strategy=strategy, bucket_bytes=bucket_bytes)  # type: ignore[arg-type]
    local = source.extract_shards(full, rank)
    out, stats = execute_reshard(plan, local, rank=rank, group=group)
    reference = plan.target.extract_shards(full, rank)
    mismatched = sorted(
        name for name in reference
        if name not in out or out[name].dtype != reference[name].dtype
        or not torch.equal(out[name].view(torch.uint8), reference[name].view(torch.uint8))
    )
    return {
        "names_equal": set(out) == set(reference),
        "mismatched": mismatched,
        "source_left": len(local),
        "stats": stats,
        "planned_received": plan.bytes_received(rank),
        "planned_sent": plan.bytes_sent(rank),
        "lower_bound": plan.lower_bound_bytes(rank),
        "max_bucket_cost": plan.max_bucket_cost(),
        "multi_param_buckets_within": all(b.cost <= bucket_bytes for b in plan.buckets if len(b.params) > 1),
    }


def check_plan_fills_exactly(plan: ReshardPlan) -> None:
    """Every staged element of every rank is written exactly once, from a rank that holds it."""
    for rank in range(plan.world_size):
        held = {}
        for pieces in plan.source.pieces(rank).values():
            for piece in pieces:
                held.setdefault(piece.canonical, []).append(piece.box)
        counts: dict[str, torch.Tensor] = {}
        for pieces in plan.staging.pieces(rank).values():
            for piece in pieces:
                shape, _ = plan.staging.canonical_shapes()[piece.canonical]
                mask = counts.setdefault(piece.canonical, torch.full(shape, -1, dtype=torch.int32))
                mask[tuple(slice(a, b) for a, b in piece.box)] = 0
        transfers = [t for b in plan.buckets for t in b.local] + [
            t for b in plan.buckets for op in b.ops for t in op.transfers]
        for t in transfers:
            if t.target_rank != rank:
                continue
            source_boxes = [box for pieces in plan.source.pieces(t.source_rank).values() for p in pieces
                            if p.canonical == t.canonical for box in [p.box]]
            assert any(intersect_boxes(box, t.box) == t.box for box in source_boxes), (t, "source lacks box")
            assert box_numel(t.box) * plan.staging.canonical_shapes()[t.canonical][1].itemsize == t.nbytes
            counts[t.canonical][tuple(slice(a, b) for a, b in t.box)] += 1
        for canonical, mask in counts.items():
            assert int((mask == 0).sum()) == 0, f"rank {rank}: parts of {canonical} never filled"
            assert int((mask > 1).sum()) == 0, f"rank {rank}: parts of {canonical} filled twice"


def reshard_twice_job(rank: int, world: int, group: Any, source: ModelLayout, target: ModelLayout,
                      bucket_bytes: int) -> dict[str, Any]:
    """One plan run twice, with views (as the FSDP handover does every step) on different weights: each run's shards
    against the reference, and how often the second run asked a spec for its pieces (the layout arithmetic a reused
    plan should not redo)."""
    from hybridflow.resharding.specs import ParamShardSpec

    plan = plan_reshard(source, target, strategy="hybridflow", bucket_bytes=bucket_bytes)
    original = ParamShardSpec.pieces
    calls = [0]

    def counted(self: ParamShardSpec, mesh: Any, rank_: int) -> Any:
        calls[0] += 1
        return original(self, mesh, rank_)

    mismatched, counts = [], []
    ParamShardSpec.pieces = counted  # type: ignore[method-assign]
    try:
        for seed in (5, 6):
            full = full_weights(source, seed)
            local = source.extract_shards(full, rank)
            calls[0] = 0
            out, _ = execute_reshard(plan, local, rank=rank, group=group, views=True)
            counts.append(calls[0])
            reference = plan.target.extract_shards(full, rank)
            mismatched.append(sorted(name for name in reference if not torch.equal(out[name], reference[name])))
    finally:
        ParamShardSpec.pieces = original  # type: ignore[method-assign]
    return {"mismatched": mismatched, "pieces_calls": counts, "lower_bound": plan.lower_bound_bytes(rank)}
