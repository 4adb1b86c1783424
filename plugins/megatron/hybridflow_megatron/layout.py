"""Shard specs of the megatron engine's weights as a :class:`hybridflow.resharding.ModelLayout`, and name mapping.

The layout speaks canonical HF names with megatron's fusions (``qkv_proj`` interleaved per query group,
``gate_up_proj`` chunked per tensor rank); planning and moving bytes to a generation layout is the core's
:mod:`hybridflow.resharding` business. Needs no megatron import.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from hybridflow.errors import LayoutError
from hybridflow.resharding.builders import build_tensor_parallel_layout
from hybridflow.resharding.specs import ModelLayout

__all__ = ["build_megatron_training_layout", "layout_name_of"]

_LOCAL = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight": "self_attn.qkv_proj.weight",
    "self_attention.linear_qkv.bias": "self_attn.qkv_proj.bias",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def build_megatron_training_layout(
    named_shapes: Mapping[str, Sequence[int]], *, tensor: int = 1, pipeline: int = 1, data: int = 1,
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
) -> ModelLayout:
    """Layout ``megatron``: (p, t, d) with megatron's interleaved qkv and per-rank [gate | up] fc1.

    ``named_shapes`` are HF (unfused) names and full shapes; the vocabulary must be a multiple of ``tensor``
    (megatron pads it otherwise, and padded rows have no canonical counterpart).
    """
    vocab = named_shapes.get("model.embed_tokens.weight")
    if vocab is not None and vocab[0] % tensor:
        raise LayoutError(
            f"vocab size {vocab[0]} is not a multiple of tensor_parallel_size={tensor}; megatron pads the vocabulary "
            "then, which no canonical layout describes. Use a vocabulary that the tensor size divides."
        )
    return build_tensor_parallel_layout(
        named_shapes, tensor=tensor, pipeline=pipeline, data=data, dtype=dtype,
        fuse_attention=(num_heads, num_kv_heads, head_dim), fuse_mlp=True, interleaved=True,
    )


def layout_name_of(megatron_name: str, *, layer_offset: int, value_head: bool = False) -> str:
    """The layout (fused HF) name of a megatron GPTModel parameter on a stage whose first layer is ``layer_offset``."""
    match = _LAYER.match(megatron_name)
    if match is not None:
        local, rest = int(match.group(1)), match.group(2)
        if rest not in _LOCAL:
            raise LayoutError(f"no layout name for megatron parameter {megatron_name!r}")
        return f"model.layers.{layer_offset + local}.{_LOCAL[rest]}"
    fixed = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "score.weight" if value_head else "lm_head.weight",
        "output_layer.bias": "score.bias",
    }
    if megatron_name not in fixed:
        raise LayoutError(f"no layout name for megatron parameter {megatron_name!r}")
    return fixed[megatron_name]
