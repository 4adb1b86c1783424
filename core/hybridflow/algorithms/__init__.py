"""RL algorithms: drivers and the shared math.

The math (advantage estimators, losses, KL and Lagrange coefficients) lives once in ``advantages``, ``losses`` and
``coefficients``; each driver module is a short dataflow over worker groups that reads like its algorithm. What an
algorithm is (:class:`Algorithm`), declares (``roles``) and gets in its step (:class:`Runtime`) is importable from
here; the names load lazily, so importing this package (as plugin discovery does) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.algorithms.coefficients import (
        AdaptiveEntropyController,
        AdaptiveKLController,
        FixedKLController,
        LagrangeMultiplier,
        build_kl_controller,
        build_kl_state,
    )
    from hybridflow.algorithms.helpers import decode_batch, fill_old_log_probs, mean_over_ranks
    from hybridflow.algorithms.interface import Algorithm
    from hybridflow.algorithms.roles import (
        RoleDeclaration,
        Stateful,
        actor_role,
        critic_role,
        genrm_role,
        policy_roles,
        reference_role,
        reward_model_role,
        teacher_role,
    )
    from hybridflow.algorithms.runtime import Runtime

#: public name → the module defining it
_EXPORTS: dict[str, str] = {
    "Algorithm": "interface",
    "Runtime": "runtime",
    "RoleDeclaration": "roles",
    "Stateful": "roles",
    "actor_role": "roles",
    "critic_role": "roles",
    "reference_role": "roles",
    "reward_model_role": "roles",
    "genrm_role": "roles",
    "teacher_role": "roles",
    "policy_roles": "roles",
    "FixedKLController": "coefficients",
    "AdaptiveKLController": "coefficients",
    "AdaptiveEntropyController": "coefficients",
    "LagrangeMultiplier": "coefficients",
    "build_kl_controller": "coefficients",
    "build_kl_state": "coefficients",
    "decode_batch": "helpers",
    "fill_old_log_probs": "helpers",
    "mean_over_ranks": "helpers",
}

__all__ = [
    "Algorithm",
    "Runtime",
    "RoleDeclaration",
    "Stateful",
    "actor_role",
    "critic_role",
    "reference_role",
    "reward_model_role",
    "genrm_role",
    "teacher_role",
    "policy_roles",
    "FixedKLController",
    "AdaptiveKLController",
    "AdaptiveEntropyController",
    "LagrangeMultiplier",
    "build_kl_controller",
    "build_kl_state",
    "decode_batch",
    "fill_old_log_probs",
    "mean_over_ranks",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridflow.algorithms' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hybridflow.algorithms.{module}"), name)
