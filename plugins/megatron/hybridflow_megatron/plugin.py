"""Hook implementations of hybridflow-megatron: the ``megatron`` training engine and its layout.

Imports no backend at module import: megatron-core, torch and transformers load inside the factories.
"""

from __future__ import annotations

from typing import Any

from hybridflow.engines import TrainingEngineInfo
from hybridflow.hookspecs import hookimpl


def build_megatron_training_engine(*, role: str, config: Any, device: str = "cpu") -> Any:
    """Training engine ``megatron``: see :class:`hybridflow_megatron.engine.MegatronTrainingEngine`."""
    from hybridflow_megatron.engine import build_megatron_training_engine as build

    return build(role=role, config=config, device=device)


def build_megatron_training_layout(named_shapes: Any, **options: Any) -> Any:
    """Layout ``megatron``: see :func:`hybridflow_megatron.layout.build_megatron_training_layout`."""
    from hybridflow_megatron.layout import build_megatron_training_layout as build

    return build(named_shapes, **options)


@hookimpl
def hybridflow_register_training_engines(registry: Any) -> None:
    registry.register("megatron", build_megatron_training_engine, info=TrainingEngineInfo(capabilities=frozenset({
        "reshards_generation_weights", "parks_training_weights", "reports_handover", "holds_weights"}),
        features=frozenset({"tensor_parallel", "pipeline_parallel"}), reusable_process=True))


def export_megatron_checkpoint(*, checkpoint: Any, spec: Any, out_dir: Any) -> None:
    """Checkpoint exporter ``megatron``: see :func:`hybridflow_megatron.export.export_checkpoint`."""
    from hybridflow_megatron.export import export_checkpoint

    export_checkpoint(checkpoint=checkpoint, spec=spec, out_dir=out_dir)


@hookimpl
def hybridflow_register_layouts(registry: Any) -> None:
    registry.register("megatron", build_megatron_training_layout)


@hookimpl
def hybridflow_register_checkpoint_exporters(registry: Any) -> None:
    registry.register("megatron", export_megatron_checkpoint)


@hookimpl
def hybridflow_report_capabilities() -> dict[str, str]:
    import importlib.util

    installed = importlib.util.find_spec("megatron") is not None and \
        importlib.util.find_spec("megatron.core") is not None
    return {
        "megatron-core": "installed" if installed else "absent: run scripts/install_megatron.sh",
        "training": "GPTModel (local spec) with tensor, pipeline and data parallelism, distributed optimizer; "
                    "roles actor, critic, reference, reward_model",
        "cpu": "runs on gloo through hybridflow_megatron.cpu_shim (fusions off, fp32)",
        "handover": "generation_weights (tg = 1, or tensor_parallel_size=tg: views where the shards coincide) and "
                    "reshard_weights (any generation layout) through the core "
                    "reshard planner, exactly the lower-bound bytes; TP all-gather + PP broadcast only for a padded "
                    "vocabulary",
    }
