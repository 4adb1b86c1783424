"""Parallel layouts the search considers (training p·t·d, generation pg·tg) and the actor's transition bytes.

It enumerates layouts that divide a device count and a model's shape; which one is fastest is the simulator's call,
and the exact bytes of a reshard are the reshard planner's (``hybridflow.resharding``).
Stability: developer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hybridflow.errors import ConfigError
from hybridflow.placement.models import ModelSpec

__all__ = [
    "ParallelConfig",
    "GenerationConfig",
    "divisors",
    "enumerate_parallel_configs",
    "enumerate_generation_configs",
    "estimate_transition_bytes",
]


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class ParallelConfig:
    """Training/inference layout: ``pipeline`` (p) × ``tensor`` (t) × ``data`` (d) ranks."""

    pipeline: int
    tensor: int
    data: int

    def __post_init__(self) -> None:
        if min(self.pipeline, self.tensor, self.data) < 1:
            raise ConfigError(f"Parallel sizes must be >= 1, got p={self.pipeline}, t={self.tensor}, d={self.data}.")

    @property
    def world_size(self) -> int:
        return self.pipeline * self.tensor * self.data

    @property
    def model_parallel_size(self) -> int:
        return self.pipeline * self.tensor

    def to_config(self) -> dict[str, int]:
        return {"pipeline_parallel_size": self.pipeline, "tensor_parallel_size": self.tensor,
                "data_parallel_size": self.data}

    def __str__(self) -> str:
        return f"p{self.pipeline}·t{self.tensor}·d{self.data}"


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class GenerationConfig:
    """Generation layout inside each training model-parallel group: ``pipeline`` (pg) × ``tensor`` (tg)."""

    pipeline: int
    tensor: int

    def __post_init__(self) -> None:
        if min(self.pipeline, self.tensor) < 1:
            raise ConfigError(f"Generation sizes must be >= 1, got pg={self.pipeline}, tg={self.tensor}.")

    @property
    def model_parallel_size(self) -> int:
        return self.pipeline * self.tensor

    def to_config(self) -> dict[str, int]:
        return {"tensor_parallel_size": self.tensor, "pipeline_parallel_size": self.pipeline}

    def __str__(self) -> str:
        return f"pg{self.pipeline}·tg{self.tensor}"


@lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """Divisors of ``n`` in increasing order."""
    return tuple(k for k in range(1, n + 1) if n % k == 0)


def enumerate_parallel_configs(model: ModelSpec, devices: int, *, max_tensor: int, max_data: int
                               ) -> list[ParallelConfig]:
    """All p·t·d == ``devices`` with t dividing the KV heads (capped at ``max_tensor``), p ≤ layers,
    d ≤ ``max_data``."""
    configs = []
    for tensor in divisors(devices):
        if tensor > max_tensor or (model.num_kv_heads % tensor and tensor % model.num_kv_heads):
            continue
        if model.num_heads % tensor:
            continue
        for pipeline in divisors(devices // tensor):
            data = devices // (tensor * pipeline)
            if pipeline <= model.num_layers and data <= max_data:
                configs.append(ParallelConfig(pipeline=pipeline, tensor=tensor, data=data))
    return configs


def enumerate_generation_configs(model: ModelSpec, train: ParallelConfig) -> list[GenerationConfig]:
    """All (pg, tg) with pg·tg dividing the training p·t, tg ≤ t and pg ≤ p (the 3D-HybridEngine's constraint)."""
    configs = []
    for tensor in divisors(train.tensor):
        if model.num_heads % tensor:
            continue
        for pipeline in divisors(train.pipeline):
            configs.append(GenerationConfig(pipeline=pipeline, tensor=tensor))
    return configs


def estimate_transition_bytes(model_bytes: float, p: int, t: int, d: int, pg: int, tg: int) -> float:
    """Bytes each rank receives when the actor moves from training (p, t, d) to generation (pg, tg) layout.

    The paper's stride-grouping formula, (t·p − tg·pg) / (tg·pg·t·p) · M: every rank all-gathers its generation
    shard (M / (tg·pg)) from the micro-DP group, already holding its training shard (M / (t·p)). ``d`` does not
    enter (data-parallel replicas reshard independently). A placeholder until the reshard planner in
    ``hybridflow.resharding`` reports exact per-parameter bytes; swap the call site, not the formula.
    """
    if (p * t) % (pg * tg):
        raise ConfigError(f"Generation pg·tg = {pg}·{tg} must divide training p·t = {p}·{t}.")
    del d
    return (t * p - tg * pg) / (tg * pg * t * p) * model_bytes
