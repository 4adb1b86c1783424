"""RLOO (Ahmadian et al. 2024): n samples per prompt, each one's baseline is the mean score of the others. With
``algorithm.kl_coef > 0`` the score is KL-penalised first (score − β·Σ_t KL_t), as in the paper."""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms.advantages import compute_rloo_advantages
from hybridflow.algorithms.coefficients import build_kl_state
from hybridflow.algorithms.helpers import mean_over_ranks
from hybridflow.algorithms.roles import RoleDeclaration, Stateful, policy_roles
from hybridflow.algorithms.runtime import Runtime
from hybridflow.batch import Batch

__all__ = ["RLOO"]


class RLOO:
    name = "rloo"
    extra_keys: tuple[str, ...] = ()
    #: its advantages need only a prompt group: a step may stream in chunks of groups (trainer.stream_mini_batches)
    streams_mini_batches = True

    def roles(self, config: Any) -> list[RoleDeclaration]:
        return policy_roles(config, kl_in_reward=config.algorithm.kl_coef > 0)

    def build_state(self, config: Any) -> dict[str, Stateful]:
        return build_kl_state(config)

    def step(self, rt: Runtime, prompts: Batch) -> dict[str, float]:
        if rt.stream_chunks > 1:  # trainer.stream_mini_batches: 1-3 per chunk of prompt groups, as each arrives
            batch, metrics = rt.stream_update(prompts, lambda chunk: self.advantages(rt, chunk))
        else:
            batch = rt.rollout(prompts)                                # 1. n samples per prompt; π_old, π_ref, reward
            self.advantages(rt, batch)                                 # 2. advantages within each prompt's group
            metrics = mean_over_ranks(rt.actor.update_policy(batch))   # 3. learn
        summary = rt.summarize(batch)
        rt.update_kl_controller(summary, len(batch))
        return {**summary, **metrics}

    def advantages(self, rt: Runtime, batch: Batch) -> None:
        """Leave-one-out baselines within each prompt's group (a chunk of whole groups gets the whole batch's)."""
        batch["advantages"] = compute_rloo_advantages(rt.outcome_scores(batch), rt.config.rollout.n,
                                                      batch["response_mask"])
