"""Safe-RLHF (Dai et al. 2024): maximise reward subject to E[cost] ≤ limit. A reward critic and a cost critic (its
own role, ``cost_critic``, configured by the ``cost_critic`` section, whose unset keys default to ``critic``'s),
GAE for both the reward and the cost; the actor follows (A_r − λ·A_c)/(1+λ) and λ (the algorithm's ``lagrange``
state, checkpointed with the run) rises while the mean episode cost exceeds ``cost.limit``.
"""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.advantages import build_token_level_rewards, combine_reward_and_cost_advantages, compute_gae
from hybridflow.algorithms.advantages import whiten as whiten_advantages
from hybridflow.algorithms.coefficients import LagrangeMultiplier, build_kl_state
from hybridflow.algorithms.helpers import mean_over_ranks
from hybridflow.algorithms.roles import RoleDeclaration, Stateful, critic_role, policy_roles
from hybridflow.algorithms.runtime import Runtime
from hybridflow.batch import Batch
from hybridflow.errors import ConfigError

__all__ = ["SafeRLHF"]


class SafeRLHF:
    name = "safe_rlhf"
    extra_keys: tuple[str, ...] = ()

    def roles(self, config: Any) -> list[RoleDeclaration]:
        if config.cost is None:
            raise ConfigError("algorithm.name=safe_rlhf needs a `cost` section (cost.function or cost.model, "
                              "cost.limit)")
        cost_critic = critic_role("cost_critic", section="cost_critic", defaults_from="critic", seed_offset=3,
                                  output_key="cost_values")
        return policy_roles(config, kl_in_reward=config.algorithm.kl_coef > 0, cost=True,
                            critics=[critic_role(), cost_critic])

    def build_state(self, config: Any) -> dict[str, Stateful]:
        cost = config.cost
        lagrange = LagrangeMultiplier(cost_limit=cost.limit, lr=cost.lagrange_lr, init_value=cost.initial_lambda)
        return {**build_kl_state(config), "lagrange": lagrange}

    def step(self, rt: Runtime, prompts: Batch) -> dict[str, float]:
        batch = rt.rollout(prompts, values=("critic", "cost_critic"), cost=True)  # samples, V_r, V_c, reward, cost
        mask, algorithm = batch["response_mask"], rt.config.algorithm
        reward_adv, batch["returns"] = compute_gae(rt.token_rewards(batch), batch["values"], mask, algorithm.gamma,
                                                   algorithm.lam)
        cost_adv, cost_returns = compute_gae(build_token_level_rewards(batch["costs"], mask), batch["cost_values"],
                                             mask, algorithm.gamma, algorithm.lam)
        if algorithm.whiten_advantages:
            reward_adv, cost_adv = whiten_advantages(reward_adv, mask.bool()), whiten_advantages(cost_adv, mask.bool())
        multiplier = rt.state["lagrange"].value
        batch["advantages"] = combine_reward_and_cost_advantages(reward_adv, cost_adv, multiplier)
        cost_view = batch | Batch({"values": batch["cost_values"], "returns": cost_returns}, meta=dict(batch.meta))
        critic_updates = rt.critic.update_critic.submit(batch), rt.cost_critic.update_critic.submit(cost_view)
        actor_metrics = mean_over_ranks(rt.actor.update_policy(batch))            # with both critics' updates
        critic_metrics, cost_critic_metrics = (mean_over_ranks(update.get()) for update in critic_updates)
        mean_cost = float(batch["costs"].mean())
        new_multiplier = rt.state["lagrange"].update(mean_cost)
        summary = rt.summarize(batch)
        rt.update_kl_controller(summary, len(batch))
        return {**summary, **critic_metrics, **{f"cost_{k}": v for k, v in cost_critic_metrics.items()},
                **actor_metrics, "cost/mean": mean_cost, "lagrange/lambda": new_multiplier,
                "lagrange/lambda_used": multiplier}
