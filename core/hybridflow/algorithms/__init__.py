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
    from hybridflow.algorithms.helpers import fill_old_log_probs, mean_over_ranks
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
    from hybridflow.detokenize import decode_batch

#: public name → the module defining it (decode_batch is shared with the workers, so it lives outside the package)
_EXPORTS: dict[str, str] = {
    "Algorithm": "hybridflow.algorithms.interface",
    "Runtime": "hybridflow.algorithms.runtime",
    "RoleDeclaration": "hybridflow.algorithms.roles",
    "Stateful": "hybridflow.algorithms.roles",
    "actor_role": "hybridflow.algorithms.roles",
    "critic_role": "hybridflow.algorithms.roles",
    "reference_role": "hybridflow.algorithms.roles",
    "reward_model_role": "hybridflow.algorithms.roles",
    "genrm_role": "hybridflow.algorithms.roles",
    "teacher_role": "hybridflow.algorithms.roles",
    "policy_roles": "hybridflow.algorithms.roles",
    "FixedKLController": "hybridflow.algorithms.coefficients",
    "AdaptiveKLController": "hybridflow.algorithms.coefficients",
    "AdaptiveEntropyController": "hybridflow.algorithms.coefficients",
    "LagrangeMultiplier": "hybridflow.algorithms.coefficients",
    "build_kl_controller": "hybridflow.algorithms.coefficients",
    "build_kl_state": "hybridflow.algorithms.coefficients",
    "decode_batch": "hybridflow.detokenize",
    "fill_old_log_probs": "hybridflow.algorithms.helpers",
    "mean_over_ranks": "hybridflow.algorithms.helpers",
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
    return getattr(importlib.import_module(module), name)
