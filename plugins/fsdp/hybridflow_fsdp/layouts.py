"""Per-parameter shard specs of this plugin's two engines: the FSDP training layout (each parameter chunked along its
FSDP shard dim over ``d`` ranks) and the ``hf`` rollout layout (every parameter whole on every rank at tg = 1;
Megatron-style tensor-parallel shards at tg > 1, drawn inside the FSDP mesh), as
:class:`hybridflow.resharding.ModelLayout`.

Planning and executing a reshard between them is :mod:`hybridflow.resharding`'s business.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hybridflow.resharding.builders import build_tensor_parallel_layout, classify_llama_param
from hybridflow.resharding.layout import GenerationLayout, Grouping, ParallelLayout
from hybridflow.resharding.specs import ModelLayout, ParamShardSpec

__all__ = ["build_fsdp_training_layout", "build_hf_rollout_layout", "build_hf_tensor_groups", "row_parallel_names"]


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


def build_hf_rollout_layout(named_shapes: Mapping[str, Sequence[int]], *, data: int = 1, tensor: int = 1,
                            grouping: Grouping = "stride", dtype: torch.dtype = torch.float32) -> ModelLayout:
    """The ``hf`` engine's layout over the ``data`` FSDP ranks: at ``tensor`` = tg = 1 every rank holds every
    parameter whole; at tg > 1 each rank its tensor-parallel shard (column/vocab dim 0, row dim 1, norms whole,
    :func:`~hybridflow.resharding.builders.build_tensor_parallel_layout`; micro-DP ``data / tg``, tensor groups by
    ``grouping``), what :class:`~hybridflow_fsdp.rollout.HFRolloutEngine` holds with ``tensor_parallel_size = tg``."""
    training = ParallelLayout(data=data, data_sharded=True)
    mesh = GenerationLayout(pipeline=1, tensor=tensor, training=training, grouping=grouping)
    if tensor > 1:
        return build_tensor_parallel_layout(named_shapes, mesh=mesh, dtype=dtype)
    params = {name: ParamShardSpec(name=name, shape=tuple(shape), dtype=dtype) for name, shape in named_shapes.items()}
    return ModelLayout(mesh=mesh, params=params)


def build_hf_tensor_groups(*, data: int, tensor: int, grouping: Grouping = "stride") -> list[list[int]]:
    """``RolloutEngineConfig.tensor_groups`` matching ``build_hf_rollout_layout(data=data, tensor=tensor,
    grouping=grouping)``: one list per generation replica, its ranks in tensor-rank order (``[[0, 2], [1, 3]]`` for
    the stride grouping of tg = 2 on 4 ranks)."""
    mesh = GenerationLayout(pipeline=1, tensor=tensor, training=ParallelLayout(data=data, data_sharded=True),
                            grouping=grouping)
    return [[mesh.rank(tensor=t, data=d) for t in range(tensor)] for d in range(mesh.data)]


def row_parallel_names(names: Sequence[str]) -> set[str]:
    """Parameters a tensor-parallel generation layout splits along dim 1 (o_proj, down_proj weights)."""
    return {name for name in names if classify_llama_param(name) == "row"}
