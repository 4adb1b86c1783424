"""Builders of :class:`ModelLayout` for the common cases: FSDP dim-0 shards, Megatron-style tensor/pipeline
parallelism of Llama/Qwen2-shaped parameter names, and vLLM's fused ``qkv_proj``/``gate_up_proj`` target.

Builders only name shards; an engine with another layout writes its own :class:`ParamShardSpec` mapping.
Stability: public.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from hybridflow.errors import LayoutError
from hybridflow.resharding.layout import GenerationLayout, MeshAxis, ParallelLayout
from hybridflow.resharding.specs import FusedLayout, Mesh, ModelLayout, ParamShardSpec

__all__ = ["ParamKind", "PARAM_KINDS", "classify_llama_param", "build_fsdp_layout", "build_tensor_parallel_layout",
           "named_shapes_of", "tiny_llama_shapes"]

ParamKind = Literal["column", "row", "vocab", "replicated"]
PARAM_KINDS: tuple[ParamKind, ...] = ("column", "row", "vocab", "replicated")
_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj", "lm_head"}
_ROW = {"o_proj", "down_proj"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def named_shapes_of(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Shapes of a state dict, for the builders."""
    return {name: tuple(tensor.shape) for name, tensor in state_dict.items()}


def tiny_llama_shapes(*, hidden: int = 64, intermediate: int = 128, layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, vocab: int = 96, bias: bool = False) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of a tiny Llama (``bias=True``: Qwen2-style qkv biases)."""
    head_dim = hidden // num_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        for module, rows in (("q_proj", num_heads * head_dim), ("k_proj", num_kv_heads * head_dim),
                             ("v_proj", num_kv_heads * head_dim)):
            shapes[prefix + f"self_attn.{module}.weight"] = (rows, hidden)
            if bias:
                shapes[prefix + f"self_attn.{module}.bias"] = (rows,)
        shapes[prefix + "self_attn.o_proj.weight"] = (hidden, num_heads * head_dim)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        shapes[prefix + "mlp.gate_proj.weight"] = (intermediate, hidden)
        shapes[prefix + "mlp.up_proj.weight"] = (intermediate, hidden)
        shapes[prefix + "mlp.down_proj.weight"] = (hidden, intermediate)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def classify_llama_param(name: str) -> ParamKind:
    """Tensor-parallel kind of a Llama/Qwen2-style parameter name.

    Raises:
        LayoutError: the name is not a known Llama/Qwen2 parameter; pass ``kinds={name: ...}`` to the builder.
    """
    parts = name.split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else (parts[-1], "")
    if "norm" in module:
        return "replicated"
    if module == "embed_tokens":
        return "vocab"
    if module in _COLUMN:
        return "column"
    if module in _ROW:
        return "row" if leaf == "weight" else "replicated"
    raise LayoutError(
        f"cannot tell how to split parameter {name!r}: known modules are {sorted(_COLUMN | _ROW)}, embed_tokens and "
        f"*norm. Pass kinds={{{name!r}: one of {PARAM_KINDS}}}."
    )


def build_fsdp_layout(named_shapes: Mapping[str, Sequence[int]], *, data: int,
                      dtype: torch.dtype = torch.float32) -> ModelLayout:
    """FSDP2 layout: every parameter split along dim 0 over ``data`` ranks (ceil chunks, unpadded local shards)."""
    mesh = ParallelLayout(data=data, data_sharded=True)
    params = {
        name: ParamShardSpec(name=name, shape=tuple(shape), dtype=dtype, splits=((0, "data"),))
        for name, shape in named_shapes.items()
    }
    return ModelLayout(mesh=mesh, params=params)


def _stage_of(name: str, num_layers: int, stages: int) -> int | None:
    if stages == 1:
        return None
    match = _LAYER.search(name)
    if match is not None:
        return int(match.group(1)) * stages // num_layers
    if "lm_head" in name or name.split(".")[-2:-1] == ["norm"]:
        return stages - 1
    return 0


def _fuse(named_shapes: Mapping[str, tuple[int, ...]], attention: tuple[int, int, int] | None, mlp: bool,
          interleaved: bool) -> dict[str, tuple[tuple[int, ...], FusedLayout | None]]:
    out: dict[str, tuple[tuple[int, ...], FusedLayout | None]] = {}
    for name, shape in named_shapes.items():
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if attention is not None and module in ("q_proj", "k_proj", "v_proj"):
            if module != "q_proj":
                continue
            fused_name = ".".join([*parts[:-2], "qkv_proj", parts[-1]])
            k_shape = named_shapes[".".join([*parts[:-2], "k_proj", parts[-1]])]
            rows = shape[0] + 2 * k_shape[0]
            out[fused_name] = ((rows, *shape[1:]), FusedLayout.qkv(*attention, interleaved=interleaved))
        elif mlp and module in ("gate_proj", "up_proj"):
            if module != "gate_proj":
                continue
            fused_name = ".".join([*parts[:-2], "gate_up_proj", parts[-1]])
            out[fused_name] = ((2 * shape[0], *shape[1:]), FusedLayout.gate_up(shape[0]))
        else:
            out[name] = (shape, None)
    return out


def build_tensor_parallel_layout(
    named_shapes: Mapping[str, Sequence[int]],
    *,
    tensor: int = 1,
    pipeline: int = 1,
    data: int = 1,
    mesh: Mesh | None = None,
    kinds: Mapping[str, ParamKind] | None = None,
    dtype: torch.dtype = torch.float32,
    fuse_attention: tuple[int, int, int] | None = None,
    fuse_mlp: bool = False,
    interleaved: bool = False,
) -> ModelLayout:
    """Megatron/vLLM-style layout of a Llama/Qwen2-shaped model.

    Column-parallel weights (q/k/v/gate/up, lm_head) and the vocab-parallel embedding split dim 0 along the tensor
    axis, row-parallel weights (o_proj, down_proj) split dim 1, norms and row-parallel biases are replicated, and
    layers are assigned to pipeline stages evenly (embedding on the first stage, final norm and lm_head on the last).

    Args:
        named_shapes: canonical (unfused, Hugging Face) names and full shapes.
        mesh: the mesh to lay out over, e.g. a :class:`GenerationLayout`; default ``ParallelLayout(p, t, d)``.
        kinds: overrides of :func:`classify_llama_param` by name (canonical or fused).
        fuse_attention: ``(num_heads, num_kv_heads, head_dim)`` to fuse q/k/v into ``qkv_proj`` (vLLM style, or
            Megatron's per-group order with ``interleaved=True``).
        fuse_mlp: fuse gate/up into ``gate_up_proj``.
    """
    if mesh is None:
        mesh = ParallelLayout(pipeline=pipeline, tensor=tensor, data=data)
    elif (tensor, pipeline, data) != (1, 1, 1):
        raise LayoutError(
            "pass either mesh=... or tensor/pipeline/data sizes to build_tensor_parallel_layout, not both."
        )
    shapes = {name: tuple(shape) for name, shape in named_shapes.items()}
    layers = [int(m.group(1)) for name in shapes if (m := _LAYER.search(name)) is not None]
    num_layers = max(layers) + 1 if layers else 1
    stages = mesh.pipeline if isinstance(mesh, (ParallelLayout, GenerationLayout)) else 1
    kinds = dict(kinds or {})
    params: dict[str, ParamShardSpec] = {}
    for name, (shape, fused) in _fuse(shapes, fuse_attention, fuse_mlp, interleaved).items():
        kind = kinds.get(name) or classify_llama_param(name)
        if kind not in PARAM_KINDS:
            raise LayoutError(f"unknown kind {kind!r} for {name!r}; known: {PARAM_KINDS}.")
        splits: tuple[tuple[int, MeshAxis], ...] = ()
        if kind in ("column", "vocab"):
            splits = ((0, "tensor"),)
        elif kind == "row":
            splits = ((1, "tensor"),)
        params[name] = ParamShardSpec(
            name=name, shape=shape, dtype=dtype, splits=splits, fused=fused,
            pipeline_stage=_stage_of(name, num_layers, stages),
        )
    return ModelLayout(mesh=mesh, params=params)
