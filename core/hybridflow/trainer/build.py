"""Turn a validated :class:`~hybridflow.config.Config` into resource pools, worker groups and role specs.

Roles bound to the same pool share one worker group (colocated: one process per slot holds all of them); roles on
different pools get their own groups (split placement). What each role computes is the algorithm driver's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from hybridflow.config import Config, ModelConfig, ParallelSection, PoolConfig, RayConfig, check_pool_batches
from hybridflow.engines import (
    LoraConfig,
    ModelSpec,
    OptimConfig,
    ParallelConfig,
    RolloutEngineConfig,
    SamplingParams,
    TrainingEngineConfig,
    check_training_features,
)
from hybridflow.errors import ConfigError
from hybridflow.precision import resolve_mixed_precision
from hybridflow.workers import RoleSpec

if TYPE_CHECKING:
    from hybridflow.algorithms.roles import RoleDeclaration
    from hybridflow.controller import ResourcePool
    from hybridflow.workers.judge import JudgeSpec

__all__ = ["RolePlan", "plan_roles", "resolve_section", "build_model_spec", "build_tokenizer", "build_groups",
           "start_ray", "build_resource_pool", "release_worker_group"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RolePlan:
    """One declared role, placed: its pool, its worker class and the spec its worker builds engines from."""

    role: str
    pool: str
    spec: RoleSpec | JudgeSpec
    worker: type[Any]
    protocols: dict[str, str] = field(default_factory=dict)  # method → protocol: the section's overrides


def build_model_spec(model: ModelConfig, *, seed: int, head: str | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from a config section (presets are tiny random-init models with the char tokenizer)."""
    if model.path is not None:
        return ModelSpec(path=model.path, dtype=model.dtype, seed=seed)
    if model.config is not None:
        return ModelSpec(config=dict(model.config), dtype=model.dtype, seed=seed)
    from hybridflow.presets import preset_model_config

    if model.preset is None:
        raise ConfigError("model needs one of path, config or preset; got none of them")
    return ModelSpec(config=preset_model_config(model.preset), dtype=model.dtype, seed=seed)


def build_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer of ``model``: the HF tokenizer saved with ``model.path``, else the presets' char tokenizer."""
    if model.path is not None:
        from hybridflow.model_dir import load_tokenizer

        path = str(model.path)
        fix = ("Fix: create it first (for the README's job: hybridflow sft examples/sft_arithmetic.yaml writes "
               "runs/sft-arithmetic/hf), or point model.path at an existing HF model directory")
        # "name" or "org/name" may be a hub id; anything else is a local directory
        if (path.startswith(("/", ".", "~")) or path.count("/") > 1) and not Path(path).expanduser().is_dir():
            raise ConfigError(f"model.path {path!r} is not a directory (relative to {Path.cwd()}): expected a "
                              f"Hugging Face model directory. {fix}")
        try:
            return load_tokenizer(path)
        except (OSError, ValueError) as exc:  # transformers raises either for a directory without a tokenizer
            raise ConfigError(f"model.path {path!r}: no tokenizer could be loaded from it ({exc}). {fix}") from exc
    from hybridflow.char_tokenizer import build_char_tokenizer

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


def build_lora_config(section: Any) -> LoraConfig | None:
    """The engine's :class:`LoraConfig` from a role section's ``lora`` (None when the section has none or it is
    unset)."""
    lora = getattr(section, "lora", None)
    if lora is None:
        return None
    targets = lora.target_modules
    return LoraConfig(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                      target_modules=targets if isinstance(targets, str) else tuple(targets))


def resolve_section(config: Config, declaration: RoleDeclaration) -> Any:
    """The config section configuring a role: a top-level section (``critic``, ``reward``, ...) or ``roles.<key>``,
    with the keys it leaves unset filled from ``declaration.defaults_from`` (``cost_critic`` ← ``critic``)."""
    path = declaration.section
    head, _, key = path.partition(".")
    if head == "roles" and key:
        section = config.roles.get(key)
    elif not key and head in type(config).model_fields:
        section = getattr(config, head)
    elif head in type(config).model_fields and key in type(getattr(config, head)).model_fields:
        section = getattr(getattr(config, head), key)  # a sub-section: reward.genrm
    else:
        raise ConfigError(f"role {declaration.name!r} is configured by section {path!r}, which is neither a "
                          f"top-level section ({', '.join(type(config).model_fields)}) nor roles.<key>")
    base = None if declaration.defaults_from is None else getattr(config, declaration.defaults_from)
    if section is None and base is None:
        raise ConfigError(f"algorithm {config.algorithm.name!r} needs role {declaration.name!r}, configured by the "
                          f"section {path!r}, which is missing; add it to the config (see the algorithm's docs)")
    if base is None:
        return section
    if section is None:
        return base
    merged = _merge(base.model_dump(), section.model_dump(exclude_unset=True))
    return type(base).model_validate(merged)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _section_model(config: Config, declaration: RoleDeclaration, section: Any) -> ModelConfig:
    if section.model is not None:
        return section.model  # type: ignore[no-any-return]
    if declaration.engine_role == "reward_model":
        raise ConfigError(f"role {declaration.name!r} (a reward model) needs {declaration.section}.model: a path, "
                          "config or preset; the policy's model is not a reward model")
    return config.model


#: built-in role sections an algorithm may leave unbuilt (placement fragments configure every one of them)
OPTIONAL_ROLE_SECTIONS = ("critic", "reference", "cost_critic")


def warn_unbuilt_sections(config: Config, read: set[str]) -> list[str]:
    """Warn (UserWarning) for each of :data:`OPTIONAL_ROLE_SECTIONS` the config sets but no built role reads: its
    keys do nothing in this run. Not an error: a placement fragment (``hybridflow plan``) configures every role's
    pool and parallel sizes whatever the algorithm. Returns the sections warned about."""
    import warnings

    unbuilt = [name for name in OPTIONAL_ROLE_SECTIONS
               if name in config.model_fields_set and getattr(config, name) is not None and name not in read]
    for name in unbuilt:
        keys = sorted(getattr(config, name).model_fields_set)
        warnings.warn(f"{name}.{{{', '.join(keys)}}} is set but algorithm {config.algorithm.name!r} builds no "
                      f"{name} role in this run (roles read: {', '.join(sorted(read))}); those keys do nothing. "
                      f"Remove the {name} section, or pick an algorithm that uses a {name} (e.g. ppo)", stacklevel=3)
    return unbuilt


def plan_roles(config: Config, declarations: list[RoleDeclaration], *, tokenizer: Any,
               algorithm: Any = None) -> list[RolePlan]:
    """Which declared roles run where, with the specs their workers build engines from."""
    from hybridflow.algorithms.losses import PolicyLossConfig, ValueLossConfig, make_actor_loss_fn, make_critic_loss_fn

    names = [declaration.name for declaration in declarations]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"algorithm {config.algorithm.name!r} declares role(s) {duplicates} more than once; each "
                          "role needs its own name (it is the handle, the checkpoint folder and the ledger node)")
    if "actor" not in names:
        raise ConfigError(f"algorithm {config.algorithm.name!r} declares no 'actor' role; the trainer needs one "
                          "(add hybridflow.algorithms.roles.actor_role() to its roles)")
    extra_keys = tuple(getattr(algorithm, "extra_keys", ()))
    unknown = sorted(set(config.algorithm.extra) - set(extra_keys))
    if unknown:
        raise ConfigError(f"algorithm.extra.{unknown[0]} is not an option of algorithm {config.algorithm.name!r} "
                          f"(it reads: {', '.join(extra_keys) or 'none'}); the key would do nothing. Fix: remove it "
                          "or check its spelling in the algorithm's docs")
    read = {declaration.section for declaration in declarations}
    unread = sorted(key for key in config.roles if f"roles.{key}" not in read)
    if unread:
        raise ConfigError(f"roles.{unread[0]} configures a role that algorithm {config.algorithm.name!r} does not "
                          f"declare (its roles read: {', '.join(sorted(read))}); the section would do nothing. Fix: "
                          f"remove roles.{unread[0]}, or choose the algorithm that declares it")
    warn_unbuilt_sections(config, read)
    seed = config.trainer.seed
    threads = config.trainer.threads_per_worker
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sections = {declaration.name: resolve_section(config, declaration) for declaration in declarations}
    # each role's batch over its own pool, before any worker starts
    check_pool_batches(config, {d.section: sections[d.name] for d in declarations})
    plans = []
    for declaration in declarations:
        section = sections[declaration.name]
        device = config.resource_pools[section.pool].device  # each role on its own pool's device type
        kind = declaration.engine_role
        if kind == "judge":  # a rollout engine alone: no training engine to configure
            plans.append(plan_judge(config, declaration, section, device=device))
            continue
        model = build_model_spec(_section_model(config, declaration, section), seed=seed + declaration.seed_offset)
        trainable = kind in ("actor", "critic")
        precision = resolve_mixed_precision(getattr(section, "mixed_precision", "none"), engine=section.engine,
                                            device=device, model=model)
        engine_config = TrainingEngineConfig(
            model=model, parallel=_parallel(section.parallel),
            optim=_optim(config, section) if trainable else OptimConfig(),
            micro_batch_size=section.micro_batch_size, mixed_precision=precision,
            gradient_checkpointing=getattr(section, "gradient_checkpointing", False),
            lora=build_lora_config(section) if kind == "actor" else None,
            use_remove_padding=getattr(section, "use_remove_padding", True),
            max_tokens_per_micro_batch=getattr(section, "max_tokens_per_micro_batch", None),
            **(_router_options(config, section) if kind == "actor" else {}),
            extra=dict(getattr(section, "extra", {})))
        # what the role's config turns on, its engine must have declared (never a crash inside a worker)
        check_training_features(declaration.section, section.engine, engine_config)
        options: dict[str, Any] = {}
        rollout = config.rollout
        # multi-turn: a later turn's prefix holds up to multi_turn.max_tokens earlier ids, and a generate call asks
        # every row for the batch's widest remaining budget (up to rollout.max_new_tokens)
        max_response = rollout.max_new_tokens + rollout.multi_turn.max_tokens if rollout.multi_turn.enable \
            else rollout.max_new_tokens
        if rollout.agent is not None:  # rollout.agent: a call's prompt holds up to agent.max_tokens earlier ids
            max_response = rollout.max_new_tokens + rollout.agent.max_tokens
        if rollout.env is not None:  # rollout.env: a turn's prefix holds up to env.max_tokens earlier ids
            max_response = rollout.max_new_tokens + rollout.env.max_tokens
        # seq-mean-token-sum-norm's constant divisor (Dr. GRPO): the key's, else the longest response possible
        loss_scale_factor = None if getattr(section, "loss_agg", None) != "seq-mean-token-sum-norm" else (
            section.loss_scale_factor or float(max_response))
        if kind == "actor":
            options = {
                "loss": make_actor_loss_fn(PolicyLossConfig(
                    loss_mode=section.loss_mode, clip_ratio_low=section.clip_ratio_low,
                    clip_ratio_high=section.clip_ratio_high, dual_clip_c=section.clip_ratio_c,
                    entropy_coef=section.entropy_coef, adaptive_entropy=section.entropy_target is not None,
                    kl_loss_coef=section.kl_loss_coef,
                    kl_loss_kind=section.kl_loss_kind, loss_agg=section.loss_agg, loss_scale_factor=loss_scale_factor,
                    rollout_correction=config.algorithm.rollout_correction,
                    rollout_correction_threshold=config.algorithm.rollout_correction_threshold,
                    rollout_correction_level=config.algorithm.rollout_correction_level)),
                "rollout_engine": rollout.engine,
                "rollout_config": RolloutEngineConfig(
                    model=rollout_model_spec(model, rollout.dtype, precision),
                    tensor_parallel_size=rollout.tensor_parallel_size,
                    max_prompt_length=config.data.max_prompt_length, max_new_tokens=max_response,
                    pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id, seed=seed, extra=dict(rollout.extra)),
                "sampling": SamplingParams(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p,
                                           top_k=rollout.top_k, max_new_tokens=rollout.max_new_tokens, seed=seed),
                "extra": {"multi_turn": _multi_turn_options(config, tokenizer),
                          **_agent_options(config, tokenizer), **_env_options(config, tokenizer)}}
        elif kind == "critic":
            options = {"loss": make_critic_loss_fn(ValueLossConfig(clip_range=section.value_clip or None,
                                                                   loss_agg=section.loss_agg,
                                                                   loss_scale_factor=loss_scale_factor))}
        if trainable:
            options.update(mini_batch_size=section.mini_batch_size, epochs=section.ppo_epochs)
        plans.append(RolePlan(role=declaration.name, pool=section.pool, worker=declaration.worker,
                              protocols=_role_protocols(config, declaration.worker, section), spec=RoleSpec(
            role=kind, name=declaration.name, engine=section.engine, device=device, threads=threads,
            engine_config=engine_config, output_key=declaration.output_key, **options)))
    return plans


def plan_judge(config: Config, declaration: RoleDeclaration, section: Any, *, device: str) -> RolePlan:
    """The judge role of ``reward.genrm`` (``section``), checked on the driver before any worker starts: its
    tokenizer loads from the judge's model, its verdict parser resolves, its chat template exists when asked for."""
    from hybridflow.genrm import resolve_verdict_parser
    from hybridflow.workers.judge import JudgeSpec

    key = declaration.section
    model = section.model
    try:
        tokenizer = build_tokenizer(model)
    except ConfigError as exc:
        raise ConfigError(f"{key}.{exc}") from None
    if section.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        source = model.path or "the presets' character tokenizer"
        raise ConfigError(f"{key}.apply_chat_template is true, but the judge's tokenizer ({source}) has no chat "
                          f"template. Fix: set {key}.apply_chat_template=false, or point {key}.model.path at a chat "
                          "model directory")
    resolve_verdict_parser(section.parser, key=f"{key}.parser")
    rollout = section.rollout
    seed = config.trainer.seed
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    spec = JudgeSpec(
        name=declaration.name, engine=rollout.name, device=device, threads=config.trainer.threads_per_worker,
        rollout_config=RolloutEngineConfig(
            model=build_model_spec(model, seed=seed + 6), max_prompt_length=rollout.prompt_length,
            max_new_tokens=rollout.response_length, pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id,
            seed=seed, extra=dict(rollout.extra)),
        sampling=SamplingParams(n=1, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                                max_new_tokens=rollout.response_length, seed=seed),
        template=section.template, parser=section.parser, apply_chat_template=section.apply_chat_template,
        policy_model_path=config.role_model(config.actor).path, judge_model_path=model.path,
        micro_batch_size=section.micro_batch_size, timeout_s=section.timeout_s, failed_score=section.failed_score)
    return RolePlan(role=declaration.name, pool=section.pool, worker=declaration.worker, spec=spec)


def _router_options(config: Config, section: Any) -> dict[str, Any]:
    """The actor's mixture-of-experts keys (docs/guide/moe.md) as engine options, after checking that its engines
    declare what they need: ``replays_routing`` (training) for any of them, ``records_routing`` (rollout) for R3."""
    from hybridflow.engines import require_capability

    mode = section.router_replay.mode
    options = {"router_replay": mode, "router_aux_loss_coef": section.router_aux_loss_coef,
               "router_z_loss_coef": section.router_z_loss_coef}
    used = [key for key, on in (("router_replay.mode", mode != "disabled"),
                                ("router_aux_loss_coef", section.router_aux_loss_coef > 0),
                                ("router_z_loss_coef", section.router_z_loss_coef > 0)) if on]
    if used:
        require_capability("training", section.engine, "replays_routing", needed_for=f"actor.{used[0]}",
                           fix=f"use actor.engine=fsdp, or remove actor.{used[0]}")
    if mode == "R3":
        if config.rollout.multi_turn.enable or config.rollout.agent is not None or config.rollout.env is not None:
            raise ConfigError("actor.router_replay.mode=R3 replays the experts the rollout engine recorded in "
                              "generate; multi-turn and agent rollouts assemble their rows from several calls and "
                              "record none. Fix: set actor.router_replay.mode=disabled, or run single-turn rollouts")
        require_capability("rollout", config.rollout.engine, "records_routing",
                           needed_for="actor.router_replay.mode=R3 (the rollout records each token's experts)",
                           fix="use rollout.engine=hf, or set actor.router_replay.mode=disabled")
    return options


def _role_protocols(config: Config, worker: type, section: Any) -> dict[str, str]:
    """A role's protocol overrides: ``<section>.protocols``, over ``mesh`` for the methods that deal rows by tokens
    (``mesh_balanced``: the updates) when ``trainer.balance_batch`` is off."""
    from hybridflow.controller.decorator import dispatch_of
    from hybridflow.controller.handles import registered_methods

    defaults = {} if config.trainer.balance_batch else {
        name: "mesh" for name in registered_methods(worker)
        if getattr(dispatch_of(getattr(worker, name)), "protocol", None) == "mesh_balanced"}
    return {**defaults, **dict(getattr(section, "protocols", None) or {})}


def role_mapping(config: Config, plans: list[RolePlan]) -> dict[str, dict[str, Any]]:
    """The run manifest's ``mapping``: each declared role as built (pool, devices, engine, layout, the precision
    ``mixed_precision: auto`` resolved to, worker class) and the rollout (engine, pool, tg, generation dtype)."""
    mapping: dict[str, dict[str, Any]] = {
        p.role: {"pool": p.pool, "devices": config.resource_pools[p.pool].world_size, "engine": p.spec.engine,
                 **({"parallel": str(p.spec.engine_config.parallel),
                     "mixed_precision": p.spec.engine_config.mixed_precision} if isinstance(p.spec, RoleSpec) else {}),
                 "worker": f"{p.worker.__module__}.{p.worker.__qualname__}", "model": p.spec.role}
        for p in plans}
    mapping["rollout"] = {"engine": config.rollout.engine, "pool": config.rollout.pool or config.actor.pool,
                          "tensor_parallel_size": config.rollout.tensor_parallel_size,
                          "dtype": next((p.spec.rollout_config.model.dtype for p in plans
                                         if isinstance(p.spec, RoleSpec) and p.spec.rollout_config is not None),
                                        None)}
    return mapping


def rollout_model_spec(model: ModelSpec, dtype: str, mixed_precision: str) -> ModelSpec:
    """The actor's model spec at the generation dtype ``rollout.dtype`` (``auto``: bfloat16 when the actor computes
    in bf16, else the actor model's own dtype)."""
    if dtype == "auto":
        dtype = "bfloat16" if mixed_precision == "bf16" else model.dtype
    return model if dtype == model.dtype else replace(model, dtype=cast(Any, dtype))


def _multi_turn_options(config: Config, tokenizer: Any) -> dict[str, Any]:
    """``rollout.multi_turn`` as the actor worker's agent path reads it (hybridflow.agent.worker); checked here so a
    run that cannot work fails before any worker starts."""
    section = config.rollout.multi_turn
    if section.enable and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("rollout.multi_turn.enable needs a tokenizer with a chat template (it writes the tool "
                          "turns); the model's tokenizer has none (the presets' char tokenizer never does). Fix: "
                          "set actor.model.path to an HF model directory saved with a chat tokenizer")
    if section.enable:
        # fail closed before any worker starts: a code-running tool without its sandbox raises here, naming the fix
        from hybridflow.tools import build_tools

        build_tools(list(section.tools), section.tool_options)
    return section.model_dump()


def _agent_options(config: Config, tokenizer: Any) -> dict[str, Any]:
    """``rollout.agent`` as the actor worker's agent path reads it (hybridflow.agent.code_agent), the entry resolved
    to an absolute path and loaded once here, so a run whose agent cannot load fails before any worker starts."""
    section = config.rollout.agent
    if section is None:
        return {}
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("rollout.agent needs a tokenizer with a chat template (the endpoint renders the agents' chat "
                          "messages with it); the model's tokenizer has none. Fix: set actor.model.path to an HF model "
                          "directory saved with a chat tokenizer")
    from hybridflow.agent.code_agent import load_agent_entry

    options = section.model_dump()
    target, _, name = section.entry.rpartition(":")
    if target.endswith(".py"):
        options["entry"] = f"{Path(target).expanduser().resolve()}:{name}"
    load_agent_entry(options["entry"])
    return {"agent": options}


def _env_options(config: Config, tokenizer: Any) -> dict[str, Any]:
    """``rollout.env`` as the actor worker's environment path reads it (hybridflow.agent.env_rollout); an entry
    class is imported once here, so a run whose environment cannot load fails before any worker starts."""
    section = config.rollout.env
    if section is None:
        return {}
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("rollout.env needs a tokenizer with a chat template (it writes the environment's turns); "
                          "the model's tokenizer has none. Fix: set actor.model.path to an HF model directory saved "
                          "with a chat tokenizer")
    if section.entry is not None:
        from hybridflow.agent.environment import load_environment_class

        load_environment_class(section.entry)
    return {"env": section.model_dump()}


def start_ray(ray: RayConfig) -> None:
    """Start a local Ray sized by the ``ray`` section, or join the cluster at ``ray.address``."""
    from hybridflow.controller import init_ray

    if ray.address is None:
        init_ray(num_cpus=ray.num_cpus, object_store_memory=ray.object_store_memory)
    else:
        init_ray(ray.address, allow_remote_without_auth=ray.allow_remote_without_auth)


def build_resource_pool(name: str, pool: PoolConfig) -> ResourcePool:
    """The resource pool ``resource_pools.<name>`` describes (a CPU pool with its ``cpus_per_worker``)."""
    from hybridflow.controller import ResourcePool

    if pool.device == "cuda":
        return ResourcePool(name, devices_per_node=list(pool.devices_per_node), device="cuda",
                            ready_timeout_s=pool.ready_timeout_s)
    return ResourcePool(name, devices_per_node=list(pool.devices_per_node), device="cpu",
                        cpus_per_worker=pool.cpus_per_worker, ready_timeout_s=pool.ready_timeout_s)


def release_worker_group(group: Any, pool: Any) -> None:
    """Close a worker group (its processes parked for the next run when it ended cleanly), then release its
    resource pool (either may be None: never built)."""
    if group is not None:
        group.close()
    if pool is not None:
        pool.release()


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
        """Close every group (processes parked for the next run when it ended cleanly: WorkerGroup.close), then
        release the pools."""
        for group in self.by_pool.values():
            group.close()
        for pool in self.pools.values():
            pool.release()
        self.by_pool.clear()
        self.pools.clear()


#: config section of each built-in role whose name differs from it (``<section>.protocols`` overrides the
#: protocols of its worker methods)
def build_groups(config: Config, plans: list[RolePlan], *, deadline_s: float, stack_dump_dir: str | None,
                 observers: list[Any] | None = None) -> Groups:
    """Create one resource pool per configured pool in use and one worker group per pool.

    ``observers``: the call observers every group shares (the very list: the run's owner adds and removes them).
    """
    from hybridflow.controller import WorkerGroup

    groups = Groups()
    by_pool: dict[str, list[RolePlan]] = {}
    for plan in plans:
        by_pool.setdefault(plan.pool, []).append(plan)
    for pool_name, pool_plans in by_pool.items():
        pool = build_resource_pool(pool_name, config.resource_pools[pool_name])
        groups.pools[pool_name] = pool
        classes = {plan.role: plan.worker for plan in pool_plans}
        init_kwargs = {plan.role: {"spec": plan.spec} for plan in pool_plans}
        protocols = {plan.role: plan.protocols for plan in pool_plans}
        groups.by_pool[pool_name] = WorkerGroup(pool, classes, init_kwargs=init_kwargs, name=pool_name,
                                                deadline_s=deadline_s, stack_dump_dir=stack_dump_dir,
                                                protocols=protocols, observers=observers)
        for plan in pool_plans:
            groups.role_pool[plan.role] = pool_name
    return groups
