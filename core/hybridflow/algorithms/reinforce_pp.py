"""REINFORCE++ (Hu 2025): token rewards (score on the last token minus a per-token KL penalty), discounted
returns whitened over the whole batch; no critic, no groups."""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.advantages import compute_reinforce_plus_plus_advantages
from hybridflow.algorithms.coefficients import build_kl_state
from hybridflow.algorithms.helpers import mean_over_ranks
from hybridflow.algorithms.roles import RoleDeclaration, Stateful, policy_roles
from hybridflow.algorithms.runtime import Runtime
from hybridflow.batch import Batch

__all__ = ["ReinforcePlusPlus"]


class ReinforcePlusPlus:
    name = "reinforce_plus_plus"
    extra_keys: tuple[str, ...] = ()

    def roles(self, config: Any) -> list[RoleDeclaration]:
        return policy_roles(config, kl_in_reward=config.algorithm.kl_coef > 0)

    def build_state(self, config: Any) -> dict[str, Stateful]:
        return build_kl_state(config)

    def step(self, rt: Runtime, prompts: Batch) -> dict[str, float]:
        batch = rt.rollout(prompts)                    # samples, π_old, π_ref, reward
        batch["advantages"] = compute_reinforce_plus_plus_advantages(rt.token_rewards(batch), batch["response_mask"],
                                                                     rt.config.algorithm.gamma)
        metrics = mean_over_ranks(rt.actor.update_policy(batch))
        summary = rt.summarize(batch)
        rt.update_kl_controller(summary, len(batch))
        return {**summary, **metrics}
