"""SGLang's parameter layout for the reshard planner: Llama/Qwen2 weights with fused ``qkv_proj`` and
``gate_up_proj`` split per tensor-parallel rank, as sglang's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``
hold them.

It only names shards (via :func:`hybridflow.resharding.builders.build_tensor_parallel_layout`); moving bytes is the
reshard executor's job. Known gaps: sglang pads vocab-parallel rows (embedding, lm_head) to a multiple of 64 per
rank (even at tp 1) and replicates KV heads when ``num_kv_heads < tp_size``; neither is expressible here, so such
models raise :class:`~hybridflow.errors.LayoutError` and use the full-weights path (``update_weights``).
Stability: public.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridflow.errors import LayoutError
from hybridflow.resharding.builders import build_tensor_parallel_layout
from hybridflow.resharding.layout import GenerationLayout, ParallelLayout
from hybridflow.resharding.specs import ModelLayout

__all__ = ["SGLANG_VOCAB_PADDING", "build_sglang_layout"]

#: sglang's ``DEFAULT_VOCAB_PADDING_SIZE``: vocab-parallel rows per rank are padded to a multiple of this
SGLANG_VOCAB_PADDING = 64


def build_sglang_layout(
    named_shapes: Mapping[str, Sequence[int]],
    *,
    model_config: Mapping[str, Any],
    tensor_parallel_size: int = 1,
    training: ParallelLayout | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> ModelLayout:
    """The generation layout sglang wants at ``tp_size = tensor_parallel_size``.

    Args:
        named_shapes: Hugging Face names and full shapes (e.g. ``named_shapes_of(model.state_dict())``).
        model_config: the HF config dict (``num_attention_heads``, ``num_key_value_heads``, ``hidden_size``,
            optional ``head_dim``, ``vocab_size``).
        training: the training mesh, to draw the generation groups at a stride inside it (HybridFlow grouping).
    """
    try:
        heads = int(model_config["num_attention_heads"])
        kv_heads = int(model_config.get("num_key_value_heads") or heads)
        head_dim = int(model_config.get("head_dim") or int(model_config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(
            f"sglang layout needs num_attention_heads and hidden_size (or head_dim) in model_config; got keys "
            f"{sorted(model_config)}."
        ) from exc
    tp = tensor_parallel_size
    if heads % tp or kv_heads % tp:
        raise LayoutError(
            f"sglang splits attention heads over tp_size={tp}: expected it to divide num_attention_heads={heads} and "
            f"num_key_value_heads={kv_heads} (sglang replicates KV heads otherwise, which this layout cannot express). "
            "Pick a tp_size that divides both, or use the full-weights handover (update_weights)."
        )
    vocab = model_config.get("vocab_size")
    if vocab is not None and (int(vocab) % SGLANG_VOCAB_PADDING or int(vocab) % tp):
        raise LayoutError(
            f"sglang pads vocab-parallel rows (embedding, lm_head) to a multiple of {SGLANG_VOCAB_PADDING}: "
            f"vocab_size={vocab} with tp_size={tp} gives padded shards, but this layout expects an even split "
            f"(vocab_size a multiple of {SGLANG_VOCAB_PADDING} and of tp_size). Use the full-weights handover "
            "(update_weights) for this model."
        )
    mesh = GenerationLayout(tensor=tp, training=training)
    return build_tensor_parallel_layout(
        named_shapes, mesh=mesh, dtype=dtype, fuse_attention=(heads, kv_heads, head_dim), fuse_mlp=True,
    )
