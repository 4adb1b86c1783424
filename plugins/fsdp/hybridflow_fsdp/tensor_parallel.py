"""Tensor-parallel generation for the ``hf`` rollout engine: Megatron-style shards of a Llama/Qwen2/Qwen3 model over a
torch.distributed group (gloo on CPU, NCCL on GPU) and a lean decoder that communicates where the shards meet.

The shards follow :func:`hybridflow.resharding.builders.build_tensor_parallel_layout`: column-parallel q/k/v/gate/up
(weights and biases) and lm_head and the vocab-parallel embedding split dim 0 into ``tg`` contiguous equal chunks,
row-parallel o_proj/down_proj weights split dim 1, norms and row-parallel biases replicated. Producing the shards
from training weights (resharding) is left to the caller; sampling is :mod:`hybridflow_fsdp.sampling`'s job.
Stability: public (``tensor_parallel_shard``, ``tensor_parallel_shapes``), developer (the rest).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridflow.errors import ConfigError, EngineError
from hybridflow.resharding.builders import classify_llama_param
from hybridflow_fsdp.fast_decode import LeanDecoder

__all__ = ["TensorGroup", "TensorParallelDecoder", "check_tensor_parallel_model", "resolve_tensor_group",
           "tensor_parallel_shapes", "tensor_parallel_shard", "tensor_parallel_split_dim"]

_PRESET_HINT = ("hybridflow.presets.tiny_model_config(num_heads=4, num_kv_heads=2) shards over tg=2 (set the config's "
                "vocab_size to a multiple of tg too: the char vocabulary has 45 tokens)")


@dataclass(frozen=True, slots=True)
class TensorGroup:
    """This rank's tensor-parallel group: ``ranks`` are global ranks in tensor-rank order, ``rank`` its index."""

    group: Any  # torch.distributed.ProcessGroup
    ranks: tuple[int, ...]
    rank: int
    #: the group's shared-memory channel (shm_comm.SpinChannel) when its ranks share a host, else None (gloo)
    channel: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)


def tensor_parallel_split_dim(name: str) -> int | None:
    """The dim ``name`` is split along (0: column / vocab, 1: row-parallel weight), None when replicated."""
    kind = classify_llama_param(name)
    return 0 if kind in ("column", "vocab") else 1 if kind == "row" else None


def tensor_parallel_shard(name: str, full: torch.Tensor, tg: int, rank: int) -> torch.Tensor:
    """Tensor rank ``rank``'s shard of the full parameter ``name`` (a view of ``full``; ``.clone()`` to own it).

    Raises:
        ConfigError: the split dim is not divisible by ``tg`` or ``rank`` is out of range.
    """
    if not 0 <= rank < tg:
        raise ConfigError(f"tensor rank {rank} is outside [0, {tg}) (tensor_parallel_size={tg})")
    dim = tensor_parallel_split_dim(name)
    if dim is None or tg == 1:
        return full
    if full.shape[dim] % tg:
        raise ConfigError(
            f"{name!r} has {full.shape[dim]} along dim {dim}, not divisible by tensor_parallel_size={tg}; pick a tg "
            f"that divides it or resize the model"
        )
    size = full.shape[dim] // tg
    return full.narrow(dim, rank * size, size)


def tensor_parallel_shapes(named_shapes: Mapping[str, Sequence[int]], tg: int) -> dict[str, tuple[int, ...]]:
    """The shard shape of every parameter at ``tg`` (the same on every tensor rank)."""
    out = {}
    for name, shape in named_shapes.items():
        local = list(shape)
        dim = tensor_parallel_split_dim(name)
        if dim is not None:
            if local[dim] % tg:
                raise ConfigError(f"{name!r} has {local[dim]} along dim {dim}, not divisible by tensor_parallel_size"
                                  f"={tg}")
            local[dim] //= tg
        out[name] = tuple(local)
    return out


def check_tensor_parallel_model(hf_config: Any, tg: int) -> None:
    """Raise ConfigError unless heads, KV heads, intermediate size and vocabulary all divide by ``tg``."""
    sizes = {"num_attention_heads": hf_config.num_attention_heads, "num_key_value_heads":
             getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
             "intermediate_size": hf_config.intermediate_size, "vocab_size": hf_config.vocab_size}
    bad = {key: int(value) for key, value in sizes.items() if int(value) % tg}
    if bad:
        raise ConfigError(
            f"tensor_parallel_size={tg} must divide {', '.join(f'{k} (= {v})' for k, v in bad.items())} of the "
            f"rollout model (heads are split across tensor ranks, each rank caching only its KV heads). Use a model "
            f"whose sizes divide by tg, e.g. {_PRESET_HINT}, or lower tensor_parallel_size."
        )


def resolve_tensor_group(tg: int, tensor_groups: Any, *, comm: str = "auto") -> TensorGroup:
    """Create every group of ``tensor_groups`` (collective: all ranks, list order) and return this rank's, with a
    shared-memory :class:`~hybridflow_fsdp.shm_comm.SpinChannel` for its decoding collectives when ``comm`` is
    ``auto`` (where its ranks share an x86 host) or ``shm`` (required), none for ``gloo``.

    Raises:
        ConfigError: torch.distributed is not initialised, or the groups are not a partition of the world's ranks
            into groups of ``tg``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            f"tensor_parallel_size={tg} needs torch.distributed initialised before the hf rollout engine is built "
            "(the training engine of the same worker does it); got an uninitialised default process group"
        )
    if not tensor_groups:
        raise ConfigError(
            f"tensor_parallel_size={tg} needs RolloutEngineConfig.tensor_groups: the tensor groups as global ranks, "
            f"one per group (e.g. ((0, 2), (1, 3)) for tg=2 on 4 ranks; the actor worker passes its generation "
            f"layout's); got {tensor_groups!r}"
        )
    groups = [tuple(int(rank) for rank in ranks) for ranks in tensor_groups]
    world, me = dist.get_world_size(), dist.get_rank()
    flat = [rank for ranks in groups for rank in ranks]
    wrong = [ranks for ranks in groups if len(ranks) != tg]
    if wrong or sorted(flat) != list(range(world)):
        raise ConfigError(
            f"tensor_groups must split the {world} ranks 0..{world - 1} into groups of tensor_parallel_size={tg}, "
            f"each rank in exactly one group; got {[list(g) for g in groups]}"
            + (f" (groups of the wrong size: {[list(g) for g in wrong]})" if wrong else "")
        )
    mine = None
    for ranks in groups:  # new_group is collective over the whole world: every rank creates every group
        group = dist.new_group(list(ranks))
        if me in ranks:
            mine = TensorGroup(group=group, ranks=ranks, rank=ranks.index(me))
    assert mine is not None  # the partition check above put this rank in one group
    from hybridflow_fsdp.shm_comm import COMM_SETTINGS, SpinChannel, spin_channel_unsupported_reason

    if comm not in COMM_SETTINGS:
        raise ConfigError(f"rollout.extra.comm must be one of {list(COMM_SETTINGS)}, got {comm!r}")
    if comm == "gloo":
        return mine
    reason = spin_channel_unsupported_reason(mine.group)
    if reason is not None:
        if comm == "shm":
            raise ConfigError(f"rollout.extra.comm is shm, but the tensor group's ranks cannot share memory: {reason}."
                              " Fix: set rollout.extra.comm to auto or gloo")
        return mine
    return TensorGroup(group=mine.group, ranks=mine.ranks, rank=mine.rank, channel=SpinChannel(mine.group))


class TensorParallelDecoder(LeanDecoder):
    """:class:`LeanDecoder` over this rank's shards (stability: developer).

    Each rank computes its heads (and caches only their keys/values) and its slice of the MLP; the row-parallel
    o_proj/down_proj outputs are summed with ``all_reduce``, the vocab-parallel embedding is a masked local lookup
    plus ``all_reduce``, and the logits are the local vocabulary slice all-gathered along the vocabulary, so every
    rank of the group holds the same full logits and samples the same tokens from the same generator.
    """

    def __init__(self, model: nn.Module, tensor_group: TensorGroup) -> None:
        super().__init__(model)
        tg = tensor_group.size
        self.tensor_group = tensor_group
        self.num_heads //= tg
        self.num_kv_heads //= tg
        vocab = int(getattr(model.config, "vocab_size"))  # noqa: B009 - typed Any
        self._vocab_shard = vocab // tg
        self._vocab_start = tensor_group.rank * self._vocab_shard
        # all_gather lists by group rank (sorted global ranks); logits are concatenated in tensor-rank order
        self._gather_order = [dist.get_group_rank(tensor_group.group, rank) for rank in tensor_group.ranks]

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tensor_group.channel is not None:
            return self.tensor_group.channel.all_reduce_(x)  # type: ignore[no-any-return]
        dist.all_reduce(x, group=self.tensor_group.group)
        return x

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self._vocab_start
        outside = (local < 0) | (local >= self._vocab_shard)
        h = F.embedding(local.masked_fill(outside, 0), self._embedding)
        return self._all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0.0))

    def _row(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = self._all_reduce(F.linear(x, weight))
        return out if bias is None else out.add_(bias)  # a replicated bias is added once, after the sum

    def _head_logits(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(self._plain_norm(h), *self._head).contiguous()
        if self.tensor_group.channel is not None:
            parts = self.tensor_group.channel.all_gather(local)
        else:
            parts = [torch.empty_like(local) for _ in range(self.tensor_group.size)]
            dist.all_gather(parts, local, group=self.tensor_group.group)
        return torch.cat([parts[index] for index in self._gather_order], dim=-1)

    def forward_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *,
                       last: int | None = None) -> torch.Tensor:
        raise EngineError("the tensor-parallel decoder only generates (prefill/step); score sequences with the "
                          "training engine's compute_log_probs")

    def response_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                        response_width: int, *, remove_padding: bool = False,
                        valid_only: bool = False) -> torch.Tensor:
        raise EngineError("the tensor-parallel decoder only generates (prefill/step); score sequences with the "
                          "training engine's compute_log_probs")
