"""Registers the built-in algorithm drivers in :data:`hybridflow.registries.algorithms`."""

from __future__ import annotations

from typing import Any

from hybridflow.hookspecs import hookimpl


@hookimpl
def hybridflow_register_algorithms(registry: Any) -> None:
    from hybridflow.algorithms.distill import OnPolicyDistill
    from hybridflow.algorithms.grpo import GRPO
    from hybridflow.algorithms.ppo import PPO
    from hybridflow.algorithms.reinforce_pp import ReinforcePlusPlus
    from hybridflow.algorithms.remax import ReMax
    from hybridflow.algorithms.rloo import RLOO
    from hybridflow.algorithms.safe_rlhf import SafeRLHF

    for algorithm in (PPO(), GRPO(), RLOO(), ReinforcePlusPlus(), ReMax(), SafeRLHF(), OnPolicyDistill()):
        registry.register(algorithm.name, algorithm)
