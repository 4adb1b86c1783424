"""RLOO (Ahmadian et al. 2024): n samples per prompt, each one's baseline is the mean score of the others."""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.advantages import compute_rloo_advantages
from hybridflow.algorithms.base import Runtime, mean_over_ranks
from hybridflow.batch import Batch

__all__ = ["RLOO"]


class RLOO:
    name = "rloo"
    needs_critic = False

    def needs_reference(self, config: Any) -> bool:
        return bool(config.actor.kl_loss_coef > 0 or config.algorithm.kl_coef > 0)

    def step(self, rt: Runtime, prompts: Batch) -> dict[str, float]:
        batch = rt.rollout(prompts)                    # n samples per prompt, π_old, π_ref, reward
        batch["advantages"] = compute_rloo_advantages(batch["scores"], rt.config.rollout.n, batch["response_mask"])
        metrics = mean_over_ranks(rt.actor.update_policy(batch))
        return {**rt.summarize(batch), **metrics}
