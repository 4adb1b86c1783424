"""ReMax (Li et al. 2024): one sampled and one greedy response per prompt; the greedy response's reward is the
baseline. No critic, no groups."""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.advantages import compute_remax_advantages
from hybridflow.algorithms.base import Runtime, mean_over_ranks
from hybridflow.batch import Batch

__all__ = ["ReMax"]


class ReMax:
    name = "remax"
    needs_critic = False

    def needs_reference(self, config: Any) -> bool:
        return bool(config.actor.kl_loss_coef > 0)

    def step(self, rt: Runtime, prompts: Batch) -> dict[str, float]:
        greedy = rt.actor.generate(prompts, greedy=True)                # the baseline: one greedy response each
        batch = rt.rollout(prompts)                                     # sampled responses, π_old, π_ref, reward
        baseline = rt.score(rt.gather(greedy))["scores"].repeat_interleave(rt.config.rollout.n)
        batch["baseline_scores"] = baseline
        batch["advantages"] = compute_remax_advantages(batch["scores"], baseline, batch["response_mask"])
        metrics = mean_over_ranks(rt.actor.update_policy(batch))
        return {**rt.summarize(batch), "reward/greedy_baseline": float(baseline.mean()), **metrics}
