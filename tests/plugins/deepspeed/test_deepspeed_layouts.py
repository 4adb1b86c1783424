"""ZeRO-3 flat partitions as shard specs: the pieces cover each weight exactly once, a rank's packed partition is
its slice of the full weights, and the core planner moves exactly the lower bound to tg = 1 and tg = 2 generation
layouts. Pure layout math: no DeepSpeed, no processes."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.errors import LayoutError
from hybridflow.resharding import GenerationLayout, build_tensor_parallel_layout, plan_reshard, tiny_llama_shapes
from hybridflow.resharding.specs import ModelLayout, ParamShardSpec, box_numel
from hybridflow_deepspeed.layouts import build_deepspeed_training_layout, flat_partition_range, pack_partition

SHAPES = {"a.weight": (5, 7), "b.weight": (4, 4), "c.bias": (9,), "d.weight": (1, 3), "e.weight": (45, 64)}


def zero3_partition(full: torch.Tensor, parts: int, part: int) -> torch.Tensor:
    """What DeepSpeed keeps in ``param.ds_tensor``: flat, padded to a multiple of ``parts``, chunk ``part``."""
    size = -(-full.numel() // parts)
    padded = torch.zeros(size * parts, dtype=full.dtype)
    padded[: full.numel()] = full.reshape(-1)
    return padded[part * size : (part + 1) * size]


@pytest.mark.parametrize("data", [1, 2, 3, 4])
def test_pieces_cover_every_weight_once_and_pack_the_partition(data: int) -> None:
    layout = build_deepspeed_training_layout(SHAPES, data=data, zero_stage=3)
    generator = torch.Generator().manual_seed(data)
    full = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    cover = {name: torch.zeros(shape, dtype=torch.int64) for name, shape in SHAPES.items()}
    reference_shards = {rank: layout.extract_shards(full, rank) for rank in range(data)}
    for rank in range(data):
        for name, pieces in layout.pieces(rank).items():
            for piece in pieces:
                cover[name][tuple(slice(a, b) for a, b in piece.box)] += 1
            packed = pack_partition(zero3_partition(full[name], data, rank), layout.params[name], layout.mesh, rank)
            local = reference_shards[rank][name]
            for piece in pieces:  # only the valid boxes are defined (the rest of the buffer is never read)
                assert torch.equal(packed[piece.local_slices(piece.box)], local[piece.local_slices(piece.box)])
        held = sum(box_numel(p.box) for ps in layout.pieces(rank).values() for p in ps)
        assert held == sum(len(range(*flat_partition_range(math.prod(s), data, rank))) for s in SHAPES.values())
    for name, count in cover.items():
        assert bool((count == 1).all()), f"{name} covered {count.tolist()}"


@pytest.mark.parametrize("data, tensor", [(2, 1), (2, 2), (4, 2), (3, 1)])
def test_planner_moves_the_lower_bound_to_generation_layouts(data: int, tensor: int) -> None:
    # vocab 46: tensor parallelism splits the embedding rows evenly (the char fixture's 45 would not)
    shapes = tiny_llama_shapes(hidden=64, intermediate=128, layers=2, num_heads=2, num_kv_heads=1, vocab=46)
    source = build_deepspeed_training_layout(shapes, data=data, zero_stage=3)
    mesh = GenerationLayout(tensor=tensor, pipeline=1, training=source.mesh)
    if tensor == 1:
        target = ModelLayout(mesh=mesh, params={n: ParamShardSpec(name=n, shape=s) for n, s in shapes.items()})
    else:
        target = build_tensor_parallel_layout(shapes, mesh=mesh)
    plan = plan_reshard(source, target, strategy="hybridflow")
    total = sum(math.prod(shape) * 4 for shape in shapes.values())
    for rank in range(data):
        assert plan.bytes_received(rank) == plan.lower_bound_bytes(rank) > 0
        if tensor == 1:  # everything but the rank's own partition
            assert plan.lower_bound_bytes(rank) == total - source.shard_bytes(rank)
    baseline = plan_reshard(source, target, strategy="full_gather")
    assert sum(map(plan.bytes_received, range(data))) <= sum(map(baseline.bytes_received, range(data)))


def test_zero_stage_1_and_2_hold_full_weights_so_nothing_moves() -> None:
    shapes = tiny_llama_shapes(vocab=45)
    for stage in (1, 2):
        source = build_deepspeed_training_layout(shapes, data=2, zero_stage=stage)
        target = ModelLayout(mesh=GenerationLayout(training=source.mesh),
                             params={n: ParamShardSpec(name=n, shape=s) for n, s in shapes.items()})
        plan = plan_reshard(source, target)
        assert [plan.bytes_received(rank) for rank in (0, 1)] == [plan.lower_bound_bytes(rank) for rank in (0, 1)]
        assert plan.lower_bound_bytes(0) == 0


def test_bad_stage_and_3d_weights_are_refused() -> None:
    with pytest.raises(LayoutError, match="zero_stage must be 1, 2 or 3"):
        build_deepspeed_training_layout(SHAPES, data=2, zero_stage=0)
    with pytest.raises(LayoutError, match="1-D or 2-D"):
        build_deepspeed_training_layout({"conv.weight": (2, 3, 4)}, data=2, zero_stage=3)
