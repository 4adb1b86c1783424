"""``trainer.placement: auto``: search the run's placement at start-up and apply it.

The search is ``hybridflow plan``'s (:func:`~hybridflow.placement.search.search_placements`), fed from the run's own
config instead of command-line flags: the algorithm's dataflow, each role's model shape (its preset, inline config or
``config.json``), the devices of the configured resource pools (their count per node is the cluster; their device
type the profile unless ``trainer.placement_profile`` names one) and the workload (``data.batch_size`` prompts ×
``rollout.n``, ``data.max_prompt_length`` + ``rollout.max_new_tokens`` tokens, the actor's epochs, mini- and
micro-batches). The best plan replaces the config's resource pools and each role's pool and parallel sizes (the
fragment ``hybridflow plan --output`` writes), and its record goes to ``RUN_DIR/plan.json``, where the remap advisor
reads it: the run's summary ends with the advisor's verdict on its own ledger.

A role the run does not host as a model (a reward or cost scored by a function) is still a stage of the dataflow;
it is kept on the actor's devices, where it costs nothing, instead of being given devices of its own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.config import Config
from hybridflow.errors import ConfigError
from hybridflow.placement.dataflow import Dataflow, Workload, config_key, get_dataflow
from hybridflow.placement.fragment import build_fragment, validate_fragment
from hybridflow.placement.models import ModelSpec, model_from_hf_config, parse_model
from hybridflow.placement.profiles import build_cluster
from hybridflow.placement.record import PLAN_FILE, PlanInputs, plan_inputs, save_plan_record
from hybridflow.placement.search import Placement, Plan, search_placements, set_partitions

__all__ = ["AutoPlacement", "apply_auto_placement", "plan_for_config"]


@dataclass(frozen=True)
class AutoPlacement:
    """What ``trainer.placement: auto`` chose for a run."""

    inputs: PlanInputs
    plan: Plan
    fragment: dict[str, Any]
    hosted: tuple[str, ...]  # the dataflow roles the run hosts as models (the others stay on the actor's devices)

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``placement`` record."""
        return {"mode": "auto", "plan": self.plan.describe(), "kind": self.plan.kind,
                "predicted_iteration_s": self.plan.iteration_seconds,
                "devices": self.inputs.cluster.num_devices, "profile": self.inputs.cluster.device.name,
                "fragment": self.fragment}


def _model_section(config: Config, role: str) -> Any:
    """The config section holding ``role``'s model (None: the run scores it with a function or does not use it)."""
    key = config_key(role)
    if key.startswith("roles."):
        section = config.roles.get(key.removeprefix("roles."))
        return None if section is None else config.role_model(section)
    if key in ("reward", "cost"):
        section = getattr(config, key)
        return None if section is None else section.model
    section = getattr(config, key, None)
    return None if section is None else config.role_model(section)


def _hosted_roles(config: Config, dataflow: Dataflow) -> tuple[str, ...]:
    """The dataflow roles this run builds workers for: the sections its algorithm's role declarations place."""
    from hybridflow import registries
    from hybridflow.plugins import load_plugins

    load_plugins()
    declared = {"actor" if declaration.engine_role == "actor" else declaration.section
                for declaration in registries.algorithms.get(config.algorithm.name).roles(config)}
    return tuple(role for role in dataflow.roles if role in declared)


def _model_spec(model: Any, role: str) -> ModelSpec:
    """A role's :class:`ModelSpec` from its model config (preset, inline config or a path to config.json)."""
    if model.preset is not None:
        from hybridflow.presets import preset_model_config

        return model_from_hf_config({**preset_model_config(model.preset), "torch_dtype": model.dtype},
                                    name=model.preset)
    if model.config is not None:
        return model_from_hf_config({"torch_dtype": model.dtype, **model.config}, name=f"{role}-config")
    path = Path(model.path).expanduser()
    if not (path / "config.json").exists() and not path.name.endswith(".json"):
        raise ConfigError(f"trainer.placement=auto reads {role}'s model shape from {path / 'config.json'}, which "
                          "does not exist. Fix: point the model path at a Hugging Face model directory, or set "
                          "trainer.placement=manual")
    return parse_model(str(path))


def _cluster_shape(config: Config) -> tuple[int, int, str]:
    """(devices, devices per node, device type) of the configured resource pools taken together."""
    pools = list(config.resource_pools.values())
    nodes = max(len(pool.devices_per_node) for pool in pools)
    per_node = [sum(pool.devices_per_node[i] for pool in pools if i < len(pool.devices_per_node))
                for i in range(nodes)]
    types = {pool.device for pool in pools}
    if len(types) != 1:
        raise ConfigError(f"trainer.placement=auto plans one kind of device, but the resource pools mix "
                          f"{sorted(types)}. Fix: give every pool the same device, or set trainer.placement=manual")
    return sum(per_node), max(per_node), types.pop()


def _workload(config: Config) -> Workload:
    actor = config.actor
    rows = config.data.batch_size * config.rollout.n
    mini = actor.mini_batch_size or rows
    return Workload(prompts=config.data.batch_size, samples_per_prompt=config.rollout.n,
                    prompt_length=config.data.max_prompt_length, response_length=config.rollout.max_new_tokens,
                    ppo_epochs=actor.ppo_epochs, mini_batches=max(1, rows // mini),
                    micro_batch_size=actor.micro_batch_size)


def _placements(dataflow: Dataflow, hosted: tuple[str, ...]) -> list[Placement]:
    """Every partition of the roles in which the roles the run does not host share the actor's set."""
    unhosted = [role for role in dataflow.roles if role not in hosted]
    return [placement for placement in set_partitions(dataflow.roles)
            if all(any(role in group and "actor" in group for group in placement) for role in unhosted)]


def plan_for_config(config: Config) -> AutoPlacement:
    """The best plan for ``config``'s run on its own devices (see the module docstring).

    Raises:
        ConfigError: a model shape cannot be read, or the pools cannot be planned together.
        PlacementError: no placement fits the devices.
    """
    dataflow = get_dataflow(config.algorithm.name)
    hosted = _hosted_roles(config, dataflow)
    models: dict[str, ModelSpec] = {}
    for role in dataflow.roles:
        section = _model_section(config, role)
        # a function-scored role: the actor's shape stands in (its stage is placed on the actor's devices)
        models[role] = _model_spec(section if section is not None else config.role_model(config.actor), role)
    devices, per_node, device_type = _cluster_shape(config)
    profile = config.trainer.placement_profile or ("cpu" if device_type == "cpu" else None)
    if profile is None:
        raise ConfigError("trainer.placement=auto on cuda pools needs the device profile the cost model prices: "
                          "expected trainer.placement_profile (e.g. a100-80gb, h100, h200), got none. Fix: set "
                          "trainer.placement_profile")
    compute_units = float(min(devices, os.cpu_count() or devices)) if device_type == "cpu" else None
    cluster = build_cluster(profile, devices, per_node, compute_units=compute_units)
    inputs = plan_inputs(dataflow.algorithm, models, cluster, _workload(config))
    result = search_placements(inputs.simulator(), dataflow, inputs.models, top=0,
                               placements=_placements(dataflow, hosted))
    fragment = build_fragment(result.best, cluster)
    validate_fragment(fragment)
    for role in dataflow.roles:  # a model the run does not build gets no section (a scored-by-function reward or
        key = config_key(role)   # cost keeps its section: its pool is then the actor's)
        if role not in hosted and key not in ("reward", "cost"):
            if key.startswith("roles."):
                fragment.get("roles", {}).pop(key.removeprefix("roles."), None)
            else:
                fragment.pop(key, None)
    return AutoPlacement(inputs=inputs, plan=result.best, fragment=fragment, hosted=hosted)


def _merge(base: Mapping[str, Any], fragment: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in fragment.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping) and key != "resource_pools":
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def apply_auto_placement(config: Config, run_dir: Path) -> tuple[Config, AutoPlacement | None]:
    """With ``trainer.placement: auto``: the config with the best plan applied, its record written to
    ``run_dir/plan.json``; with ``manual`` the config unchanged and None."""
    if config.trainer.placement != "auto":
        return config, None
    if config.trainer.plan is not None:
        raise ConfigError(f"trainer.placement=auto searches the run's plan, and trainer.plan={config.trainer.plan!r} "
                          "gives one too. Fix: drop trainer.plan, or set trainer.placement=manual to run that plan")
    chosen = plan_for_config(config)
    data = _merge(config.model_dump(mode="json"), chosen.fragment)
    try:
        applied = Config.model_validate(data)
    except ValueError as exc:
        raise ConfigError(f"trainer.placement=auto chose {chosen.plan.describe()}, which this config does not accept "
                          f"({exc}). Fix: set trainer.placement=manual and place the roles by hand") from exc
    run_dir.mkdir(parents=True, exist_ok=True)
    save_plan_record(run_dir / PLAN_FILE, chosen.inputs, chosen.plan)
    (run_dir / "placement.json").write_text(json.dumps(chosen.to_json(), indent=1))
    return applied, chosen
