"""Per-rank jobs of test_tp_generation, run on a 2-process gloo cluster (importable by the spawned processes)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from hybridflow.char_tokenizer import EOS_ID, PAD_ID
from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams
from hybridflow.presets import tiny_model_config
from hybridflow.testing.contracts.rollout import build_prompt_batch
from hybridflow_fsdp.rollout import HFRolloutEngine
from hybridflow_fsdp.tensor_parallel import tensor_parallel_shard, tensor_parallel_split_dim

COLUMNS = ("responses", "response_mask", "rollout_log_probs", "input_ids", "attention_mask", "position_ids")


def model_config(architecture: str, tied: bool, biases: bool = False) -> dict[str, Any]:
    """4 heads / 2 KV heads, vocabulary padded to an even 46 (the char vocabulary has 45 tokens)."""
    config = tiny_model_config(architecture=architecture, num_heads=4, num_kv_heads=2, tie_word_embeddings=tied)
    config["vocab_size"] = 46
    if biases:  # Llama's optional biases: o_proj's and down_proj's are row-parallel (replicated, added once)
        config.update(attention_bias=True, mlp_bias=True)
    return config


def build_engine(config: dict[str, Any], tg: int, groups: list[list[int]] | None = None,
                 **extra: Any) -> HFRolloutEngine:
    return HFRolloutEngine(config=RolloutEngineConfig(
        model=ModelSpec(config=config, seed=3), tensor_parallel_size=tg, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
        max_prompt_length=16, tensor_groups=None if groups is None else tuple(tuple(g) for g in groups), extra=extra))


def full_weights(engine: HFRolloutEngine, seed: int = 5) -> dict[str, torch.Tensor]:
    """The tg=1 engine's weights with every tensor (biases and norms too) moved off its init, same on all ranks."""
    generator = torch.Generator().manual_seed(seed)
    return {name: p.detach() + 0.05 * torch.randn(p.shape, generator=generator)
            for name, p in engine.model.named_parameters()}


def shards(full: dict[str, torch.Tensor], tg: int, rank: int) -> dict[str, torch.Tensor]:
    return {name: tensor_parallel_shard(name, tensor, tg, rank).clone() for name, tensor in full.items()}


def columns(batch: Any) -> dict[str, torch.Tensor]:
    return {name: batch[name] for name in COLUMNS}


def compare_job(rank: int, world: int, group: Any, config: dict[str, Any], groups: list[list[int]]) -> dict[str, Any]:
    """Greedy and sampled generation at tg=1 (whole model) and tg=2 (this rank's shards) from the same weights."""
    reference = build_engine(config, 1)
    full = full_weights(reference)
    reference.update_weights(full.items(), version=1)
    engine = build_engine(config, 2, groups)
    engine.update_weights(shards(full, 2, engine.tensor_rank).items(), version=1)
    batch = build_prompt_batch()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=11)
    replicated = sum(t.numel() * t.element_size() for n, t in full.items() if tensor_parallel_split_dim(n) is None)
    return {
        "tensor_rank": engine.tensor_rank,
        "tg1_greedy": columns(reference.generate(batch, greedy)),
        "tg2_greedy": columns(engine.generate(batch, greedy)),
        "tg2_sampled": [columns(engine.generate(batch, sampled)) for _ in range(2)],
        "tg1_bytes": reference.resident_weight_bytes(),
        "tg2_bytes": engine.resident_weight_bytes(),
        "replicated_bytes": replicated,
        "shapes": engine.weight_shapes(),
    }


def bind_job(rank: int, world: int, group: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Bind externally owned shards after sleep/wake, prove no copy, mutate them, sleep again."""
    full = full_weights(build_engine(config, 1))
    engine = build_engine(config, 2, [[0, 1]])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    batch = build_prompt_batch()
    engine.update_weights(shards(full, 2, engine.tensor_rank).items(), version=1)  # copied: the engine owns them
    copied = columns(engine.generate(batch, greedy))
    owned_copied = engine.owned_weight_bytes()
    engine.sleep()
    asleep = engine.resident_weight_bytes()
    engine.wake()
    awake_before_update = engine.resident_weight_bytes()
    external = shards(full, 2, engine.tensor_rank)  # "training" storage the engine must not copy
    engine.update_weights(external.items(), version=2, bind=True)
    bound_out = columns(engine.generate(batch, greedy))
    stats = dict(engine.last_update_stats)
    name = "model.layers.0.mlp.down_proj.weight"
    same_storage = engine.model.get_parameter(name).data_ptr() == external[name].data_ptr()
    before = engine.model.get_parameter(name).detach().clone()
    external[name].mul_(-3.0)  # the trainer updates its tensor in place
    follows = torch.equal(engine.model.get_parameter(name).detach(), before * -3.0)
    mutated_out = columns(engine.generate(batch, greedy))
    watch = weakref.ref(external[name].untyped_storage())
    owned_bound, resident_bound = engine.owned_weight_bytes(), engine.resident_weight_bytes()
    engine.sleep()
    del external
    gc.collect()
    released = watch() is None
    # a copying update after a binding allocates fresh storage: it never writes into the caller's tensors
    engine.wake()
    external = shards(full, 2, engine.tensor_rank)
    kept = {n: t.clone() for n, t in external.items()}
    engine.update_weights(external.items(), version=3, bind=True)
    engine.update_weights({n: t * 2.0 for n, t in kept.items()}.items(), version=4)
    untouched = all(torch.equal(external[n], kept[n]) for n in kept)
    owned_after_copy = engine.owned_weight_bytes()
    return {"copied": copied, "bound": bound_out, "mutated": mutated_out, "owned_copied": owned_copied,
            "asleep": asleep, "awake_before_update": awake_before_update, "stats": stats,
            "same_storage": same_storage, "follows": follows, "owned_bound": owned_bound,
            "resident_bound": resident_bound, "storage_released": released, "untouched": untouched,
            "owned_after_copy": owned_after_copy,
            "shard_bytes": sum(t.numel() * t.element_size() for t in shards(full, 2, 0).values())}


def error_job(rank: int, world: int, group: Any, config: dict[str, Any], groups: Any, tg: int) -> str:
    """The ConfigError message raised on this rank (every rank raises the same one, before any collective)."""
    from hybridflow.errors import ConfigError

    try:
        build_engine(config, tg, groups)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def stride_job(rank: int, world: int, group: Any, config: dict[str, Any]) -> dict[str, Any]:
    """tg=2 on 4 ranks in the stride grouping [[0, 2], [1, 3]]: greedy output of each group vs the whole model."""
    from hybridflow_fsdp.layouts import build_hf_tensor_groups

    groups = build_hf_tensor_groups(data=world, tensor=2)
    reference = build_engine(config, 1)
    full = full_weights(reference)
    reference.update_weights(full.items(), version=1)
    engine = build_engine(config, 2, groups)
    engine.update_weights(shards(full, 2, engine.tensor_rank).items(), version=1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    batch = build_prompt_batch()
    return {"groups": groups, "tensor_rank": engine.tensor_rank, "tg1": columns(reference.generate(batch, greedy)),
            "tg2": columns(engine.generate(batch, greedy))}
