"""``StorageParking(aside=True)`` on rank 0 of a 2-rank plan, no engine and no process group: training shards split
by rows (as ZeRO-3's flat partitions or FSDP's dim-0 shards) living in one flat buffer, generation at tg = 2, where a
row-parallel weight's generation shard is a column half. The buffer is released although that weight's rows lie only
half in this rank's shards: the other half is kept aside (and counted), and everything comes back bit for bit."""

from __future__ import annotations

import torch

from hybridflow.resharding import (
    GenerationLayout,
    ParallelLayout,
    ReshardPlan,
    StorageParking,
    build_fsdp_layout,
    build_tensor_parallel_layout,
    count_storage_bytes,
    parking_cells,
    parking_homes,
    plan_reshard,
)

ROW, COLUMN, NORM = ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.q_proj.weight",
                     "model.layers.0.input_layernorm.weight")
SHAPES = {ROW: (8, 6), COLUMN: (8, 6), NORM: (6,)}


def _plan() -> ReshardPlan:
    source = build_fsdp_layout(SHAPES, data=2)
    mesh = GenerationLayout(tensor=2, training=ParallelLayout(data=2, data_sharded=True))
    target = build_tensor_parallel_layout(SHAPES, mesh=mesh)
    return plan_reshard(source, target, strategy="hybridflow")


def test_cells_split_a_row_shard_along_the_generation_columns() -> None:
    cells = parking_cells(_plan(), 0)
    homes, aside = cells[ROW]
    # rows 0..4 held; generation columns 0..3 here, columns 3..6 on the other tensor rank
    assert [(h.source_slices, h.target_slices) for h in homes] == [((slice(0, 4), slice(0, 3)),
                                                                    (slice(0, 4), slice(0, 3)))]
    assert aside == ((slice(0, 4), slice(3, 6)),)
    assert cells[COLUMN][1] == () and cells[NORM][1] == ()
    assert set(parking_homes(_plan(), 0)) == {COLUMN, NORM}  # whole homes only


def test_flat_buffer_parks_with_the_rest_aside_and_restores_bit_for_bit() -> None:
    plan = _plan()
    full = {name: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 100 * i
            for i, (name, shape) in enumerate(SHAPES.items())}
    sources = plan.source.extract_shards(full, 0)
    flat = torch.zeros(sum(t.numel() for t in sources.values()) + 4)  # 4 elements of padding
    shards, offset = {}, 0
    for name, tensor in sources.items():
        shards[name] = flat[offset:offset + tensor.numel()].view(tensor.shape)
        shards[name].copy_(tensor)
        offset += tensor.numel()
    before, buffer_bytes = flat.clone(), flat.untyped_storage().nbytes()
    targets = plan.target.extract_shards(full, 0)  # what the executor would have produced on rank 0

    for aside_ok in (False, True):
        parking = StorageParking(plan, 0, shards, aside=aside_ok)
        for name in shards:
            parking.on_release(name, targets)
        if not aside_ok:  # without aside the buffer cannot go: one of its shards has bytes outside the targets
            assert parking.finish(dict(targets)) == 0 and torch.equal(flat, before)
    assert parking.finish(targets) == buffer_bytes and flat.untyped_storage().nbytes() == 0
    aside = 4 * 3 * 4  # rows 0..4 × columns 3..6 of the row-parallel weight, fp32
    assert parking.aside_bytes == aside and count_storage_bytes(shards.values()) == aside
    assert parking.restore() == buffer_bytes and torch.equal(flat, before)
    assert parking.aside_bytes == 0 and count_storage_bytes(shards.values()) == buffer_bytes
    assert not any(hasattr(t, "parked_aside") for t in shards.values())
