"""Assemble full HF-named weights on every rank from megatron shards.

All-gather over tensor ranks, broadcast over stages.

It is the HF export's source and the handover's fallback for a vocabulary megatron padded for tensor parallelism;
every other handover goes through the core reshard planner (:mod:`hybridflow_megatron.handover`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridflow_megatron.convert import ArchInfo, hf_from_megatron_shards
from hybridflow_megatron.spec_names import named_local_parameters

__all__ = ["GatherStats", "gather_hf_state"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GatherStats:
    """Bytes this rank received while assembling the full weights."""

    bytes_received: int
    tensors: int


def _layer_offset(module: Any) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return int(get_transformer_layer_offset(module.config))


def gather_hf_state(module: Any, *, arch: ArchInfo, placement: Any) -> tuple[dict[str, torch.Tensor], GatherStats]:
    """Every HF tensor of the model, identical on all ranks; a collective over the tensor and pipeline groups."""
    from megatron.core import parallel_state as ps

    received = 0
    local = {name: param.detach() for name, param in named_local_parameters(module)}
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(placement.tp_size)]
    tp_group = ps.get_tensor_model_parallel_group()
    for name in sorted(local):
        tensor = local[name].contiguous()
        if placement.tp_size == 1:
            shards[0][name] = tensor.clone()
            continue
        parts = [torch.empty_like(tensor) for _ in range(placement.tp_size)]
        dist.all_gather(parts, tensor, group=tp_group)
        received += tensor.numel() * tensor.element_size() * (placement.tp_size - 1)
        for rank, part in enumerate(parts):
            shards[rank][name] = part
    stage_state = hf_from_megatron_shards(shards, arch=arch, layer_offset=_layer_offset(module))
    if placement.pp_size == 1:
        return stage_state, GatherStats(bytes_received=received, tensors=len(stage_state))

    pp_group = ps.get_pipeline_model_parallel_group()
    full: dict[str, torch.Tensor] = {}
    for stage in range(placement.pp_size):
        source = dist.get_global_rank(pp_group, stage)
        header: list[Any] = [
            [(name, tuple(t.shape), str(t.dtype)) for name, t in stage_state.items()] if stage == placement.pp_rank
            else None
        ]
        dist.broadcast_object_list(header, src=source, group=pp_group)
        for name, shape, dtype in header[0]:
            if stage == placement.pp_rank:
                tensor = stage_state[name].contiguous()
            else:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]), device=next(
                    iter(local.values())).device)
                received += tensor.numel() * tensor.element_size()
            dist.broadcast(tensor, src=source, group=pp_group)
            full.setdefault(name, tensor)
    if arch.tied_embeddings:
        full.pop("lm_head.weight", None)
    ordered = dict(sorted(full.items(), key=lambda item: _hf_order(item[0])))
    return ordered, GatherStats(bytes_received=received, tensors=len(ordered))


def _hf_order(name: str) -> tuple[int, int, str]:
    if name.startswith("model.embed_tokens"):
        return (0, 0, name)
    if name.startswith("model.layers."):
        return (1, int(name.split(".")[2]), name)
    return (2, 0, name)
