"""Split and standalone placements as the trainer plans them (no Ray): each role runs on its own pool's device
type, and every role's batch must split evenly over its own pool before any worker starts."""

from __future__ import annotations

import pytest

from hybridflow.algorithms.ppo import PPO
from hybridflow.config import Config, load_config
from hybridflow.errors import ConfigError
from hybridflow.trainer.build import RolePlan, build_tokenizer, plan_roles

SPLIT = ("algorithm.name=ppo", "algorithm.kl_coef=0.01", "reward.model={preset: tiny-qwen2}",
         "resource_pools={a: {devices_per_node: [2]}, b: {devices_per_node: [1]}}",
         "actor.pool=a", "reference.pool=a", "critic.pool=b", "reward.pool=b")


def config(*overrides: str) -> Config:
    return load_config(None, list(overrides))


def plans(cfg: Config) -> dict[str, RolePlan]:
    return {plan.role: plan for plan in plan_roles(cfg, PPO().roles(cfg), tokenizer=build_tokenizer(cfg.model))}


def test_each_role_gets_its_own_pools_device_type() -> None:
    cfg = config(*SPLIT, "resource_pools.b.device=cuda")
    planned = plans(cfg)
    assert {role: plan.pool for role, plan in planned.items()} == {
        "actor": "a", "reference": "a", "critic": "b", "reward_model": "b"}
    assert {role: plan.spec.device for role, plan in planned.items()} == {
        "actor": "cpu", "reference": "cpu", "critic": "cuda", "reward_model": "cuda"}
    # and the other way round: the actor's pool's device reaches no other pool
    cfg = config(*SPLIT, "resource_pools.a.device=cuda")
    assert {role: plan.spec.device for role, plan in plans(cfg).items()} == {
        "actor": "cuda", "reference": "cuda", "critic": "cpu", "reward_model": "cpu"}


def test_standalone_roles_each_on_their_own_pool() -> None:
    pools = "resource_pools={p0: {devices_per_node: [1]}, p1: {devices_per_node: [1]}, " \
            "p2: {devices_per_node: [1]}, p3: {devices_per_node: [1], device: cuda}}"
    cfg = config("algorithm.name=ppo", "algorithm.kl_coef=0.01", "reward.model={preset: tiny-qwen2}", pools,
                 "actor.pool=p0", "reference.pool=p1", "critic.pool=p2", "reward.pool=p3")
    planned = plans(cfg)
    assert sorted(plan.pool for plan in planned.values()) == ["p0", "p1", "p2", "p3"]
    assert planned["reward_model"].spec.device == "cuda" and planned["critic"].spec.device == "cpu"


def test_a_batch_that_does_not_split_over_a_roles_own_pool_is_refused_naming_the_pool() -> None:
    # 6 prompts × 4 samples = 24 rows split over the actor's 2 ranks, but not over a 5-rank critic pool
    cfg = config(*SPLIT, "data.batch_size=6", "resource_pools.b.devices_per_node=[5]")
    with pytest.raises(ConfigError, match=r"critic on pool 'b' \(world size 5, data-parallel size 5\).*6 × 4 = 24 "
                                          r"rows.*multiple of 5"):
        plans(cfg)
    # the same pool with tensor parallelism 5 has one data-parallel rank: every batch splits
    assert plans(config(*SPLIT, "data.batch_size=6", "resource_pools.b.devices_per_node=[5]",
                        "critic.engine=megatron", "reward.engine=megatron",  # tensor parallel: megatron's
                        "critic.parallel.tensor_parallel_size=5", "reward.parallel.tensor_parallel_size=5"))
    with pytest.raises(ConfigError, match=r"reward\.parallel: tensor × pipeline = 2 does not divide the 1 devices of "
                                          r"pool 'b'"):
        plans(config(*SPLIT, "reward.parallel.tensor_parallel_size=2"))


def test_the_actors_pool_is_checked_when_the_config_loads() -> None:
    with pytest.raises(ConfigError, match=r"data.batch_size = 3 prompts.*data-parallel size 2 on pool 'a' "
                                          r"\(world size 2"):
        config(*SPLIT, "data.batch_size=3")
    with pytest.raises(ConfigError, match=r"actor.pool is 'nowhere', not one of resource_pools \(a, b\)"):
        config(*SPLIT, "actor.pool=nowhere")


def test_balance_batch_off_splits_the_updates_in_order_and_a_role_override_still_wins() -> None:
    """``trainer.balance_batch`` (verl's key, default on) keeps the updates' registered ``mesh_balanced``; off, the
    update methods of every role are split in order (``mesh``), unless ``<role>.protocols`` names another."""
    assert all(plan.protocols == {} for plan in plans(config(*SPLIT)).values())
    planned = plans(config(*SPLIT, "trainer.balance_batch=false", "critic.protocols={update_critic: dp_compute}"))
    assert planned["actor"].protocols == {"update_policy": "mesh", "update_policy_chunk": "mesh"}
    assert planned["critic"].protocols == {"update_critic": "dp_compute"}
    assert planned["reference"].protocols == {} and planned["reward_model"].protocols == {}
