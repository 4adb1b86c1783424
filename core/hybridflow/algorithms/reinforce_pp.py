"""REINFORCE++ (Hu 2025): token rewards (score on the last token minus a per-token KL penalty), discounted
returns whitened over the whole batch; no critic, no groups."""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.advantages import build_token_level_rewards, compute_reinforce_plus_plus_advantages
from hybridflow.algorithms.base import Runtime, mean_over_ranks
from hybridflow.batch import Batch

__all__ = ["ReinforcePlusPlus"]


class ReinforcePlusPlus:
    name = "reinforce_plus_plus"
    needs_critic = False

    def needs_reference(self, config: Any) -> bool:
        return bool(config.algorithm.kl_coef > 0 or config.actor.kl_loss_coef > 0)

    def step(self, rt: Runtime, prompts: Batch) -> dict[str, float]:
        batch = rt.rollout(prompts)                    # samples, π_old, π_ref, reward
        rewards = build_token_level_rewards(batch["scores"], batch["response_mask"], rt.kl_rewards(batch),
                                            rt.kl_controller.value if rt.kl_controller else 0.0)
        batch["advantages"] = compute_reinforce_plus_plus_advantages(rewards, batch["response_mask"],
                                                                     rt.config.algorithm.gamma)
        metrics = mean_over_ranks(rt.actor.update_policy(batch))
        return {**rt.summarize(batch), **metrics}
