"""Per-parameter shard specs of this plugin's two engines: the FSDP training layout (dim 0 over ``d`` ranks) and the
``hf`` rollout layout (every parameter whole on every rank, tg = 1), as :class:`hybridflow.resharding.ModelLayout`.

Planning and executing a reshard between them is :mod:`hybridflow.resharding`'s business.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hybridflow.resharding.builders import build_fsdp_layout
from hybridflow.resharding.layout import GenerationLayout, ParallelLayout
from hybridflow.resharding.specs import ModelLayout, ParamShardSpec

__all__ = ["build_fsdp_training_layout", "build_hf_rollout_layout"]


def build_fsdp_training_layout(named_shapes: Mapping[str, Sequence[int]], *, data: int,
                               dtype: torch.dtype = torch.float32) -> ModelLayout:
    """FSDP2 layout: each parameter's dim 0 chunked over ``data`` ranks (ceil chunks, as ``fully_shard`` does)."""
    return build_fsdp_layout(named_shapes, data=data, dtype=dtype)


def build_hf_rollout_layout(named_shapes: Mapping[str, Sequence[int]], *, data: int = 1,
                            dtype: torch.dtype = torch.float32) -> ModelLayout:
    """The ``hf`` engine's layout: tg = pg = 1, so every one of the ``data`` ranks holds every parameter whole."""
    training = ParallelLayout(data=data, data_sharded=True)
    mesh = GenerationLayout(pipeline=1, tensor=1, training=training)
    params = {name: ParamShardSpec(name=name, shape=tuple(shape), dtype=dtype) for name, shape in named_shapes.items()}
    return ModelLayout(mesh=mesh, params=params)
