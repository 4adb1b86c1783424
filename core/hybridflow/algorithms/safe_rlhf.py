"""Safe-RLHF (Dai et al. 2024): maximise reward subject to E[cost] ≤ limit. A reward critic and GAE for both the
reward and the cost; the actor follows (A_r − λ·A_c)/(1+λ) and λ rises while the mean cost exceeds its limit.

The cost critic shares the critic role's model here (values of the reward only); the cost advantage uses the
sequence cost minus its batch mean, which keeps this driver to one critic.
"""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.advantages import (
    build_token_level_rewards,
    combine_reward_and_cost_advantages,
    compute_gae,
    whiten,
)
from hybridflow.algorithms.base import Runtime, mean_over_ranks
from hybridflow.batch import Batch

__all__ = ["SafeRLHF"]


class SafeRLHF:
    name = "safe_rlhf"
    needs_critic = True

    def needs_reference(self, config: Any) -> bool:
        return bool(config.algorithm.kl_coef > 0 or config.actor.kl_loss_coef > 0)

    def step(self, rt: Runtime, prompts: Batch) -> dict[str, float]:
        batch = rt.rollout(prompts, with_values=True)                                 # samples, values, reward
        batch = rt.score(batch, key="costs", cost=True)                               # cost scores
        mask = batch["response_mask"]
        kl_coef = rt.kl_controller.value if rt.kl_controller else 0.0
        rewards = build_token_level_rewards(batch["scores"], mask, rt.kl_rewards(batch), kl_coef)
        reward_adv, batch["returns"] = compute_gae(rewards, batch["values"], mask, rt.config.algorithm.gamma,
                                                   rt.config.algorithm.lam)
        cost_adv = whiten(build_token_level_rewards(batch["costs"], mask).flip(-1).cumsum(-1).flip(-1), mask.bool())
        multiplier = rt.lagrange.value
        batch["advantages"] = combine_reward_and_cost_advantages(whiten(reward_adv, mask.bool()), cost_adv, multiplier)
        critic_metrics = mean_over_ranks(rt.critic.update_critic(batch))
        actor_metrics = mean_over_ranks(rt.actor.update_policy(batch))
        mean_cost = float(batch["costs"].mean())
        new_multiplier = rt.lagrange.update(mean_cost)
        return {**rt.summarize(batch), **critic_metrics, **actor_metrics, "cost/mean": mean_cost,
                "lagrange/lambda": new_multiplier, "lagrange/lambda_used": multiplier}
