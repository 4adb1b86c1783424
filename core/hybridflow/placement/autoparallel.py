"""Pick each model's fastest layout for a device count and memory budget, cached per (role, devices, budget).

A model's stages share one training layout (p, t, d); the actor also picks its generation layout (pg, tg) jointly,
paying the transition between them. Stage timing is the simulator's; which devices a model gets is the search's.
Stability: developer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hybridflow.placement.dataflow import Dataflow, Stage
from hybridflow.placement.memory import (
    generation_kv_budget,
    infer_bytes_per_device,
    resident_bytes_per_device,
    train_bytes_per_device,
)
from hybridflow.placement.models import ModelSpec
from hybridflow.placement.parallel import (
    GenerationConfig,
    ParallelConfig,
    enumerate_generation_configs,
    enumerate_parallel_configs,
)
from hybridflow.placement.simulator import Simulator

__all__ = ["RoleLayout", "LayoutPlanner"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RoleLayout:
    """One model's chosen layout on ``devices`` devices and the seconds of each of its stages."""

    role: str
    devices: int
    parallel: ParallelConfig
    generation: GenerationConfig | None
    stage_seconds: dict[str, float]
    resident_bytes: float = 0.0
    peak_bytes: float = 0.0

    @property
    def seconds(self) -> float:
        return sum(self.stage_seconds.values())


class LayoutPlanner:
    """Finds and caches the best layout per (role, devices, memory budget) for one search's models and simulator."""

    def __init__(self, simulator: Simulator, dataflow: Dataflow, models: Mapping[str, ModelSpec]) -> None:
        self.simulator = simulator
        self.dataflow = dataflow
        self.models = dict(models)
        self._stages: dict[str, list[Stage]] = {}
        for stage in dataflow.stages:
            self._stages.setdefault(stage.role, []).append(stage)
        self._cache: dict[tuple[str, int, int], RoleLayout | None] = {}
        self.evaluations = 0

    def best_layout(self, role: str, devices: int, budget_bytes: float) -> RoleLayout | None:
        """The fastest layout of ``role`` on ``devices`` devices within ``budget_bytes`` per device, or None."""
        key = (role, devices, int(budget_bytes // 1e8))  # 0.1 GB buckets keep the cache small
        if key not in self._cache:
            self._cache[key] = self._search(role, devices, budget_bytes)
        return self._cache[key]

    def evaluate(self, role: str, parallel: ParallelConfig, generation: GenerationConfig | None,
                 budget_bytes: float) -> RoleLayout | None:
        """Time ``role``'s stages with a given layout, or None if it does not fit ``budget_bytes`` per device."""
        model = self.models[role]
        trainable = role in self.dataflow.trainable
        workload = self.simulator.workload
        peak = infer_bytes_per_device(model, workload, parallel, trainable)
        if trainable:
            peak = max(peak, train_bytes_per_device(model, workload, parallel))
        if peak > budget_bytes:
            return None
        self.evaluations += 1
        seconds: dict[str, float] = {}
        for stage in self._stages.get(role, []):
            sequences = workload.sequences * stage.sequence_factor
            if stage.kind == "train":
                seconds[stage.name] = self.simulator.train_seconds(role, model, parallel, sequences)
            elif stage.kind == "infer":
                seconds[stage.name] = self.simulator.infer_seconds(role, model, parallel, sequences)
            elif stage.kind == "generate":
                if generation is None:
                    return None
                if stage.name == "generate_baseline":
                    sequences = workload.prompts * stage.sequence_factor
                kv = generation_kv_budget(model, parallel, generation, budget_bytes)
                peak = budget_bytes  # the KV cache takes whatever the budget leaves
                seconds[stage.name] = self.simulator.generate_seconds(role, model, parallel, generation,
                                                                      sequences, kv)
            else:
                if generation is None:
                    return None
                seconds[stage.name] = self.simulator.transition_seconds(model, parallel, generation)
        if not all(math.isfinite(v) for v in seconds.values()):
            return None
        return RoleLayout(role=role, devices=parallel.world_size, parallel=parallel, generation=generation,
                          stage_seconds=seconds, peak_bytes=peak,
                          resident_bytes=resident_bytes_per_device(model, parallel, trainable))

    def _search(self, role: str, devices: int, budget_bytes: float) -> RoleLayout | None:
        model = self.models[role]
        workload = self.simulator.workload
        generates = any(s.kind == "generate" for s in self._stages.get(role, []))
        trains = role in self.dataflow.trainable
        max_data = max(1, workload.sequences // workload.mini_batches) if trains else workload.sequences
        best: RoleLayout | None = None
        for parallel in enumerate_parallel_configs(model, devices, max_tensor=self.simulator.cluster.devices_per_node,
                                                   max_data=max_data):
            candidates: list[GenerationConfig | None] = (
                list(enumerate_generation_configs(model, parallel)) if generates else [None])
            for generation in candidates:
                layout = self.evaluate(role, parallel, generation, budget_bytes)
                if layout is not None and (best is None or layout.seconds < best.seconds):
                    best = layout
        return best
