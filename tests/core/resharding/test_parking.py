"""``StorageParking`` on one rank, no engine: training shards living in one flat buffer (as Megatron's DDP param
buffer), fused and interleaved qkv, handed over with views to unfused full generation weights; the buffer is released
once they hold every byte of it (the views into it made copies first), and restored bit for bit."""

from __future__ import annotations

import torch

from hybridflow.resharding import (
    GenerationLayout,
    ParallelLayout,
    StorageParking,
    build_tensor_parallel_layout,
    count_storage_bytes,
    execute_reshard,
    parking_homes,
    plan_reshard,
)

SHAPES = {"model.layers.0.self_attn.q_proj.weight": (8, 4), "model.layers.0.self_attn.k_proj.weight": (4, 4),
          "model.layers.0.self_attn.v_proj.weight": (4, 4), "model.layers.0.input_layernorm.weight": (4,)}


def _plan():  # type: ignore[no-untyped-def]
    source = build_tensor_parallel_layout(SHAPES, fuse_attention=(4, 2, 2), interleaved=True)
    target = build_tensor_parallel_layout(SHAPES, mesh=GenerationLayout(tensor=1, training=ParallelLayout()))
    return plan_reshard(source, target, strategy="hybridflow", bucket_bytes=64)


def _flat_shards(plan):  # type: ignore[no-untyped-def]
    """The source shards as views of one flat buffer (plus 8 elements of padding), filled with distinct values."""
    shapes = {name: spec.local_shape(plan.source.mesh, 0) for name, spec in plan.source.params.items()}
    flat = torch.zeros(sum(torch.Size(s).numel() for s in shapes.values()) + 8)
    shards, offset = {}, 0
    for name, shape in shapes.items():
        numel = torch.Size(shape).numel()
        shards[name] = flat[offset:offset + numel].view(shape)
        shards[name].copy_(torch.arange(offset, offset + numel, dtype=torch.float32).view(shape))
        offset += numel
    return flat, shards


def test_parking_homes_cover_every_piece_of_a_fused_shard() -> None:
    homes = parking_homes(_plan(), 0)
    qkv = homes["model.layers.0.self_attn.qkv_proj.weight"]
    assert {home.target for home in qkv} == {"model.layers.0.self_attn.q_proj.weight",
                                             "model.layers.0.self_attn.k_proj.weight",
                                             "model.layers.0.self_attn.v_proj.weight"}
    assert len(qkv) == 6  # 2 interleaved groups × (q, k, v)


def test_flat_buffer_parks_whole_and_restores_bit_for_bit() -> None:
    plan = _plan()
    flat, shards = _flat_shards(plan)
    before, buffer_bytes = flat.clone(), flat.untyped_storage().nbytes()
    expected = plan.target.extract_shards({name: torch.cat([
        shards["model.layers.0.self_attn.qkv_proj.weight"][rows] for rows in spec_rows(name)])
        if "proj" in name else shards[name] for name in SHAPES}, 0)
    parking = StorageParking(plan, 0, shards)
    targets, stats = execute_reshard(plan, dict(shards), rank=0, views=True, on_release=parking.on_release)
    assert stats.aliased_bytes == 16  # the norm was a view of the buffer ...
    assert parking.finish(targets) == buffer_bytes  # ... made a copy, so the whole buffer could go
    assert flat.untyped_storage().nbytes() == 0 and count_storage_bytes(shards.values()) == 0
    assert count_storage_bytes([*shards.values(), *targets.values()]) == sum(t.nbytes for t in targets.values())
    assert all(torch.equal(targets[name], expected[name]) for name in SHAPES)
    assert parking.restore() == buffer_bytes and torch.equal(flat, before)
    assert parking.restore() == 0


def test_storage_shared_with_a_tensor_outside_the_handover_never_parks() -> None:
    plan = _plan()
    flat, shards = _flat_shards(plan)
    parking = StorageParking(plan, 0, shards, others=[flat[-8:]])
    targets, _ = execute_reshard(plan, dict(shards), rank=0, views=True, on_release=parking.on_release)
    assert parking.finish(targets) == 0 and flat.untyped_storage().nbytes() > 0


def spec_rows(name: str) -> list[slice]:
    """Rows of the interleaved qkv (2 groups of [q 4, k 2, v 2]) that make canonical ``name``."""
    start, size = {"q_proj": (0, 4), "k_proj": (4, 2), "v_proj": (6, 2)}[name.split(".")[-2]]
    return [slice(group * 8 + start, group * 8 + start + size) for group in range(2)]
