"""Mesh math: coordinates, stride vs consecutive grouping, micro-DP groups, validation."""

from __future__ import annotations

import itertools

import pytest

from hybridflow.errors import LayoutError
from hybridflow.resharding import GenerationLayout, ParallelLayout


def test_training_coords_round_trip_and_order() -> None:
    layout = ParallelLayout(pipeline=2, tensor=2, data=2)
    assert layout.world_size == 8
    seen = set()
    for rank in range(8):
        c = layout.coords(rank)
        assert layout.rank(pipeline=c.pipeline, tensor=c.tensor, data=c.data) == rank
        seen.add((c.pipeline, c.tensor, c.data))
    assert len(seen) == 8
    assert layout.coords(1).tensor == 1 and layout.coords(2).pipeline == 1 and layout.coords(4).data == 1
    assert layout.group(5, "tensor") == (4, 5)
    assert layout.group(5, "data") == (1, 5)
    assert layout.groups("pipeline") == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_design_example_stride_grouping_t4_tg2() -> None:
    generation = GenerationLayout(tensor=2, training=ParallelLayout(tensor=4))
    assert generation.tensor_groups() == ((0, 2), (1, 3))
    assert generation.micro_data_groups() == ((0, 1), (2, 3))
    assert generation.micro_data_size == 2
    assert [generation.coords(r).tensor for r in range(4)] == [0, 0, 1, 1]


def test_consecutive_grouping_is_the_vanilla_variant() -> None:
    generation = GenerationLayout(tensor=2, training=ParallelLayout(tensor=4), grouping="consecutive")
    assert generation.tensor_groups() == ((0, 1), (2, 3))
    assert generation.micro_data_groups() == ((0, 2), (1, 3))


def test_pipeline_training_keeps_tensor_index() -> None:
    training = ParallelLayout(pipeline=2, tensor=2)
    generation = GenerationLayout(tensor=2, training=training)
    for rank in range(4):
        assert generation.coords(rank).tensor == training.coords(rank).tensor
    assert generation.micro_data_groups() == ((0, 2), (1, 3))


def test_fsdp_training_groups_span_the_data_axis() -> None:
    generation = GenerationLayout(tensor=2, training=ParallelLayout(data=4, data_sharded=True))
    assert generation.tensor_groups() == ((0, 2), (1, 3))
    assert generation.data == 2


@pytest.mark.parametrize("p,t,d", [(1, 4, 1), (2, 2, 2), (1, 2, 2), (2, 4, 1)])
def test_generation_coords_are_a_bijection(p: int, t: int, d: int) -> None:
    training = ParallelLayout(pipeline=p, tensor=t, data=d)
    for pg, tg in itertools.product([1, 2, 4], repeat=2):
        if (p * t) % (pg * tg):
            continue
        for grouping in ("stride", "consecutive"):
            generation = GenerationLayout(pipeline=pg, tensor=tg, training=training, grouping=grouping)
            coords = [generation.coords(r) for r in range(training.world_size)]
            keys = {(c.pipeline, c.tensor, c.data) for c in coords}
            assert len(keys) == training.world_size
            for rank, c in enumerate(coords):
                assert generation.rank(pipeline=c.pipeline, tensor=c.tensor, data=c.data) == rank
            assert all(len(g) == tg for g in generation.tensor_groups())
            assert all(len(g) == generation.micro_data_size for g in generation.micro_data_groups())


def test_validation_messages() -> None:
    with pytest.raises(LayoutError, match="must divide"):
        GenerationLayout(tensor=3, training=ParallelLayout(tensor=4))
    with pytest.raises(LayoutError, match="positive int"):
        ParallelLayout(tensor=0)
    with pytest.raises(LayoutError, match="grouping"):
        GenerationLayout(tensor=1, grouping="random")  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="rank must be"):
        ParallelLayout(tensor=2).coords(2)
    with pytest.raises(LayoutError, match="unknown mesh axis"):
        ParallelLayout(tensor=2).group(0, "expert")  # type: ignore[arg-type]
