"""Turn a validated :class:`~hybridflow.config.Config` into resource pools, worker groups and role specs.

Roles bound to the same pool share one worker group (colocated: one process per slot holds all of them); roles on
different pools get their own groups (split placement). What each role computes is the algorithm driver's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.config import Config, CriticConfig, ModelConfig, ParallelSection, ReferenceConfig, RewardConfig
from hybridflow.engines import (
    ModelSpec,
    OptimConfig,
    ParallelConfig,
    RolloutEngineConfig,
    SamplingParams,
    TrainingEngineConfig,
)
from hybridflow.errors import ConfigError
from hybridflow.workers import ActorRolloutWorker, CriticWorker, ReferenceWorker, RewardModelWorker, RoleSpec

__all__ = ["RolePlan", "plan_roles", "build_model_spec", "build_tokenizer", "build_groups"]

WORKER_CLASSES: dict[str, type] = {
    "actor": ActorRolloutWorker,
    "critic": CriticWorker,
    "reference": ReferenceWorker,
    "reward_model": RewardModelWorker,
    "cost_model": RewardModelWorker,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class RolePlan:
    role: str
    pool: str
    spec: RoleSpec


def build_model_spec(model: ModelConfig, *, seed: int, head: str | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from a config section (presets are tiny random-init models with the char tokenizer)."""
    if model.path is not None:
        return ModelSpec(path=model.path, dtype=model.dtype, seed=seed)
    if model.config is not None:
        return ModelSpec(config=dict(model.config), dtype=model.dtype, seed=seed)
    from hybridflow.testing.fixtures import tiny_model_config

    presets: dict[str, dict[str, Any]] = {
        "tiny-qwen2": {},
        "tiny-qwen2-h16": {"num_heads": 4, "num_kv_heads": 2},
        "tiny-llama": {"architecture": "llama"},
    }
    assert model.preset is not None
    return ModelSpec(config=tiny_model_config(**presets[model.preset]), dtype=model.dtype, seed=seed)


def build_tokenizer(model: ModelConfig) -> Any:
    if model.path is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model.path)
    from hybridflow.testing.fixtures import build_char_tokenizer

    return build_char_tokenizer()


def _parallel(section: ParallelSection) -> ParallelConfig:
    return ParallelConfig(tensor_parallel_size=section.tensor_parallel_size,
                          pipeline_parallel_size=section.pipeline_parallel_size,
                          data_parallel_size=section.data_parallel_size)


def _optim(config: Config, section: Any) -> OptimConfig:
    optim = section.optim
    return OptimConfig(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                       warmup_steps=optim.warmup_steps, total_steps=config.trainer.total_steps,
                       schedule=optim.schedule, min_lr_ratio=optim.min_lr_ratio, grad_clip=optim.grad_clip)


def plan_roles(config: Config, *, needs_critic: bool, needs_reference: bool, loss_configs: dict[str, Any],
               tokenizer: Any) -> list[RolePlan]:
    """Which roles run where, with the specs their workers build engines from."""
    _check_pools(config, needs_critic=needs_critic, needs_reference=needs_reference)
    from hybridflow.algorithms.losses import make_actor_loss_fn, make_critic_loss_fn

    seed = config.trainer.seed
    device = config.resource_pools[config.actor.pool].device
    threads = config.trainer.threads_per_worker
    actor_model = build_model_spec(config.role_model(config.actor), seed=seed)
    rollout = config.rollout
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    plans = [RolePlan(role="actor", pool=config.actor.pool, spec=RoleSpec(
        role="actor", engine=config.actor.engine, device=device, threads=threads,
        engine_config=TrainingEngineConfig(model=actor_model, parallel=_parallel(config.actor.parallel),
                                           optim=_optim(config, config.actor),
                                           micro_batch_size=config.actor.micro_batch_size,
                                           mixed_precision=config.actor.mixed_precision,
                                           extra=dict(config.actor.extra)),
        loss=make_actor_loss_fn(loss_configs["actor"]), mini_batch_size=config.actor.mini_batch_size,
        epochs=config.actor.ppo_epochs, rollout_engine=rollout.engine,
        rollout_config=RolloutEngineConfig(model=actor_model, tensor_parallel_size=rollout.tensor_parallel_size,
                                           max_prompt_length=config.data.max_prompt_length,
                                           max_new_tokens=rollout.max_new_tokens, pad_token_id=pad_id,
                                           eos_token_id=tokenizer.eos_token_id, seed=seed, extra=dict(rollout.extra)),
        sampling=SamplingParams(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p,
                                top_k=rollout.top_k, max_new_tokens=rollout.max_new_tokens, seed=seed),
    ))]
    if needs_critic:
        critic = config.critic
        plans.append(RolePlan(role="critic", pool=critic.pool, spec=RoleSpec(
            role="critic", engine=critic.engine, device=device, threads=threads,
            engine_config=TrainingEngineConfig(model=build_model_spec(config.role_model(critic), seed=seed + 1),
                                               parallel=_parallel(critic.parallel), optim=_optim(config, critic),
                                               micro_batch_size=critic.micro_batch_size, extra=dict(critic.extra)),
            loss=make_critic_loss_fn(loss_configs["critic"]), mini_batch_size=critic.mini_batch_size,
            epochs=critic.ppo_epochs)))
    if needs_reference:
        reference = config.reference
        plans.append(RolePlan(role="reference", pool=reference.pool, spec=RoleSpec(
            role="reference", engine=reference.engine, device=device, threads=threads,
            engine_config=TrainingEngineConfig(model=build_model_spec(config.role_model(reference), seed=seed),
                                               parallel=_parallel(reference.parallel),
                                               micro_batch_size=reference.micro_batch_size,
                                               extra=dict(reference.extra)))))
    for role, section, key in (("reward_model", config.reward, "scores"), ("cost_model", config.cost, "costs")):
        if section is not None and section.model is not None:
            plans.append(RolePlan(role=role, pool=section.pool, spec=RoleSpec(
                role="reward_model", engine=section.engine, device=device, threads=threads, output_key=key,
                engine_config=TrainingEngineConfig(model=build_model_spec(section.model, seed=seed + 2),
                                                   parallel=_parallel(section.parallel),
                                                   micro_batch_size=section.micro_batch_size))))
    return plans


def _check_pools(config: Config, *, needs_critic: bool, needs_reference: bool) -> None:
    used: list[tuple[str, CriticConfig | ReferenceConfig | RewardConfig | None, bool]] = [
        ("critic", config.critic, needs_critic), ("reference", config.reference, needs_reference),
        ("reward", config.reward, config.reward.model is not None),
        ("cost", config.cost, config.cost is not None and config.cost.model is not None)]
    for key, section, in_use in used:
        if in_use and section is not None and section.pool not in config.resource_pools:
            raise ConfigError(f"{key}.pool is {section.pool!r}, not one of resource_pools "
                              f"({', '.join(config.resource_pools)}); add the pool or change {key}.pool")


@dataclass(slots=True)
class Groups:
    """The worker groups of a run, by pool, and which pool hosts each role."""

    by_pool: dict[str, Any] = field(default_factory=dict)
    role_pool: dict[str, str] = field(default_factory=dict)
    pools: dict[str, Any] = field(default_factory=dict)

    def role(self, name: str) -> Any | None:
        pool = self.role_pool.get(name)
        return None if pool is None else getattr(self.by_pool[pool], name)

    def group_of(self, role: str) -> Any:
        """The worker group hosting ``role``."""
        return self.by_pool[self.role_pool[role]]

    def shutdown(self) -> None:
        for group in self.by_pool.values():
            group.shutdown()
        for pool in self.pools.values():
            pool.release()
        self.by_pool.clear()
        self.pools.clear()


def build_groups(config: Config, plans: list[RolePlan], *, deadline_s: float, stack_dump_dir: str | None) -> Groups:
    """Create one resource pool per configured pool in use and one worker group per pool."""
    from hybridflow.controller import ResourcePool, WorkerGroup

    groups = Groups()
    by_pool: dict[str, list[RolePlan]] = {}
    for plan in plans:
        by_pool.setdefault(plan.pool, []).append(plan)
    for pool_name, pool_plans in by_pool.items():
        pool_config = config.resource_pools[pool_name]
        if pool_config.device == "cuda":
            pool = ResourcePool(pool_name, devices_per_node=list(pool_config.devices_per_node), device="cuda")
        else:
            pool = ResourcePool(pool_name, devices_per_node=list(pool_config.devices_per_node), device="cpu",
                                cpus_per_worker=pool_config.cpus_per_worker)
        groups.pools[pool_name] = pool
        classes = {plan.role: WORKER_CLASSES[plan.role] for plan in pool_plans}
        init_kwargs = {plan.role: {"spec": plan.spec} for plan in pool_plans}
        groups.by_pool[pool_name] = WorkerGroup(pool, classes, init_kwargs=init_kwargs, name=pool_name,
                                                deadline_s=deadline_s, stack_dump_dir=stack_dump_dir)
        for plan in pool_plans:
            groups.role_pool[plan.role] = pool_name
    return groups
