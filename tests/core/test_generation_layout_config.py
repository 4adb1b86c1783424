"""``rollout.tensor_parallel_size`` (the actor's generation layout) is checked when the config loads: it must divide
the actor's ranks, the prompts must split over the generation replicas, and the model must split over it."""

from __future__ import annotations

import json

import pytest

from hybridflow.config import load_config
from hybridflow.errors import ConfigError
from hybridflow.presets import tiny_model_config


def test_generation_tensor_parallel_size_is_checked_at_load() -> None:
    config = load_config(None, ["rollout.tensor_parallel_size=2", "model.preset=tiny-qwen2-4h"])
    assert config.rollout.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"must divide the actor's 2 ranks .*pick one of \[1, 2\]"):
        load_config(None, ["rollout.tensor_parallel_size=4", "model.preset=tiny-qwen2-4h"])
    with pytest.raises(ConfigError, match="num_key_value_heads = 1"):
        load_config(None, ["rollout.tensor_parallel_size=2", "model.preset=tiny-qwen2"])
    with pytest.raises(ConfigError, match="vocab_size = 45"):
        load_config(None, ["rollout.tensor_parallel_size=2", "model.preset=tiny-qwen2-h16"])
    # megatron t=2 over 4 ranks: 2 training replicas, but 4 generation replicas at tg=1 (2 at tg=2)
    megatron = ["actor.engine=megatron", "actor.parallel.tensor_parallel_size=2", "model.preset=tiny-qwen2-4h",
                "resource_pools.main.devices_per_node=[4]", "data.batch_size=2"]
    with pytest.raises(ConfigError, match="multiple of the 4 generation replicas"):
        load_config(None, megatron)
    assert load_config(None, [*megatron, "rollout.tensor_parallel_size=2"]).rollout.tensor_parallel_size == 2


def test_multi_turn_rollouts_are_refused_at_generation_tensor_parallel_size_above_one() -> None:
    with pytest.raises(ConfigError, match=r"multi_turn .*tensor_parallel_size = 2.*Fix: set rollout.tensor_para"):
        load_config(None, ["rollout.tensor_parallel_size=2", "model.preset=tiny-qwen2-4h",
                           "rollout.multi_turn.enable=true", 'rollout.multi_turn.tools=["calculator"]'])


def test_vllm_generates_tensor_parallel_only_over_the_whole_actor_world() -> None:
    """vLLM's external launcher groups consecutive ranks into tensor groups; the hybrid engine's layout at 4 ranks,
    tg = 2 has strided ones ({0, 2}, {1, 3}), so vllm takes tg = world (or 1) only."""
    model = json.dumps(tiny_model_config(num_heads=4, num_kv_heads=2, vocab_size=64))
    vllm = ["rollout.engine=vllm", "model.preset=null", f"model.config={model}"]
    assert load_config(None, [*vllm, "rollout.tensor_parallel_size=2"]).rollout.tensor_parallel_size == 2
    # vLLM splits the vocabulary padded to a multiple of 64: the shards match the layout's only at such a size
    with pytest.raises(ConfigError, match=r"expected vocab_size % 64 == 0, got vocab_size = 48. Fix: pad"):
        load_config(None, ["rollout.engine=vllm", "model.preset=tiny-qwen2-4h", "rollout.tensor_parallel_size=2"])
    four = [*vllm, "resource_pools.main.devices_per_node=[4]"]
    with pytest.raises(ConfigError, match=r"Expected rollout.tensor_parallel_size = 4 .* or 1, got 2. Fix: set "
                                          r"rollout.tensor_parallel_size=4 or 1, or rollout.engine=hf"):
        load_config(None, [*four, "rollout.tensor_parallel_size=2"])
    assert load_config(None, [*four, "rollout.engine=hf", "rollout.tensor_parallel_size=2"]).rollout.engine == "hf"
