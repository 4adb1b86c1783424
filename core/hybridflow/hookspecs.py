"""Every pluggy hook a hybridflow plugin can implement, grouped by what it supplies.

Stability: public. Hooks are always called with keyword arguments (pluggy matches them by name, so the
specs list plain parameters; an implementation may accept a subset). Registration hooks are ``historic=True``: a plugin
registered after the call still receives it, so the order in which plugins load never matters. Each receives one
:class:`~hybridflow.registries.Registry` and adds entries to it; return values are ignored. Duplicate names across
plugins raise :class:`~hybridflow.errors.DuplicateNameError` naming both owners.

This module defines the contracts only; :mod:`hybridflow.plugins` loads plugins and calls the hooks, and
:mod:`hybridflow.registries` holds the registries the hooks fill.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from hybridflow.registries import Registry

__all__ = ["hookspec", "hookimpl", "PROJECT_NAME"]

PROJECT_NAME = "hybridflow"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --- engines ---------------------------------------------------------------------------------------------------


@hookspec(historic=True)
def hybridflow_register_training_engines(registry: Registry[Any]) -> None:
    """Register training engine factories (e.g. ``"fsdp"``, ``"megatron"``).

    Runs once when plugins are loaded (``hybridflow.plugins.load_plugins``), in the driver and again in every
    worker process that builds an engine. Each entry is a callable ``factory(*, role, config, device) ->
    TrainingEngine`` (see :class:`hybridflow.engines.TrainingEngineFactory`). Import the backend (torch,
    megatron-core, ...) inside the factory, never at module import, so listing plugins stays cheap.
    """


@hookspec(historic=True)
def hybridflow_register_rollout_engines(registry: Registry[Any]) -> None:
    """Register rollout engine factories (e.g. ``"hf"``, ``"vllm"``, ``"sglang"``).

    Runs once at plugin load, in the driver and in each rollout worker. Each entry is a callable
    ``factory(*, config, device) -> RolloutEngine`` (see :class:`hybridflow.engines.RolloutEngineFactory`).
    Selecting one is a config change only (``rollout.engine: vllm``).
    """


# --- data movement ---------------------------------------------------------------------------------------------


@hookspec(historic=True)
def hybridflow_register_transfer_protocols(registry: Registry[Any]) -> None:
    """Register transfer protocols: how a worker method's inputs are split to ranks and outputs gathered back.

    Runs once at plugin load. Entries implement :class:`hybridflow.transfer.TransferProtocol`. The same registry
    is filled by user code through ``hybridflow.transfer.register(name, protocol)``.
    """


@hookspec(historic=True)
def hybridflow_register_layouts(registry: Registry[Any]) -> None:
    """Register layout builders: the per-parameter shard specs of an engine's weights.

    Runs once at plugin load. Each entry is a callable ``builder(named_shapes, **sizes) ->``
    :class:`hybridflow.resharding.ModelLayout`: ``named_shapes`` maps Hugging Face parameter names to full shapes,
    and the keyword arguments are the engine's parallel sizes and model facts, named as the registering plugin
    documents (``fsdp``: ``data``; ``megatron``: ``tensor, pipeline, data, num_heads, num_kv_heads, head_dim``;
    ``vllm``/``sglang``: ``model_config, tensor_parallel_size``). The reshard planner takes the training engine's
    layout as source and the rollout engine's as target (see docs/design/resharding.md).
    """


@hookspec(historic=True)
def hybridflow_register_checkpoint_exporters(registry: Registry[Any]) -> None:
    """Register checkpoint exporters, one per training engine name (e.g. ``"fsdp"``, ``"megatron"``).

    Runs once at plugin load. Each entry is a callable ``exporter(*, checkpoint, spec, out_dir) -> None`` (see
    :class:`hybridflow.export.CheckpointExporter`): it reads the directory the engine's ``save_checkpoint`` wrote
    for one role (``checkpoint``), in this process, without Ray or a process group, and writes ``config.json`` and
    ``model.safetensors`` into ``out_dir``; ``spec`` is the role's :class:`hybridflow.workers.RoleSpec` as the run
    built it. ``hybridflow export`` finds the exporter by the engine name the run's manifest recorded for the role
    and adds the tokenizer and generation config itself.
    """


# --- placement -------------------------------------------------------------------------------------------------


@hookspec(historic=True)
def hybridflow_register_cost_models(registry: Registry[Any]) -> None:
    """Register per-engine cost models used by auto device mapping (``hybridflow plan``).

    Runs once at plugin load. Entries implement :class:`hybridflow.placement.CostModel`; an engine without one
    is estimated by the analytical simulator alone.
    """


# --- algorithms and rewards ------------------------------------------------------------------------------------


@hookspec(historic=True)
def hybridflow_register_rewards(registry: Registry[Any]) -> None:
    """Register rule-based reward functions by name.

    Runs once at plugin load. Each entry is a callable ``fn(*, responses, ground_truths, data_sources,
    extra) -> list[float]``, or verl's per-sample ``compute_score(data_source, solution_str, ground_truth,
    extra_info=None)``; see :mod:`hybridflow.rewards`.
    """


@hookspec(historic=True)
def hybridflow_register_verdict_parsers(registry: Registry[Any]) -> None:
    """Register parsers of a generative reward model's verdicts (``reward.genrm.parser``) by name.

    Runs once at plugin load, in the driver and in each judge worker. Each entry is a callable
    ``parser(text: str) -> float | None``: the judge's generated text in, its score out, or None when the text
    holds no verdict (the sample is then scored as failed and counted in ``reward/genrm_parse_failures``); see
    :mod:`hybridflow.genrm`.
    """


@hookspec(historic=True)
def hybridflow_register_algorithms(registry: Registry[Any]) -> None:
    """Register algorithm drivers (optional; PPO, GRPO, ... ship with the core).

    Runs once at plugin load. Each entry is an :class:`hybridflow.algorithms.Algorithm`.
    """


# --- agent rollouts -------------------------------------------------------------------------------------------


@hookspec(historic=True)
def hybridflow_register_tools(registry: Registry[Any]) -> None:
    """Register tools an agent rollout can call (``rollout.multi_turn.tools``), by the name the model writes.

    Runs once at plugin load, in the driver and in each rollout worker. Each entry is a factory
    ``factory(**options) -> Tool`` (see :class:`hybridflow.tools.Tool`; ``options`` come from
    ``rollout.multi_turn.tool_options.<name>``). A tool's ``call`` returns a ``ToolResult`` for bad input instead
    of raising. Import heavy dependencies inside the factory.
    """


# --- reporting -------------------------------------------------------------------------------------------------


@hookspec
def hybridflow_report_capabilities() -> dict[str, str] | None:
    """Describe what this plugin can and cannot do on this machine, for ``hybridflow plugins``.

    Called when listing plugins. Return ``{capability: status}`` such as ``{"sleep_mode": "absent on CPU"}``;
    all non-None results are shown, each under its plugin. Must not import a heavy backend.
    """
