"""ReMax (Li et al. 2024): one sampled and one greedy response per prompt; the greedy response's reward is the
baseline. No critic, no groups."""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.advantages import compute_remax_advantages
from hybridflow.algorithms.base import Runtime, fill_old_log_probs, mean_over_ranks
from hybridflow.batch import Batch

__all__ = ["ReMax"]


class ReMax:
    name = "remax"
    needs_critic = False

    def needs_reference(self, config: Any) -> bool:
        return bool(config.actor.kl_loss_coef > 0)

    def step(self, rt: Runtime, prompts: Batch) -> dict[str, float]:
        generated = rt.actor.generate(prompts)                          # sampled responses (rollout.n per prompt)
        greedy = rt.actor.generate(prompts, greedy=True)                # the baseline: one greedy response each
        old = rt.old_log_probs(generated)
        ref = rt.reference.compute_ref_log_probs(generated) if rt.reference else None
        batch = rt.score(fill_old_log_probs(rt.gather(generated, old, ref)))
        baseline = rt.score(rt.gather(greedy))["scores"].repeat_interleave(rt.config.rollout.n)
        batch["baseline_scores"] = baseline
        batch["advantages"] = compute_remax_advantages(batch["scores"], baseline, batch["response_mask"])
        metrics = mean_over_ranks(rt.actor.update_policy(batch))
        return {**rt.summarize(batch), "reward/greedy_baseline": float(baseline.mean()), **metrics}
