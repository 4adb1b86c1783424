"""Config fragment: built from a plan, round-trips through YAML and validation; inconsistent ones are rejected."""

from __future__ import annotations

import copy

import pytest
import yaml

from hybridflow.errors import ConfigError
from hybridflow.placement import (
    LLAMA_PRESETS,
    Simulator,
    Workload,
    build_cluster,
    build_fragment,
    get_dataflow,
    search_placements,
    validate_fragment,
)
from hybridflow.placement.fragment import split_across_nodes


@pytest.mark.parametrize(("algorithm", "devices"), [("ppo", 16), ("ppo", 128), ("safe_rlhf", 64), ("remax", 8)])
def test_fragment_round_trips_through_yaml_and_validation(algorithm: str, devices: int) -> None:
    dataflow = get_dataflow(algorithm)
    cluster = build_cluster("a100", devices)
    models = {role: LLAMA_PRESETS["7b"] for role in dataflow.roles}
    plan = search_placements(Simulator(cluster=cluster, workload=Workload()), dataflow, models).best
    fragment = build_fragment(plan, cluster)
    loaded = yaml.safe_load(yaml.safe_dump(fragment))
    assert loaded == fragment
    validate_fragment(loaded)
    pools = loaded["resource_pools"]
    assert sum(sum(pool["devices_per_node"]) for pool in pools.values()) == devices
    assert all(max(pool["devices_per_node"]) <= cluster.devices_per_node for pool in pools.values())
    if "critic" in dataflow.roles:
        _validate_with_train_config(loaded, prompts=Workload().prompts)


def test_critic_free_fragment_passes_train_config() -> None:
    dataflow = get_dataflow("remax")
    cluster = build_cluster("a100", 8)
    models = {role: LLAMA_PRESETS["7b"] for role in dataflow.roles}
    plan = search_placements(Simulator(cluster=cluster, workload=Workload()), dataflow, models).best
    _validate_with_train_config(build_fragment(plan, cluster), prompts=Workload().prompts)


def _validate_with_train_config(fragment: dict, prompts: int) -> None:
    """Merge the fragment into ``hybridflow train``'s config model, as the trainer would, and validate it."""
    from hybridflow.config import Config

    # the plans are for 7B Llama models: the trainer checks the generation TP against the model's heads and sizes
    llama_7b = {"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096,
                "intermediate_size": 11008, "vocab_size": 32000, "num_hidden_layers": 32}
    merged = {**fragment, "model": {"config": llama_7b}, "data": {"batch_size": prompts},
              "rollout": {**fragment.get("rollout", {}), "n": 1}}
    config = Config.model_validate(merged)
    assert config.actor.pool in config.resource_pools


def _example() -> dict:
    return {
        "resource_pools": {"pool0": {"devices_per_node": [8, 8], "device": "cuda"},
                           "pool1": {"devices_per_node": [8], "device": "cuda"}},
        "actor": {"pool": "pool0", "parallel": {"pipeline_parallel_size": 1, "tensor_parallel_size": 4,
                                                "data_parallel_size": 4}},
        "rollout": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1},
        "critic": {"pool": "pool1", "parallel": {"pipeline_parallel_size": 2, "tensor_parallel_size": 4,
                                                 "data_parallel_size": 1}},
    }


def test_the_documented_example_validates() -> None:
    validate_fragment(_example())


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda f: f["actor"]["parallel"].update(data_parallel_size=3), "pool 'pool0' has 16"),
    (lambda f: f["critic"].update(pool="pool9"), "not a resource pool"),
    (lambda f: f["rollout"].update(tensor_parallel_size=3), "must divide"),
    (lambda f: f.update(actors={}), "Unknown placement keys"),
    (lambda f: f["resource_pools"]["pool1"].update(devices_per_node=[0]), "positive integer"),
    (lambda f: f.pop("actor"), "must place the 'actor'"),
])
def test_inconsistent_fragments_are_rejected(mutate, message: str) -> None:
    fragment = copy.deepcopy(_example())
    mutate(fragment)
    with pytest.raises(ConfigError, match=message):
        validate_fragment(fragment)


def test_split_across_nodes_fills_nodes_in_order() -> None:
    assert split_across_nodes([4, 12, 16], 8) == [[4], [4, 8], [8, 8]]
    assert split_across_nodes([3], 8) == [[3]]
