"""Algorithms declare their roles and state; the trainer plans exactly those (no Ray: plans and specs only)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.advantages import build_token_level_rewards
from hybridflow.algorithms.coefficients import FixedKLController, LagrangeMultiplier
from hybridflow.algorithms.grpo import GRPO
from hybridflow.algorithms.losses import kl_penalty
from hybridflow.algorithms.ppo import PPO
from hybridflow.algorithms.reinforce_pp import ReinforcePlusPlus
from hybridflow.algorithms.remax import ReMax
from hybridflow.algorithms.rloo import RLOO
from hybridflow.algorithms.roles import check_algorithm_state, load_algorithm_state
from hybridflow.algorithms.runtime import Runtime
from hybridflow.algorithms.safe_rlhf import SafeRLHF
from hybridflow.batch import Batch
from hybridflow.config import Config, load_config
from hybridflow.errors import CheckpointError, ConfigError, PluginValidationError
from hybridflow.trainer.build import RolePlan, build_tokenizer, plan_roles, resolve_section
from hybridflow.workers import CriticWorker, RewardModelWorker

ALGORITHMS = {a.name: a for a in (PPO(), GRPO(), RLOO(), ReinforcePlusPlus(), ReMax(), SafeRLHF())}


def config(*overrides: str) -> Config:
    return load_config(None, list(overrides))


def plans(*overrides: str) -> dict[str, RolePlan]:
    cfg = config(*overrides)
    algorithm = ALGORITHMS[cfg.algorithm.name]
    planned = plan_roles(cfg, algorithm.roles(cfg), tokenizer=build_tokenizer(cfg.model))
    return {plan.role: plan for plan in planned}


@pytest.mark.parametrize("name", ["grpo", "rloo", "remax", "reinforce_plus_plus", "ppo"])
def test_reference_is_built_only_when_something_consumes_it(name: str) -> None:
    extra = ["cost.limit=1"] if name == "safe_rlhf" else []
    assert "reference" not in plans(f"algorithm.name={name}", *extra)
    assert "reference" in plans(f"algorithm.name={name}", "algorithm.kl_coef=0.1")       # the in-reward penalty
    assert "reference" in plans(f"algorithm.name={name}", "actor.kl_loss_coef=0.1")      # the KL loss
    # and the KL controller (state) exists exactly when the penalty is on
    assert "kl_controller" not in ALGORITHMS[name].build_state(config(f"algorithm.name={name}"))
    assert "kl_controller" in ALGORITHMS[name].build_state(config(f"algorithm.name={name}", "algorithm.kl_coef=0.1"))


def test_adaptive_kl_without_a_coefficient_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"adaptive_kl_target.*kl_coef"):
        PPO().build_state(config("algorithm.name=ppo", "algorithm.adaptive_kl_target=3"))


def test_reward_and_cost_models_are_distinct_roles() -> None:
    planned = plans("algorithm.name=safe_rlhf", "reward.model.preset=tiny-qwen2", "cost.model.preset=tiny-llama")
    reward, cost = planned["reward_model"], planned["cost_model"]
    assert reward.worker is RewardModelWorker and cost.worker is RewardModelWorker
    # distinct checkpoint folders (spec.name), distinct output columns, distinct initialisations
    assert (reward.spec.name, cost.spec.name) == ("reward_model", "cost_model")
    assert (reward.spec.output_key, cost.spec.output_key) == (None, "costs")
    assert reward.spec.role == cost.spec.role == "reward_model"  # both engines build a score head
    assert reward.spec.engine_config.model.seed != cost.spec.engine_config.model.seed


def test_safe_rlhf_has_a_cost_critic_configured_by_its_section_over_the_critic() -> None:
    planned = plans("algorithm.name=safe_rlhf", "cost.limit=0.5", "critic.optim.lr=0.01", "critic.micro_batch_size=8",
                    "cost_critic.optim.warmup_steps=3")
    critic, cost_critic = planned["critic"], planned["cost_critic"]
    assert critic.worker is CriticWorker and cost_critic.worker is CriticWorker
    assert cost_critic.spec.role == "critic" and cost_critic.spec.name == "cost_critic"
    assert cost_critic.spec.output_key == "cost_values"
    # unset keys come from `critic` (lr, micro batch), set ones from `cost_critic` (warmup)
    assert cost_critic.spec.engine_config.optim.lr == 0.01 and cost_critic.spec.engine_config.micro_batch_size == 8
    assert cost_critic.spec.engine_config.optim.warmup_steps == 3 and critic.spec.engine_config.optim.warmup_steps == 0
    assert cost_critic.spec.engine_config.model.seed != critic.spec.engine_config.model.seed
    state = SafeRLHF().build_state(config("algorithm.name=safe_rlhf", "cost.limit=0.5"))
    assert isinstance(state["lagrange"], LagrangeMultiplier) and state["lagrange"].cost_limit == 0.5


def test_safe_rlhf_without_a_cost_section_is_rejected() -> None:
    with pytest.raises(ConfigError, match="safe_rlhf needs a `cost` section"):
        SafeRLHF().roles(config("algorithm.name=safe_rlhf"))


def test_missing_free_form_section_and_pool_name_the_key() -> None:
    from hybridflow.algorithms.roles import reward_model_role

    cfg = config()
    with pytest.raises(ConfigError, match=r"section 'roles.judge', which is missing"):
        resolve_section(cfg, reward_model_role("judge", section="roles.judge"))
    cfg = config("roles.judge.pool=elsewhere", "roles.judge.model.preset=tiny-qwen2")
    with pytest.raises(ConfigError, match=r"roles.judge.pool is 'elsewhere'"):
        plan_roles(cfg, [*GRPO().roles(cfg), reward_model_role("judge", section="roles.judge")],
                   tokenizer=build_tokenizer(cfg.model))


def test_duplicate_role_names_are_rejected() -> None:
    cfg = config("reward.model.preset=tiny-qwen2")
    from hybridflow.algorithms.roles import reward_model_role

    with pytest.raises(ConfigError, match=r"declares role\(s\) \['reward_model'\] more than once"):
        plan_roles(cfg, [*GRPO().roles(cfg), reward_model_role()], tokenizer=build_tokenizer(cfg.model))


def test_runtime_gives_declared_roles_by_name_and_rejects_others() -> None:
    actor = object()
    runtime = Runtime(config=None, tokenizer=None, roles={"actor": actor, "safety_rm": None})
    assert runtime.actor is actor and runtime.safety_rm is None
    with pytest.raises(AttributeError, match=r"no role 'critic' in this run; built roles: \['actor', 'safety_rm'\]"):
        runtime.critic  # noqa: B018


def test_outcome_scores_subtract_the_summed_kl() -> None:
    cfg = config("algorithm.kl_coef=0.5")
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    old, ref = torch.randn(2, 4, generator=torch.Generator().manual_seed(0)), torch.zeros(2, 4)
    batch = Batch({"scores": torch.tensor([1.0, 0.0]), "response_mask": mask, "old_log_probs": old,
                   "ref_log_probs": ref})
    runtime = Runtime(config=cfg, tokenizer=None, state=GRPO().build_state(cfg))
    expected = batch["scores"] - 0.5 * (old * mask).sum(-1)     # k1: log π_old − log π_ref, summed over the tokens
    assert torch.allclose(runtime.outcome_scores(batch), expected)
    assert torch.allclose(runtime.token_rewards(batch), build_token_level_rewards(
        batch["scores"], mask, kl_penalty(old, ref, "k1", response_mask=mask), 0.5))
    assert Runtime(config=config(), tokenizer=None).outcome_scores(batch) is batch["scores"]  # no penalty: unchanged


def test_algorithm_state_checks_and_resume_mismatch() -> None:
    with pytest.raises(PluginValidationError, match="state_dict"):
        check_algorithm_state("mine", {"ema": 3.0})
    state = {"kl_controller": FixedKLController(0.1)}
    load_algorithm_state("ppo", state, {"algorithm": {"kl_controller": {"kind": "FixedKLController", "value": 0.2}}})
    assert state["kl_controller"].value == 0.2
    # a checkpoint written before algorithms owned their state still resumes
    load_algorithm_state("ppo", state, {"kl_controller": {"kind": "FixedKLController", "value": 0.3}, "lagrange": None})
    assert state["kl_controller"].value == 0.3
    with pytest.raises(CheckpointError, match=r"missing \['kl_controller'\], unexpected \['lagrange'\]"):
        load_algorithm_state("ppo", state, {"algorithm": {"lagrange": {}}})
