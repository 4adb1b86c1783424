"""Per-parameter shard specs of this plugin's engines: the FSDP training layout (each parameter chunked along its
FSDP shard dim over ``d`` ranks), the ``hf`` rollout layout at tg = 1 (every parameter whole on every rank) and the
tensor-parallel generation layout (pg = 1, tg) drawn inside the FSDP mesh by stride grouping, as
:class:`hybridflow.resharding.ModelLayout`.

Planning and executing a reshard between them is :mod:`hybridflow.resharding`'s business.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hybridflow.resharding.builders import build_tensor_parallel_layout, classify_llama_param
from hybridflow.resharding.layout import GenerationLayout, ParallelLayout
from hybridflow.resharding.specs import ModelLayout, ParamShardSpec

__all__ = ["build_fsdp_training_layout", "build_hf_rollout_layout", "build_hf_generation_layout",
           "row_parallel_names"]


def build_fsdp_training_layout(named_shapes: Mapping[str, Sequence[int]], *, data: int,
                               dtype: torch.dtype = torch.float32,
                               shard_dims: Mapping[str, int] | None = None) -> ModelLayout:
    """FSDP2 layout: each parameter chunked over ``data`` ranks along its shard dim (``shard_dims[name]``, default
    0; ceil chunks, as ``fully_shard`` does)."""
    mesh = ParallelLayout(data=data, data_sharded=True)
    dims = dict(shard_dims or {})
    params = {
        name: ParamShardSpec(name=name, shape=tuple(shape), dtype=dtype, splits=((dims.get(name, 0), "data"),))
        for name, shape in named_shapes.items()
    }
    return ModelLayout(mesh=mesh, params=params)


def build_hf_rollout_layout(named_shapes: Mapping[str, Sequence[int]], *, data: int = 1,
                            dtype: torch.dtype = torch.float32) -> ModelLayout:
    """The ``hf`` engine's layout at tg = pg = 1: every one of the ``data`` ranks holds every parameter whole."""
    training = ParallelLayout(data=data, data_sharded=True)
    mesh = GenerationLayout(pipeline=1, tensor=1, training=training)
    params = {name: ParamShardSpec(name=name, shape=tuple(shape), dtype=dtype) for name, shape in named_shapes.items()}
    return ModelLayout(mesh=mesh, params=params)


def build_hf_generation_layout(named_shapes: Mapping[str, Sequence[int]], *, data: int, tensor: int,
                               dtype: torch.dtype = torch.float32) -> ModelLayout:
    """The generation layout (pg = 1, tg = ``tensor``) inside FSDP over ``data`` ranks, stride grouping (micro-DP
    size ``data / tensor``): column/vocab weights split dim 0, row weights dim 1, norms replicated, tensor rank
    ``i`` holding chunk ``i`` (:func:`hybridflow.resharding.build_tensor_parallel_layout`)."""
    mesh = GenerationLayout(tensor=tensor, training=ParallelLayout(data=data, data_sharded=True))
    return build_tensor_parallel_layout(named_shapes, mesh=mesh, dtype=dtype)


def row_parallel_names(names: Sequence[str]) -> set[str]:
    """Parameters a tensor-parallel generation layout splits along dim 1 (o_proj, down_proj weights)."""
    return {name for name in names if classify_llama_param(name) == "row"}
