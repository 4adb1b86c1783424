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
from hybridflow.registry import Registry

__all__ = ["CostModel", "cost_models"]


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


cost_models: Registry[CostModel] = Registry("cost model")
"""Engine name → :class:`CostModel`; filled by ``hybridflow_register_cost_models`` and by user code."""
