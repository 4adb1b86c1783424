"""The target layout of the ``vllm`` rollout engine: per tensor-parallel rank, which slice of each Hugging Face
tensor vLLM holds, with q/k/v fused into ``qkv_proj`` and gate/up into ``gate_up_proj``.

Only names and shapes: the reshard planner in :mod:`hybridflow.resharding` plans the moves. vLLM pads the
vocabulary of ``embed_tokens``/``lm_head`` to a multiple of 64 per rank inside its own weight loader; the layout
describes the unpadded canonical rows. Stability: public.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridflow.errors import ConfigError, LayoutError
from hybridflow.resharding import ModelLayout, build_tensor_parallel_layout
from hybridflow.resharding.specs import Mesh

__all__ = ["build_vllm_layout", "check_vocabulary_split", "tensor_parallel_shard_shapes"]

#: Hugging Face name endings vLLM splits on dim 0 (column-parallel, vocabulary-parallel) and dim 1 (row-parallel)
_COLUMN = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
           "gate_proj.weight", "up_proj.weight", "embed_tokens.weight", "lm_head.weight")
_ROW = ("o_proj.weight", "down_proj.weight")


def build_vllm_layout(
    named_shapes: Mapping[str, Sequence[int]],
    *,
    model_config: Mapping[str, Any],
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    mesh: Mesh | None = None,
    dtype: torch.dtype = torch.float32,
) -> ModelLayout:
    """vLLM's layout of a Llama/Qwen2-shaped model over ``tensor_parallel_size`` × ``pipeline_parallel_size`` ranks.

    Args:
        named_shapes: Hugging Face (unfused) names and full shapes, e.g. ``named_shapes_of(state_dict)``.
        model_config: the HF config dict (``num_attention_heads``, ``num_key_value_heads``, ``hidden_size``,
            optional ``head_dim`` and ``tie_word_embeddings``).
        mesh: a :class:`hybridflow.resharding.GenerationLayout` instead of the two sizes.

    Raises:
        LayoutError: the config lacks the head counts, or the tensor-parallel size does not divide the kv heads
            (vLLM would replicate kv heads then; that layout is not described here).
    """
    try:
        num_heads = int(model_config["num_attention_heads"])
        num_kv_heads = int(model_config.get("num_key_value_heads") or num_heads)
        head_dim = int(model_config.get("head_dim") or int(model_config["hidden_size"]) // num_heads)
    except KeyError as exc:
        raise LayoutError(
            f"model_config needs num_attention_heads and hidden_size (or head_dim); missing {exc}. Pass the model's "
            "HF config dict."
        ) from exc
    tensor = mesh.tensor if mesh is not None else tensor_parallel_size
    if num_kv_heads % tensor:
        raise LayoutError(
            f"tensor-parallel size {tensor} must divide num_key_value_heads {num_kv_heads} for this layout; got a "
            "remainder. Choose a tensor_parallel_size that divides the kv heads."
        )
    shapes = dict(named_shapes)
    if model_config.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)  # vLLM shares embed_tokens; there is no separate lm_head to fill
    return build_tensor_parallel_layout(
        shapes, mesh=mesh, dtype=dtype, fuse_attention=(num_heads, num_kv_heads, head_dim), fuse_mlp=True,
        tensor=tensor_parallel_size if mesh is None else 1, pipeline=pipeline_parallel_size if mesh is None else 1,
    )


def tensor_parallel_shard_shapes(named_shapes: Mapping[str, Sequence[int]], tensor: int) -> dict[str, tuple[int, ...]]:
    """The shape of one tensor rank's shard of each Hugging Face tensor at ``tensor`` ranks, as vLLM's Llama/Qwen2
    layers hold it before fusing (column-parallel and vocabulary rows split on dim 0, row-parallel on dim 1, the
    rest whole): what ``generation_weights(target="hf", tensor_parallel_size=tensor)`` yields per rank.

    Raises:
        LayoutError: ``tensor`` does not divide a split dimension.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in named_shapes.items():
        dims = list(shape)
        dim = 0 if name.endswith(_COLUMN) else 1 if name.endswith(_ROW) else None
        if dim is not None:
            if dims[dim] % tensor:
                raise LayoutError(f"{name} has {dims[dim]} entries on dim {dim}, not divisible by the tensor-parallel "
                                  f"size {tensor}; choose a tensor_parallel_size that divides it")
            dims[dim] //= tensor
        shapes[name] = tuple(dims)
    return shapes


def check_vocabulary_split(weight_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """vLLM pads the vocabulary to a multiple of 64 before splitting it over the tensor ranks; the generation
    layout splits the unpadded rows evenly. The two agree when the vocabulary is a multiple of 64."""
    from vllm.model_executor.layers.vocab_parallel_embedding import DEFAULT_VOCAB_PADDING_SIZE

    vocab = weight_shapes.get("model.embed_tokens.weight", (0,))[0]
    if vocab % DEFAULT_VOCAB_PADDING_SIZE:
        raise ConfigError(
            f"tensor-parallel generation with vllm loads each rank's vocabulary shard as is: vLLM pads the "
            f"vocabulary to a multiple of {DEFAULT_VOCAB_PADDING_SIZE} and gives rank r rows [r * padded / tp, "
            f"...), the generation layout rows [r * vocab / tp, ...); they agree for a vocabulary that is a "
            f"multiple of {DEFAULT_VOCAB_PADDING_SIZE}, got vocab_size {vocab}. Fix: pad the model's vocab_size "
            f"to a multiple of {DEFAULT_VOCAB_PADDING_SIZE}, or set rollout.tensor_parallel_size=1")
