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


def _flat(plan: ReshardPlan, full: dict[str, torch.Tensor], extra: int = 4) -> tuple[torch.Tensor, dict]:
    """Rank 0's source shards of ``full`` as views of one flat buffer, with ``extra`` more elements at its end."""
    sources = plan.source.extract_shards(full, 0)
    flat = torch.zeros(sum(t.numel() for t in sources.values()) + extra)
    shards, offset = {}, 0
    for name, tensor in sources.items():
        shards[name] = flat[offset:offset + tensor.numel()].view(tensor.shape)
        shards[name].copy_(tensor)
        offset += tensor.numel()
    return flat, shards


def _full() -> dict[str, torch.Tensor]:
    return {name: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 100 * i
            for i, (name, shape) in enumerate(SHAPES.items())}


def test_fetch_parks_without_aside_and_leaves_the_cells_for_the_caller() -> None:
    plan, full = _plan(), _full()
    flat, shards = _flat(plan, full)
    before, buffer_bytes = flat.clone(), flat.untyped_storage().nbytes()
    targets = plan.target.extract_shards(full, 0)
    parking = StorageParking(plan, 0, shards, aside="fetch")
    for name in shards:
        parking.on_release(name, targets)
    assert parking.finish(targets) == buffer_bytes and parking.aside_bytes == 0
    assert count_storage_bytes(shards.values()) == 0  # nothing of the buffer kept: the generation shards alone
    assert parking.fetch_cells == {ROW: ((slice(0, 4), slice(3, 6)),)}
    assert parking.restore() == buffer_bytes
    assert not torch.equal(flat, before) and shards[ROW][:, 3:].abs().sum() == 0  # the fetched cells: zero
    shards[ROW][:, 3:] = before[:24].view(4, 6)[:, 3:]  # what the caller fetches (ROW's shard leads the buffer)
    assert torch.equal(flat, before)


def test_a_copy_outside_the_plan_parks_with_its_storage_only_when_it_equals_its_home() -> None:
    plan, full = _plan(), _full()
    copy_pieces = plan.source.params[COLUMN].pieces(plan.source.mesh, 0)  # a second holder of COLUMN's rows
    for differ in (False, True):
        flat, shards = _flat(plan, full, extra=4 + 4 * 6)  # the copy lives at the buffer's end
        copy = flat[-24:].view(4, 6)
        copy.copy_(shards[COLUMN])
        if differ:
            copy[0, 0] += 1
        before, buffer_bytes = flat.clone(), flat.untyped_storage().nbytes()
        targets = plan.target.extract_shards(full, 0)
        parking = StorageParking(plan, 0, shards, aside=True, copies={"tied": (copy, copy_pieces)})
        for name in shards:
            parking.on_release(name, targets)
        if differ:  # its storage stays whole: the generation shards do not hold this copy's bytes
            assert parking.finish(targets) == 0 and parking.unparked_copies == ["tied"]
            assert torch.equal(flat, before) and parking.aside_bytes == 0
            continue
        assert parking.finish(targets) == buffer_bytes and parking.unparked_copies == []
        assert parking.restore() == buffer_bytes and torch.equal(flat, before)
