"""Memory estimates: per-device bytes of one layout and the memory floor (minimum devices) of a colocated set.

Counts weights, gradients, Adam states (sharded over data parallel, as a distributed optimizer does), activations
with recomputation, logits, and the KV cache. Whether a layout is fast is the simulator's question.
Stability: developer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hybridflow.placement.dataflow import Dataflow, Workload
from hybridflow.placement.models import ModelSpec
from hybridflow.placement.parallel import GenerationConfig, ParallelConfig
from hybridflow.placement.profiles import Cluster

__all__ = ["MemoryFloor", "OPTIMIZER_BYTES_PER_PARAMETER", "state_bytes", "train_bytes_per_device",
           "infer_bytes_per_device", "resident_bytes_per_device", "generation_kv_budget", "compute_memory_floor",
           "memory_shares"]

OPTIMIZER_BYTES_PER_PARAMETER = 12  # fp32 master weights + Adam first and second moments


def state_bytes(model: ModelSpec, trainable: bool) -> float:
    """Bytes of a model's resident state when fully sharded: weights, plus gradients and optimizer if it trains."""
    per_parameter = model.dtype_bytes * (2 if trainable else 1) + (OPTIMIZER_BYTES_PER_PARAMETER if trainable else 0)
    return float(model.parameters * per_parameter)


def _activation_bytes(model: ModelSpec, workload: Workload, config: ParallelConfig, training: bool) -> float:
    """Per-device activations of one micro batch: layer-input checkpoints, one layer's working set, and logits."""
    tokens = workload.micro_batch_size * workload.sequence_length
    h, b = model.hidden_size, model.dtype_bytes
    working = tokens * h * 17 * b / config.tensor  # ≈34 bytes/token/hidden at 2-byte dtype, split by TP
    logits = tokens * model.vocab_size * 4 / config.tensor
    if not training:
        return working + logits
    layers_per_stage = math.ceil(model.num_layers / config.pipeline)
    in_flight = config.pipeline  # 1F1B keeps up to p micro batches alive on the first stage
    checkpoints = layers_per_stage * in_flight * tokens * h * b / config.tensor
    return checkpoints + 2 * working + logits


def train_bytes_per_device(model: ModelSpec, workload: Workload, config: ParallelConfig) -> float:
    """Peak bytes per device while training with ``config``."""
    shard = model.parameters / config.model_parallel_size
    resident = shard * model.dtype_bytes * 2 + shard * OPTIMIZER_BYTES_PER_PARAMETER / config.data
    return resident + _activation_bytes(model, workload, config, training=True)


def resident_bytes_per_device(model: ModelSpec, config: ParallelConfig, trainable: bool) -> float:
    """Bytes per device that stay resident between stages (weights, and training state if trainable)."""
    shard = model.parameters / config.model_parallel_size
    if not trainable:
        return shard * model.dtype_bytes
    return shard * model.dtype_bytes * 2 + shard * OPTIMIZER_BYTES_PER_PARAMETER / config.data


def infer_bytes_per_device(model: ModelSpec, workload: Workload, config: ParallelConfig, trainable: bool) -> float:
    """Peak bytes per device during a forward-only pass (the model's resident state stays put)."""
    return resident_bytes_per_device(model, config, trainable) + _activation_bytes(model, workload, config, False)


def generation_kv_budget(model: ModelSpec, train: ParallelConfig, generation: GenerationConfig,
                         budget_bytes: float) -> float:
    """Bytes per device left for the KV cache during generation (negative if the weights alone do not fit).

    The actor's training state stays resident; the generation shard adds M/(pg·tg) − M/(p·t) (stride grouping
    reuses the training shard, so nothing is held twice).
    """
    resident = resident_bytes_per_device(model, train, trainable=True)
    extra = model.weight_bytes / generation.model_parallel_size - model.weight_bytes / train.model_parallel_size
    return budget_bytes - resident - extra


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryFloor:
    """The minimum devices of a colocated set and the bytes behind it, for error messages and reports."""

    roles: tuple[str, ...]
    devices: int
    state_bytes: dict[str, float]
    transient_bytes: float
    usable_bytes_per_device: float

    def describe(self) -> str:
        parts = ", ".join(f"{role} {size / 1e9:.1f} GB" for role, size in self.state_bytes.items())
        return (f"{{{', '.join(self.roles)}}} needs >= {self.devices} devices: states {parts}, plus "
                f"{self.transient_bytes / 1e9:.1f} GB transient, at {self.usable_bytes_per_device / 1e9:.1f} GB "
                "usable per device")


def _transient_total(model: ModelSpec, workload: Workload, generates: bool, trains: bool) -> float:
    """Unsharded transient bytes of a micro batch: KV cache if it generates, activations + logits otherwise."""
    tokens = workload.micro_batch_size * workload.sequence_length
    acts = tokens * model.hidden_size * model.dtype_bytes * (17 + (model.num_layers if trains else 0))
    logits = tokens * model.vocab_size * 4
    kv = tokens * model.kv_bytes_per_token() if generates else 0.0
    return max(acts + logits, kv)


def compute_memory_floor(roles: Iterable[str], models: Mapping[str, ModelSpec], dataflow: Dataflow,
                         workload: Workload, cluster: Cluster, usable_fraction: float) -> MemoryFloor:
    """Minimum devices so that the set's fully sharded states plus its largest transient fit in device memory."""
    roles = tuple(roles)
    usable = cluster.device.memory_bytes * usable_fraction
    generating = {s.role for s in dataflow.stages if s.kind == "generate"}
    states = {role: state_bytes(models[role], role in dataflow.trainable) for role in roles}
    transient = max(_transient_total(models[r], workload, r in generating, r in dataflow.trainable) for r in roles)
    devices = max(1, math.ceil((sum(states.values()) + transient) / usable))
    return MemoryFloor(roles=roles, devices=devices, state_bytes=states, transient_bytes=transient,
                       usable_bytes_per_device=usable)


def memory_shares(roles: Iterable[str], models: Mapping[str, ModelSpec], dataflow: Dataflow) -> dict[str, float]:
    """Fraction of each device a colocated model may use, in proportion to its fully sharded state."""
    roles = tuple(roles)
    states = {role: state_bytes(models[role], role in dataflow.trainable) for role in roles}
    total = sum(states.values())
    return {role: size / total for role, size in states.items()}
