"""The concrete registries that plugin hooks and user code fill: one :class:`Registry` per kind.

They are process-global; :mod:`hybridflow.plugins` fills them from entry points when asked.
"""

from __future__ import annotations

from typing import Any

from hybridflow.registry import Registry

__all__ = [
    "training_engines",
    "rollout_engines",
    "transfer_protocols",
    "layouts",
    "cost_models",
    "rewards",
    "algorithms",
    "ALL",
]

training_engines: Registry[Any] = Registry("training engine")
rollout_engines: Registry[Any] = Registry("rollout engine")
transfer_protocols: Registry[Any] = Registry("transfer protocol")
layouts: Registry[Any] = Registry("layout")
cost_models: Registry[Any] = Registry("cost model")
rewards: Registry[Any] = Registry("reward function")
algorithms: Registry[Any] = Registry("algorithm")

#: hook name → registry it fills
ALL: dict[str, Registry[Any]] = {
    "hybridflow_register_training_engines": training_engines,
    "hybridflow_register_rollout_engines": rollout_engines,
    "hybridflow_register_transfer_protocols": transfer_protocols,
    "hybridflow_register_layouts": layouts,
    "hybridflow_register_cost_models": cost_models,
    "hybridflow_register_rewards": rewards,
    "hybridflow_register_algorithms": algorithms,
}
