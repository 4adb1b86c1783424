"""Turn a plan into the config fragment ``hybridflow train`` accepts (resource pools + parallel sizes) and check one.

The fragment carries only placement keys; the trainer's own config validation owns every other key.
Stability: experimental.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridflow.errors import ConfigError
from hybridflow.placement.dataflow import ROLE_CONFIG_KEYS, config_key
from hybridflow.placement.profiles import Cluster
from hybridflow.placement.search import Plan

__all__ = ["build_fragment", "validate_fragment", "split_across_nodes"]

_PARALLEL_KEYS = ("pipeline_parallel_size", "tensor_parallel_size", "data_parallel_size")
_TOP_KEYS = {"resource_pools", "rollout", "cost_critic", "roles", *ROLE_CONFIG_KEYS.values()}


def split_across_nodes(sizes: list[int], devices_per_node: int) -> list[list[int]]:
    """Lay consecutive sets over nodes in order; return each set's device count per node it touches."""
    result: list[list[int]] = []
    offset = 0
    for size in sizes:
        counts: list[int] = []
        remaining = size
        while remaining:
            room = devices_per_node - offset % devices_per_node
            take = min(room, remaining)
            counts.append(take)
            remaining -= take
            offset += take
        result.append(counts)
    return result


def build_fragment(plan: Plan, cluster: Cluster) -> dict[str, Any]:
    """The YAML-ready fragment: one resource pool per colocated set, each role's pool and parallel sizes."""
    per_node = split_across_nodes(list(plan.devices), cluster.devices_per_node)
    fragment: dict[str, Any] = {"resource_pools": {
        f"pool{index}": {"devices_per_node": counts, "device": cluster.device.device_type}
        for index, counts in enumerate(per_node)}}
    for index, group in enumerate(plan.placement):
        for role in group:
            layout = plan.layouts[role]
            section = {"pool": f"pool{index}", "parallel": layout.parallel.to_config()}
            key = config_key(role)
            if key.startswith("roles."):  # a role a third-party algorithm configures under roles.<key>
                fragment.setdefault("roles", {})[key.removeprefix("roles.")] = section
            else:
                fragment[key] = section
            if layout.generation is not None:
                fragment["rollout"] = layout.generation.to_config()
    return fragment


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where} must be a positive integer, got {value!r}.")
    return value


def validate_fragment(fragment: Mapping[str, Any]) -> None:
    """Check a placement fragment: pools exist, and each role's p·t·d equals its pool's device count.

    Raises:
        ConfigError: naming the key, what was expected and what was found.
    """
    if not isinstance(fragment, Mapping):
        raise ConfigError(f"Placement fragment must be a mapping, got {type(fragment).__name__}.")
    unknown = sorted(set(fragment) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"Unknown placement keys {unknown}. Valid: {', '.join(sorted(_TOP_KEYS))}.")
    pools = fragment.get("resource_pools")
    if not isinstance(pools, Mapping) or not pools:
        raise ConfigError("Placement fragment needs a non-empty 'resource_pools' mapping of pool name → "
                          "{devices_per_node: [...], device: ...}.")
    pool_sizes: dict[str, int] = {}
    for name, pool in pools.items():
        counts = pool.get("devices_per_node") if isinstance(pool, Mapping) else None
        if not isinstance(counts, list) or not counts:
            raise ConfigError(f"resource_pools.{name}.devices_per_node must be a non-empty list of device counts, "
                              f"got {counts!r}.")
        pool_sizes[name] = sum(_positive_int(c, f"resource_pools.{name}.devices_per_node[{i}]")
                               for i, c in enumerate(counts))
        if not isinstance(pool.get("device", "cuda"), str):
            raise ConfigError(f"resource_pools.{name}.device must be a string such as 'cuda' or 'cpu'.")
    sections: dict[str, Any] = {key: fragment[key] for key in (*ROLE_CONFIG_KEYS.values(), "cost_critic")
                                if key in fragment}
    nested = fragment.get("roles", {})
    if not isinstance(nested, Mapping):
        raise ConfigError(f"'roles' must map role keys to {{pool, parallel}}, got {nested!r}.")
    sections.update({f"roles.{key}": section for key, section in nested.items()})
    if "actor" not in sections:
        raise ConfigError("Placement fragment must place the 'actor'.")
    for key, section in sections.items():
        if not isinstance(section, Mapping) or "pool" not in section or "parallel" not in section:
            raise ConfigError(f"'{key}' must be a mapping with 'pool' and 'parallel', got {section!r}.")
        pool = section["pool"]
        if pool not in pool_sizes:
            raise ConfigError(f"{key}.pool is {pool!r}, not a resource pool. Known: {', '.join(pool_sizes)}.")
        parallel = section["parallel"]
        if not isinstance(parallel, Mapping) or set(parallel) != set(_PARALLEL_KEYS):
            raise ConfigError(f"{key}.parallel must have exactly {', '.join(_PARALLEL_KEYS)}; got {parallel!r}.")
        sizes = [_positive_int(parallel[k], f"{key}.parallel.{k}") for k in _PARALLEL_KEYS]
        if sizes[0] * sizes[1] * sizes[2] != pool_sizes[pool]:
            raise ConfigError(
                f"{key}: pipeline × tensor × data = {sizes[0]}×{sizes[1]}×{sizes[2]} = {sizes[0] * sizes[1] * sizes[2]}"
                f" devices, but pool {pool!r} has {pool_sizes[pool]}. Make the product equal the pool size.")
    rollout = fragment.get("rollout")
    if rollout is not None:
        if not isinstance(rollout, Mapping):
            raise ConfigError(f"'rollout' must be a mapping, got {rollout!r}.")
        tensor = _positive_int(rollout.get("tensor_parallel_size"), "rollout.tensor_parallel_size")
        pipeline = _positive_int(rollout.get("pipeline_parallel_size", 1), "rollout.pipeline_parallel_size")
        actor = fragment["actor"]["parallel"]
        model_parallel = actor["pipeline_parallel_size"] * actor["tensor_parallel_size"]
        if model_parallel % (tensor * pipeline):
            raise ConfigError(f"rollout pipeline × tensor = {pipeline}×{tensor} must divide the actor's pipeline × "
                              f"tensor = {model_parallel} (3D-HybridEngine micro-DP groups).")
