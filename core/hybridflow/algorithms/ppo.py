"""PPO (Ouyang et al. 2022 style RLHF): critic values, KL-penalised token rewards, GAE, clipped updates of critic
and actor."""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.advantages import build_token_level_rewards, compute_gae
from hybridflow.algorithms.base import Runtime, fill_old_log_probs, mean_over_ranks
from hybridflow.batch import Batch

__all__ = ["PPO"]


class PPO:
    name = "ppo"
    needs_critic = True

    def needs_reference(self, config: Any) -> bool:
        return bool(config.algorithm.kl_coef > 0 or config.actor.kl_loss_coef > 0)

    def step(self, rt: Runtime, prompts: Batch) -> dict[str, float]:
        generated = rt.actor.generate(prompts)                          # 1. rollout
        old = rt.old_log_probs(generated)                               # 2. score the rollout: actor,
        ref = rt.reference.compute_ref_log_probs(generated) if rt.reference else None   # reference,
        values = rt.critic.compute_values(generated)                    # critic, in parallel on their pools
        batch = rt.score(fill_old_log_probs(rt.gather(generated, old, ref, values)))    # reward
        kl_coef = rt.kl_controller.value if rt.kl_controller else 0.0
        rewards = build_token_level_rewards(batch["scores"], batch["response_mask"], rt.kl_rewards(batch), kl_coef)
        batch["advantages"], batch["returns"] = compute_gae(   # 3. advantages
            rewards, batch["values"], batch["response_mask"], rt.config.algorithm.gamma, rt.config.algorithm.lam)
        critic_metrics = mean_over_ranks(rt.critic.update_critic(batch))                 # 4. learn
        actor_metrics = mean_over_ranks(rt.actor.update_policy(batch))
        summary = rt.summarize(batch)
        if rt.kl_controller is not None and "kl/actor_ref" in summary:
            rt.kl_controller.update(summary["kl/actor_ref"], len(batch))
        return {**summary, **critic_metrics, **actor_metrics, "kl/coef": kl_coef}
