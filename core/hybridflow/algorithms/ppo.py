"""PPO (Ouyang et al. 2022 style RLHF): critic values, KL-penalised token rewards, GAE (whitened, as verl's
``compute_gae_advantage_return``, unless ``algorithm.whiten_advantages: false``), clipped updates of critic and
actor."""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.advantages import compute_gae, whiten
from hybridflow.algorithms.coefficients import build_kl_state
from hybridflow.algorithms.helpers import mean_over_ranks
from hybridflow.algorithms.roles import RoleDeclaration, Stateful, critic_role, policy_roles
from hybridflow.algorithms.runtime import Runtime
from hybridflow.batch import Batch

__all__ = ["PPO"]


class PPO:
    name = "ppo"
    extra_keys: tuple[str, ...] = ()

    def roles(self, config: Any) -> list[RoleDeclaration]:
        return policy_roles(config, kl_in_reward=config.algorithm.kl_coef > 0, critics=[critic_role()])

    def build_state(self, config: Any) -> dict[str, Stateful]:
        return build_kl_state(config)  # the in-reward KL coefficient (fixed or adaptive)

    def step(self, rt: Runtime, prompts: Batch) -> dict[str, float]:
        batch = rt.rollout(prompts, values=("critic",))    # 1-2. rollout, then π_old, π_ref, V and the reward
        mask, algorithm = batch["response_mask"], rt.config.algorithm
        advantages, batch["returns"] = compute_gae(                     # 3. advantages on r_t = score − β·KL_t
            rt.token_rewards(batch), batch["values"], mask, algorithm.gamma, algorithm.lam)
        batch["advantages"] = whiten(advantages, mask.bool()) if algorithm.whiten_advantages else advantages
        critic_update = rt.critic.update_critic.submit(batch)           # 4. learn: critic and actor together
        actor_metrics = mean_over_ranks(rt.actor.update_policy(batch))
        critic_metrics = mean_over_ranks(critic_update.get())
        summary = rt.summarize(batch)
        rt.update_kl_controller(summary, len(batch))
        return {**summary, **critic_metrics, **actor_metrics}
