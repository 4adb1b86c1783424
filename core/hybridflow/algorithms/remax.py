"""ReMax (Li et al. 2024): one sampled and one greedy response per prompt; the greedy response's reward is the
baseline. No critic, no groups. With ``algorithm.kl_coef > 0`` the sampled response's score is KL-penalised
(score − β·Σ_t KL_t, verl's ``use_kl_in_reward``); the baseline stays the greedy response's reward."""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.advantages import compute_remax_advantages
from hybridflow.algorithms.coefficients import build_kl_state
from hybridflow.algorithms.helpers import mean_over_ranks
from hybridflow.algorithms.roles import RoleDeclaration, Stateful, policy_roles
from hybridflow.algorithms.runtime import Runtime
from hybridflow.batch import Batch

__all__ = ["ReMax"]


class ReMax:
    name = "remax"
    extra_keys: tuple[str, ...] = ()

    def roles(self, config: Any) -> list[RoleDeclaration]:
        return policy_roles(config, kl_in_reward=config.algorithm.kl_coef > 0)

    def build_state(self, config: Any) -> dict[str, Stateful]:
        return build_kl_state(config)

    def step(self, rt: Runtime, prompts: Batch) -> dict[str, float]:
        greedy = rt.actor.generate(prompts, greedy=True)                # the baseline: one greedy response each
        batch = rt.rollout(prompts)                                     # sampled responses, π_old, π_ref, reward
        baseline = rt.score(rt.gather(greedy))["scores"].repeat_interleave(rt.config.rollout.n)
        batch["baseline_scores"] = baseline
        batch["advantages"] = compute_remax_advantages(rt.outcome_scores(batch), baseline, batch["response_mask"])
        metrics = mean_over_ranks(rt.actor.update_policy(batch))
        summary = rt.summarize(batch)
        rt.update_kl_controller(summary, len(batch))
        return {**summary, "reward/greedy_baseline": float(baseline.mean()), **metrics}
