"""The cost-model hook: a Protocol engine plugins implement to supply or refine stage-time estimates.

Plugins register implementations in :data:`cost_models` (via ``hybridflow_register_cost_models(registry)``);
the simulator asks an override first and falls back to its analytical model when a method returns None.
Which engine serves which model is decided by whoever builds the simulator, not here.
Stability: developer.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from hybridflow.placement.dataflow import Workload
from hybridflow.placement.models import ModelSpec
from hybridflow.placement.parallel import GenerationConfig, ParallelConfig
from hybridflow.placement.profiles import Cluster
from hybridflow.registries import cost_models

__all__ = ["CostModel", "cost_models", "lookup_cost_models"]


@runtime_checkable
class CostModel(Protocol):
    """Per-engine stage-time estimates in seconds; return None to defer to the analytical simulator."""

    def train_seconds(self, *, model: ModelSpec, parallel: ParallelConfig, workload: Workload, cluster: Cluster,
                      sequences: float) -> float | None:
        """Seconds to train on ``sequences`` sequences (all epochs and mini batches) with ``parallel``."""
        ...

    def infer_seconds(self, *, model: ModelSpec, parallel: ParallelConfig, workload: Workload, cluster: Cluster,
                      sequences: float) -> float | None:
        """Seconds of one forward pass over ``sequences`` full sequences (log-probs, values, rewards)."""
        ...

    def generate_seconds(self, *, model: ModelSpec, parallel: ParallelConfig, generation: GenerationConfig,
                         workload: Workload, cluster: Cluster, sequences: float, kv_cache_bytes: float
                         ) -> float | None:
        """Seconds to generate ``sequences`` responses with ``kv_cache_bytes`` of KV cache free per device."""
        ...


def lookup_cost_models(engines: dict[str, str]) -> dict[str, CostModel]:
    """Map each role to the registered cost model of its engine (role → engine name); roles without one are left out.

    ``cost_models`` is :data:`hybridflow.registries.cost_models`, filled by ``hybridflow_register_cost_models``.
    """
    found: dict[str, CostModel] = {}
    for role, engine in engines.items():
        if engine in cost_models:
            found[role] = cost_models.get(engine)
    return found
