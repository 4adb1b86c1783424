"""HF Llama/Qwen2/Qwen3 weights ↔ megatron-core GPTModel shards (fused qkv per query group, fused gate/up, padded
vocab; Qwen3's per-head q/k RMSNorms as megatron's ``q_layernorm``/``k_layernorm``, replicated).

Pure tensor reshuffling with no process group: callers pick the shard position (tensor rank, pipeline layers) and
move tensors between ranks themselves (:mod:`hybridflow_megatron.gather`).

Megatron layouts (local layer spec), for ``G`` query groups (= HF ``num_key_value_heads``), ``n`` query heads per
group and head size ``d``:

- ``linear_qkv`` rows are grouped per query group: ``[q(g, n·d) | k(g, d) | v(g, d)]`` for g = 0..G−1; tensor rank
  r of t holds groups ``r·G/t .. (r+1)·G/t−1`` — a contiguous dim-0 slice of that interleaved tensor (same for
  the Qwen2 qkv bias).
- ``linear_fc1`` on tensor rank r is ``[gate_r | up_r]`` where ``gate_r``/``up_r`` are the r-th dim-0 chunks of
  HF ``gate_proj``/``up_proj`` (so the concatenation over ranks is *not* ``[gate | up]`` when t > 1).
- ``linear_proj`` and ``linear_fc2`` are row-parallel (dim-1 chunks); the embedding and output layer are
  vocab-parallel (dim-0 chunks of the vocabulary padded to a multiple of ``vocab_multiple · t``; padded rows are 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.errors import ConfigError, LayoutError

__all__ = [
    "CONVERTED_FAMILIES",
    "QK_NORM_FAMILIES",
    "ArchInfo",
    "ShardPosition",
    "read_arch_info",
    "megatron_shard_from_hf",
    "hf_from_megatron_shards",
    "hf_layer_names",
    "tensor_parallel_dim",
]

#: the HF ``model_type`` values converted (dense SwiGLU decoders); mixture-of-experts families are refused
CONVERTED_FAMILIES = ("llama", "qwen2", "qwen3")
#: those with a per-head RMSNorm on queries and keys before RoPE (megatron's ``qk_layernorm``)
QK_NORM_FAMILIES = ("qwen3",)
#: HF ↔ megatron names of the q/k norms, within a layer
_QK_NORMS = {"self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
             "self_attn.k_norm.weight": "self_attention.k_layernorm.weight"}

#: megatron parameter-name suffix → the tensor dim split over tensor ranks (others are replicated)
_TENSOR_PARALLEL_DIMS = {
    "embedding.word_embeddings.weight": 0,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
    "output_layer.weight": 0,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ArchInfo:
    """The shape facts conversion needs, read from an HF config."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3: q_layernorm / k_layernorm over each head
    value_head: bool = False  # critic: a [1, hidden] head with bias instead of the LM head

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardPosition:
    """Which shard of the model one megatron rank holds."""

    tp_rank: int = 0
    tp_size: int = 1
    layer_offset: int = 0
    num_local_layers: int
    pre_process: bool = True
    post_process: bool = True


def read_arch_info(hf_config: Any, *, tp_size: int, vocab_multiple: int = 8, value_head: bool = False) -> ArchInfo:
    """:class:`ArchInfo` of a Llama/Qwen2/Qwen3 ``transformers`` config for tensor parallel size ``tp_size``.

    Raises:
        ConfigError: another model family (naming it and the engines that run it instead), or sizes ``tp_size``
            does not divide.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in CONVERTED_FAMILIES:
        moe = any(getattr(hf_config, key, None) for key in ("num_experts", "num_local_experts"))
        raise ConfigError(
            f"the megatron engine converts the model families {', '.join(CONVERTED_FAMILIES)}; got model_type="
            f"{model_type!r}" + (" (a mixture-of-experts model: its MoE layers are not converted)" if moe else "")
            + ". Fix: train it with actor.engine=fsdp or deepspeed (they run transformers' own modules), or use a "
            "model of a converted family")
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    hidden = int(hf_config.hidden_size)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    if kv_heads % tp_size or heads % tp_size:
        raise ConfigError(
            f"tensor_parallel_size={tp_size} must divide the attention heads ({heads}) and key/value heads "
            f"({kv_heads}); pick a tensor parallel size that divides {kv_heads}"
        )
    if int(hf_config.intermediate_size) % tp_size:
        raise ConfigError(f"tensor_parallel_size={tp_size} must divide intermediate_size={hf_config.intermediate_size}")
    vocab = int(hf_config.vocab_size)
    step = vocab_multiple * tp_size
    qkv_bias = model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    return ArchInfo(
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=hidden,
        intermediate_size=int(hf_config.intermediate_size),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        padded_vocab_size=-(-vocab // step) * step,
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head,
        qkv_bias=qkv_bias,
        qk_norm=model_type in QK_NORM_FAMILIES,
        value_head=value_head,
    )


def tensor_parallel_dim(name: str, *, value_head: bool = False) -> int | None:
    """The dim of megatron parameter ``name`` split over tensor ranks, or None when it is replicated."""
    if value_head and name.startswith("output_layer."):
        return None
    for suffix, dim in _TENSOR_PARALLEL_DIMS.items():
        if name.endswith(suffix):
            return dim
    return None


def _pad_vocab(weight: torch.Tensor, arch: ArchInfo) -> torch.Tensor:
    padded = weight.new_zeros((arch.padded_vocab_size, weight.shape[1]))
    padded[: weight.shape[0]] = weight
    return padded


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ArchInfo) -> torch.Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) → megatron's per-group interleaved qkv, full (t = 1)."""
    groups, per_group, dim = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    tail = q.shape[1:]
    q = q.reshape(groups, per_group * dim, *tail)
    k = k.reshape(groups, dim, *tail)
    v = v.reshape(groups, dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(groups * (per_group + 2) * dim, *tail)


def _split_qkv(fused: torch.Tensor, arch: ArchInfo) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, per_group, dim = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    tail = fused.shape[1:]
    grouped = fused.reshape(groups, (per_group + 2) * dim, *tail)
    q, k, v = torch.split(grouped, [per_group * dim, dim, dim], dim=1)
    return (
        q.reshape(groups * per_group * dim, *tail),
        k.reshape(groups * dim, *tail),
        v.reshape(groups * dim, *tail),
    )


def hf_layer_names(layer: int, arch: ArchInfo) -> list[str]:
    """HF parameter names of decoder layer ``layer``."""
    prefix = f"model.layers.{layer}."
    names = [
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    if arch.qkv_bias:
        names += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if arch.qk_norm:
        names += list(_QK_NORMS)
    return [prefix + name for name in names]


def _chunk(tensor: torch.Tensor, position: ShardPosition, dim: int) -> torch.Tensor:
    return torch.chunk(tensor, position.tp_size, dim=dim)[position.tp_rank].contiguous()


def _get(hf: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf:
        raise LayoutError(f"HF state dict lacks {name!r}; expected a Llama/Qwen2/Qwen3 checkpoint (has {len(hf)} "
                          "tensors)")
    return hf[name]


def megatron_shard_from_hf(
    hf: Mapping[str, torch.Tensor], *, arch: ArchInfo, position: ShardPosition
) -> dict[str, torch.Tensor]:
    """The local megatron state dict (GPTModel parameter names) of the rank at ``position``."""
    out: dict[str, torch.Tensor] = {}
    if position.pre_process:
        out["embedding.word_embeddings.weight"] = _chunk(_pad_vocab(_get(hf, "model.embed_tokens.weight"), arch),
                                                         position, 0)
    for local in range(position.num_local_layers):
        layer = position.layer_offset + local
        src = f"model.layers.{layer}."
        dst = f"decoder.layers.{local}."
        q, k, v = (_get(hf, f"{src}self_attn.{p}_proj.weight") for p in "qkv")
        fused = _fuse_qkv(q, k, v, arch)
        out[dst + "input_layernorm.weight"] = _get(hf, src + "input_layernorm.weight").clone()
        out[dst + "self_attention.linear_qkv.weight"] = _chunk(fused, position, 0)
        if arch.qkv_bias:
            qb, kb, vb = (_get(hf, f"{src}self_attn.{p}_proj.bias") for p in "qkv")
            out[dst + "self_attention.linear_qkv.bias"] = _chunk(_fuse_qkv(qb, kb, vb, arch), position, 0)
        out[dst + "self_attention.linear_proj.weight"] = _chunk(_get(hf, src + "self_attn.o_proj.weight"), position, 1)
        if arch.qk_norm:
            for hf_name, megatron_name in _QK_NORMS.items():
                out[dst + megatron_name] = _get(hf, src + hf_name).clone()
        out[dst + "pre_mlp_layernorm.weight"] = _get(hf, src + "post_attention_layernorm.weight").clone()
        gate = _chunk(_get(hf, src + "mlp.gate_proj.weight"), position, 0)
        up = _chunk(_get(hf, src + "mlp.up_proj.weight"), position, 0)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[dst + "mlp.linear_fc2.weight"] = _chunk(_get(hf, src + "mlp.down_proj.weight"), position, 1)
    if position.post_process:
        out["decoder.final_layernorm.weight"] = _get(hf, "model.norm.weight").clone()
        if arch.value_head:
            out["output_layer.weight"] = _get(hf, "score.weight").clone()
            if "score.bias" in hf:
                out["output_layer.bias"] = hf["score.bias"].clone()
        elif arch.tied_embeddings:
            if not position.pre_process:  # the last stage keeps its own copy of the tied embedding
                out["output_layer.weight"] = _chunk(_pad_vocab(_get(hf, "model.embed_tokens.weight"), arch),
                                                    position, 0)
        else:
            out["output_layer.weight"] = _chunk(_pad_vocab(_get(hf, "lm_head.weight"), arch), position, 0)
    return out


def hf_from_megatron_shards(
    shards: Sequence[Mapping[str, torch.Tensor]], *, arch: ArchInfo, layer_offset: int
) -> dict[str, torch.Tensor]:
    """HF tensors of one pipeline stage from the local state dicts of all its tensor ranks (index = tensor rank)."""

    first = shards[0]

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([shard[name] for shard in shards], dim=dim)

    out: dict[str, torch.Tensor] = {}
    if "embedding.word_embeddings.weight" in first:
        out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)[: arch.vocab_size].clone()
    local_layers = sorted({int(name.split(".")[2]) for name in first if name.startswith("decoder.layers.")})
    for local in local_layers:
        src = f"decoder.layers.{local}."
        dst = f"model.layers.{layer_offset + local}."
        out[dst + "input_layernorm.weight"] = first[src + "input_layernorm.weight"].clone()
        q, k, v = _split_qkv(cat(src + "self_attention.linear_qkv.weight", 0), arch)
        out[dst + "self_attn.q_proj.weight"], out[dst + "self_attn.k_proj.weight"] = q, k
        out[dst + "self_attn.v_proj.weight"] = v
        if src + "self_attention.linear_qkv.bias" in first:
            qb, kb, vb = _split_qkv(cat(src + "self_attention.linear_qkv.bias", 0), arch)
            out[dst + "self_attn.q_proj.bias"], out[dst + "self_attn.k_proj.bias"] = qb, kb
            out[dst + "self_attn.v_proj.bias"] = vb
        out[dst + "self_attn.o_proj.weight"] = cat(src + "self_attention.linear_proj.weight", 1)
        for hf_name, megatron_name in _QK_NORMS.items():
            if src + megatron_name in first:
                out[dst + hf_name] = first[src + megatron_name].clone()
        out[dst + "post_attention_layernorm.weight"] = first[src + "pre_mlp_layernorm.weight"].clone()
        halves = [torch.chunk(shard[src + "mlp.linear_fc1.weight"], 2, dim=0) for shard in shards]
        out[dst + "mlp.gate_proj.weight"] = torch.cat([half[0] for half in halves], dim=0)
        out[dst + "mlp.up_proj.weight"] = torch.cat([half[1] for half in halves], dim=0)
        out[dst + "mlp.down_proj.weight"] = cat(src + "mlp.linear_fc2.weight", 1)
    if "decoder.final_layernorm.weight" in first:
        out["model.norm.weight"] = first["decoder.final_layernorm.weight"].clone()
    if "output_layer.weight" in first:
        if arch.value_head:
            out["score.weight"] = first["output_layer.weight"].clone()
            if "output_layer.bias" in first:
                out["score.bias"] = first["output_layer.bias"].clone()
        elif not arch.tied_embeddings:
            out["lm_head.weight"] = cat("output_layer.weight", 0)[: arch.vocab_size].clone()
    return out
