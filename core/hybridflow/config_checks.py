"""Cross-section checks of a run configuration: batches against pools, the generation layout, the async rollout pool,
and engine names against the registries — each error names the key, what was wrong and the fix.

Each takes the validated ``hybridflow.config.Config`` (typed ``Any`` here: hybridflow.config imports this module, and
the core keeps its modules free of import cycles, even under TYPE_CHECKING)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError

__all__ = ["check_pool_batches", "check_registered_names", "check_generation_layout", "check_async",
           "check_streaming", "check_partial_rollout"]


def check_async(config: Any) -> None:
    """``rollout.pool``, ``trainer.max_staleness``, ``algorithm.rollout_correction`` (docs/guide/async.md) and
    ``algorithm.filter_groups`` against them."""
    pool = config.rollout.pool
    if config.algorithm.filter_groups.enable:
        if pool is not None:
            raise ValueError("algorithm.filter_groups draws more prompts inside a step when its groups are all "
                             f"equal, but rollout.pool = {pool!r} generates each step's rollout ahead of the step. "
                             "Fix: remove rollout.pool, or set algorithm.filter_groups.enable=false")
        if config.rollout.n < 2:
            raise ValueError(f"algorithm.filter_groups keeps prompt groups whose n samples disagree, but rollout.n = "
                             f"{config.rollout.n} (a group of one never disagrees). Fix: set rollout.n >= 2")
    if config.trainer.max_staleness and pool is None:
        raise ValueError(f"trainer.max_staleness = {config.trainer.max_staleness} generates on a rollout pool of "
                         "its own while the actor trains, but rollout.pool is not set. Fix: add a pool to "
                         "resource_pools and set rollout.pool to it, or set trainer.max_staleness=0")
    if config.trainer.stream_mini_batches:
        check_streaming(config)
    check_partial_rollout(config)
    algorithm = config.algorithm
    if algorithm.rollout_correction == "none" and algorithm.rollout_correction_level != "token":
        raise ValueError(f"algorithm.rollout_correction_level = {algorithm.rollout_correction_level} sets the level "
                         "of the off-policy correction's ratio, but algorithm.rollout_correction is none (no weight "
                         "at any level). Fix: set algorithm.rollout_correction=tis or mis, or remove "
                         "algorithm.rollout_correction_level")
    if config.algorithm.rollout_correction != "none" and not config.actor.recompute_log_probs:
        raise ValueError(f"algorithm.rollout_correction = {config.algorithm.rollout_correction} weighs tokens by "
                         "π_old / π_rollout, but with actor.recompute_log_probs=false π_old is the rollout's own "
                         "log-prob (the weight is always 1). Fix: set actor.recompute_log_probs=true")
    if pool is None:
        if config.rollout.weight_sync != "object_store":
            raise ValueError(f"rollout.weight_sync = {config.rollout.weight_sync} sends the actor's weights to a "
                             "rollout pool of its own, but rollout.pool is not set. Fix: set rollout.pool, or "
                             "remove rollout.weight_sync")
        default = type(config.rollout).model_fields["weight_sync_bucket_bytes"].default
        if config.rollout.weight_sync_bucket_bytes != default:
            raise ValueError(f"rollout.weight_sync_bucket_bytes = {config.rollout.weight_sync_bucket_bytes} sizes the "
                             "weight sync to a rollout pool of its own, but rollout.pool is not set (the actor's own "
                             "rollout engine gets its weights by the in-place handover). Fix: set rollout.pool, or "
                             "remove rollout.weight_sync_bucket_bytes")
        return
    if pool not in config.resource_pools:
        raise ValueError(f"rollout.pool = {pool!r} is not a pool of resource_pools ({sorted(config.resource_pools)})"
                         f". Fix: add resource_pools.{pool} or name an existing pool")
    if pool == config.actor.pool:
        raise ValueError(f"rollout.pool = {pool!r} is the actor's pool: the actor already generates on its own "
                         "ranks there. Fix: give the rollout a pool of its own, or remove rollout.pool")
    if config.rollout.tensor_parallel_size != 1 or config.rollout.multi_turn.enable:
        raise ValueError("rollout.pool generates single-turn at rollout.tensor_parallel_size = 1 only (got "
                         f"tensor_parallel_size={config.rollout.tensor_parallel_size}, multi_turn.enable="
                         f"{config.rollout.multi_turn.enable}). Fix: remove rollout.pool, or use tg = 1 single-turn")
    world = config.resource_pools[pool].world_size
    if config.data.batch_size % world:
        raise ValueError(f"data.batch_size = {config.data.batch_size} prompts must be a multiple of the rollout "
                         f"pool's {world} workers (rollout.pool = {pool!r})")


def check_partial_rollout(config: Any) -> None:
    """``rollout.partial_rollout`` (docs/guide/async.md): segments of a rollout pool's generation, weights loaded
    between them. The engine's capability (``continue_from_tokens``) is checked by the rollout worker when it builds
    it."""
    rollout = config.rollout
    if not rollout.partial_rollout:
        default = type(rollout).model_fields["partial_rollout_tokens"].default
        if rollout.partial_rollout_tokens != default:
            raise ValueError(f"rollout.partial_rollout_tokens = {rollout.partial_rollout_tokens} sizes the segments "
                             "of a partial rollout, but rollout.partial_rollout is false. Fix: set "
                             "rollout.partial_rollout=true, or remove rollout.partial_rollout_tokens")
        return
    what = "rollout.partial_rollout loads weights synced while a generation is in flight between its segments"
    if rollout.pool is None:
        raise ValueError(f"{what}, but rollout.pool is not set (the actor's own generation never overlaps a weight "
                         "update). Fix: set rollout.pool (and trainer.max_staleness >= 1 for updates to land "
                         "mid-generation), or set rollout.partial_rollout=false")
    if rollout.weight_sync != "object_store":
        raise ValueError(f"{what} from the object store, but rollout.weight_sync = {rollout.weight_sync} broadcasts "
                         "them when the rollout pool reaches the sync in its queue. Fix: set "
                         "rollout.weight_sync=object_store, or rollout.partial_rollout=false")
    if config.trainer.stream_mini_batches:
        raise ValueError(f"{what}; streamed mini-batches (trainer.stream_mini_batches) are not combined with it "
                         "yet. Fix: set one of trainer.stream_mini_batches, rollout.partial_rollout to false")


def check_generation_layout(config: Any, world: int) -> None:
    """``rollout.tensor_parallel_size = tg``: the actor generates at (pg = 1, tg) on its own ranks, so tg must
    divide them, the prompts must split over the world / tg generation replicas, and the model's heads, KV heads,
    intermediate size and vocabulary must split over tg (the training engine's own mesh is checked when the
    actor starts)."""
    tensor = config.rollout.tensor_parallel_size
    if world % tensor:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"rollout.tensor_parallel_size = {tensor} must divide the actor's {world} ranks (pool "
                         f"{config.actor.pool!r}): generation runs on the actor's ranks, tg ranks per replica. "
                         f"Fix: pick one of {divisors}")
    if config.data.batch_size % (world // tensor):
        raise ValueError(f"data.batch_size = {config.data.batch_size} prompts must be a multiple of the "
                         f"{world // tensor} generation replicas (actor ranks {world} / rollout."
                         f"tensor_parallel_size {tensor})")
    if tensor == 1:
        return
    rollout_info, training_info = _engine_infos(config)
    engine = config.rollout.engine
    if training_info is not None and "reshards_generation_weights" not in training_info.capabilities:
        raise ValueError(f"rollout.tensor_parallel_size = {tensor} needs a training engine with capability "
                         f'"reshards_generation_weights" (it hands the actor\'s weights over as tensor-parallel '
                         f'generation shards); actor.engine = {config.actor.engine} declares '
                         f"{sorted(training_info.capabilities) or 'none'}. Fix: set rollout.tensor_parallel_size=1 or "
                         "an actor.engine that declares it (fsdp, megatron, deepspeed)")
    if rollout_info is not None and "generates_tensor_parallel" not in rollout_info.capabilities:
        raise ValueError(f"rollout.tensor_parallel_size = {tensor} needs a rollout engine with capability "
                         f'"generates_tensor_parallel" (tensor-parallel generation on the actor\'s own ranks); '
                         f"rollout.engine = {engine} declares {sorted(rollout_info.capabilities) or 'none'}. Fix: set "
                         "rollout.tensor_parallel_size=1 or a rollout.engine that declares it (hf, vllm)")
    if rollout_info is not None and rollout_info.tensor_parallel_world == "whole" and world != tensor:
        raise ValueError(f"rollout.engine = {engine} generates tensor-parallel on the actor's own ranks in groups of "
                         f"consecutive ranks of the whole world (its info record: tensor_parallel_world = whole); the "
                         f"hybrid engine's generation layout at {world} ranks / tg = {tensor} draws strided tensor "
                         f"groups (micro-DP {world // tensor}, docs/guide/vllm.md). Expected "
                         f"rollout.tensor_parallel_size = {world} (the actor's world) or 1, got {tensor}. Fix: set "
                         f"rollout.tensor_parallel_size={world} or 1, or rollout.engine=hf")
    if config.rollout.multi_turn.enable:
        raise ValueError(f"rollout.multi_turn runs each conversation's turns on one rank; it does not run at "
                         f"rollout.tensor_parallel_size = {tensor} (a tool's timing could make the ranks of a "
                         "tensor group diverge inside a collective). Fix: set rollout.tensor_parallel_size=1")
    hf_config = _hf_config_of(config.role_model(config.actor))
    if hf_config is None:
        return
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = hf_config.get(key)
        if isinstance(value, int) and value % tensor:
            raise ValueError(f"rollout.tensor_parallel_size = {tensor} must divide the actor model's {key} = "
                             f"{value} (tensor-parallel generation splits it over the tensor ranks). Fix: pick a "
                             f"size dividing it, or a model whose {key} it divides (model.preset=tiny-qwen2-4h "
                             "shards over 2)")
    vocab, multiple = hf_config.get("vocab_size"), rollout_info.vocab_multiple if rollout_info is not None else 1
    if multiple > 1 and isinstance(vocab, int) and vocab % multiple:
        raise ValueError(f"rollout.engine = {engine} at rollout.tensor_parallel_size = {tensor} loads each rank's "
                         f"vocabulary shard as is, but pads the vocabulary to a multiple of {multiple} before "
                         f"splitting it (its info record: vocab_multiple = {multiple}), so its rows per rank differ "
                         f"from the even split unless the vocabulary is such a multiple: expected vocab_size % "
                         f"{multiple} == 0, got vocab_size = {vocab}. Fix: pad the model's vocab_size to a multiple "
                         f"of {multiple}, or set rollout.tensor_parallel_size=1")


def _engine_infos(config: Any) -> tuple[Any, Any]:
    """What the run's rollout and actor engines declared at registration (plugins load here); None for a name no
    plugin registered (check_registered_names reports it)."""
    from hybridflow import registries
    from hybridflow.engines import rollout_engine_info, training_engine_info
    from hybridflow.plugins import load_plugins

    load_plugins()
    rollout = rollout_engine_info(config.rollout.engine) if config.rollout.engine in registries.rollout_engines \
        else None
    training = training_engine_info(config.actor.engine) if config.actor.engine in registries.training_engines \
        else None
    return rollout, training


def _hf_config_of(model: Any) -> dict[str, Any] | None:
    """The HF config dict of a model section (a preset's, the inline one, or ``path/config.json``), None if unread."""
    if model.config is not None:
        return dict(model.config)
    if model.preset is not None:
        from hybridflow.presets import preset_model_config

        return preset_model_config(model.preset)
    config_file = Path(str(model.path)) / "config.json"
    if not config_file.is_file():
        return None
    loaded = json.loads(config_file.read_text(encoding="utf-8"))
    return loaded if isinstance(loaded, dict) else None


def check_registered_names(config: Any) -> None:
    """Engine, algorithm and ``<role>.protocols`` names must exist in the registries (call after loading plugins)."""
    from hybridflow import registries

    checks = [
        ("actor.engine", registries.training_engines, config.actor.engine),
        ("rollout.engine", registries.rollout_engines, config.rollout.engine),
        ("algorithm.name", registries.algorithms, config.algorithm.name),
    ]
    sections: dict[str, Any] = {"actor": config.actor, "critic": config.critic, "reference": config.reference,
                                "reward": config.reward, "cost": config.cost, "cost_critic": config.cost_critic,
                                **{f"roles.{key}": section for key, section in config.roles.items()}}
    checks += [(f"{key}.protocols.{method}", registries.transfer_protocols, protocol)
               for key, section in sections.items() if section is not None
               for method, protocol in section.protocols.items()]
    if config.reward.genrm is not None:
        checks.append(("reward.genrm.rollout.name", registries.rollout_engines, config.reward.genrm.rollout.name))
    if config.rollout.multi_turn.enable:
        checks += [(f"rollout.multi_turn.tools[{index}]", registries.tools, name)
                   for index, name in enumerate(config.rollout.multi_turn.tools)]
    for key, registry, name in checks:
        if name not in registry:
            try:
                registry.get(name)
            except KeyError as exc:
                raise ConfigError(f"{key}: {exc}") from None


def check_pool_batches(config: Any, sections: dict[str, Any], *, error: type[Exception] = ConfigError) -> None:
    """Every role's batch splits evenly over its own pool: ``{key: section}`` (``key`` as the config names the
    section, e.g. ``critic`` or ``roles.teacher``), each with ``pool`` and ``parallel``.

    tensor × pipeline must divide the pool's devices; the actor's prompts (``data.batch_size``) and every role's
    rows (``data.batch_size × rollout.n``) must be multiples of that role's data-parallel size on its pool.

    Raises:
        ``error`` (ConfigError by default): naming the section, the pool, its world size and the batch.
    """
    prompts, samples = config.data.batch_size, config.rollout.n
    for key, section in sections.items():
        pool_name = section.pool
        pool = config.resource_pools.get(pool_name)
        if pool is None:
            raise error(f"{key}.pool is {pool_name!r}, not one of resource_pools ({', '.join(config.resource_pools)})"
                        f"; add the pool or change {key}.pool")
        world = pool.world_size
        parallel = getattr(section, "parallel", None)  # None: a role without model parallelism (reward.genrm)
        model_parallel = 1 if parallel is None else parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        if world % model_parallel:
            raise error(f"{key}.parallel: tensor × pipeline = {model_parallel} does not divide the {world} devices of "
                        f"pool {pool_name!r}; fix: set resource_pools.{pool_name}.devices_per_node to a multiple of "
                        f"{model_parallel} or lower the parallel sizes")
        data_parallel = world // model_parallel
        if key == "actor" and prompts % data_parallel:
            raise error(f"data.batch_size = {prompts} prompts must be a multiple of the actor's data-parallel size "
                        f"{data_parallel} on pool {pool_name!r} (world size {world}; prompts are split over its "
                        f"ranks); fix: set data.batch_size to a multiple of {data_parallel} or resize the pool")
        rows = prompts * samples
        if rows % data_parallel:
            raise error(f"{key} on pool {pool_name!r} (world size {world}, data-parallel size {data_parallel}): the "
                        f"batch of data.batch_size × rollout.n = {prompts} × {samples} = {rows} rows does not split "
                        f"evenly over its {data_parallel} data-parallel ranks; fix: make data.batch_size × rollout.n "
                        f"a multiple of {data_parallel}, or resize resource_pools.{pool_name}")


def check_streaming(config: Any) -> None:
    """``trainer.stream_mini_batches`` (docs/guide/async.md): the step's rollout arrives in chunks of
    ``actor.mini_batch_size`` rows of whole prompt groups, and the actor steps on each as it arrives."""
    actor, n, rows = config.actor, config.rollout.n, config.data.batch_size * config.rollout.n
    what = "trainer.stream_mini_batches trains each chunk of a step's rollout as it arrives"
    if config.rollout.pool is None:
        raise ValueError(f"{what} from a rollout pool of its own, but rollout.pool is not set (the actor's own "
                         "generation has nothing to overlap). Fix: set rollout.pool, or "
                         "trainer.stream_mini_batches=false")
    size = actor.mini_batch_size
    if size is None or size >= rows or rows % size or size % n:
        raise ValueError(f"{what}, one chunk per actor mini-batch: actor.mini_batch_size must be a multiple of "
                         f"rollout.n = {n} (whole prompt groups) dividing the {rows} rows of a step into 2 or more, "
                         f"got {size}. Fix: set actor.mini_batch_size, e.g. {rows // 2 if rows // 2 % n == 0 else n}")
    pool = config.resource_pools.get(config.rollout.pool)  # an unknown pool is check_async's error
    world = 1 if pool is None else pool.world_size
    if (size // n) % world:
        raise ValueError(f"{what}: each chunk's {size // n} prompts must split over the rollout pool's {world} "
                         "workers. Fix: make actor.mini_batch_size / rollout.n a multiple of them")
    if actor.recompute_log_probs:
        raise ValueError(f"{what}: with actor.recompute_log_probs=true, π_old of a later chunk would be computed "
                         "by weights already stepped on the earlier chunks. Fix: set actor.recompute_log_probs=false "
                         "(π_old is the rollout's log-prob), or trainer.stream_mini_batches=false")
    if actor.ppo_epochs != 1:
        raise ValueError(f"{what}: actor.ppo_epochs = {actor.ppo_epochs} revisits every chunk after the last one "
                         "arrived. Fix: set actor.ppo_epochs=1, or trainer.stream_mini_batches=false")
