"""GRPO (Shao et al. 2024): n samples per prompt, advantages = scores normalised within each prompt's group; no
critic. The KL to the reference enters the loss (``actor.kl_loss_coef``) rather than the reward."""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.advantages import compute_grpo_advantages
from hybridflow.algorithms.base import Runtime, mean_over_ranks
from hybridflow.batch import Batch

__all__ = ["GRPO"]


class GRPO:
    name = "grpo"
    needs_critic = False

    def needs_reference(self, config: Any) -> bool:
        return bool(config.actor.kl_loss_coef > 0 or config.algorithm.kl_coef > 0)

    def step(self, rt: Runtime, prompts: Batch) -> dict[str, float]:
        batch = rt.rollout(prompts)                    # n samples per prompt, π_old, π_ref, reward
        batch["advantages"] = compute_grpo_advantages(
            batch["scores"], rt.config.rollout.n, batch["response_mask"],
            normalize_std=rt.config.algorithm.norm_adv_by_std)
        metrics = mean_over_ranks(rt.actor.update_policy(batch))
        return {**rt.summarize(batch), **metrics}
