"""Hook implementations of hybridflow-deepspeed: the ``deepspeed`` training engine, its ZeRO layout and its
checkpoint exporter.

Imports no backend at module import: DeepSpeed, torch and transformers load inside the factories.
"""

from __future__ import annotations

from typing import Any

from hybridflow.engines import TrainingEngineInfo
from hybridflow.hookspecs import hookimpl


def build_deepspeed_training_engine(*, role: str, config: Any, device: str = "cpu") -> Any:
    """Training engine ``deepspeed``: see :class:`hybridflow_deepspeed.training.DeepSpeedTrainingEngine`."""
    from hybridflow_deepspeed.training import DeepSpeedTrainingEngine

    return DeepSpeedTrainingEngine(role=role, config=config, device=device)


def build_deepspeed_training_layout(named_shapes: Any, *, data: int, **options: Any) -> Any:
    """Layout ``deepspeed``: see :func:`hybridflow_deepspeed.layouts.build_deepspeed_training_layout`
    (options: ``zero_stage``, ``dtype``)."""
    from hybridflow_deepspeed.layouts import build_deepspeed_training_layout as build

    return build(named_shapes, data=data, **options)


def export_deepspeed_checkpoint(*, checkpoint: Any, spec: Any, out_dir: Any) -> None:
    """Checkpoint exporter ``deepspeed``: see :func:`hybridflow_deepspeed.export.export_checkpoint`."""
    from hybridflow_deepspeed.export import export_checkpoint

    export_checkpoint(checkpoint=checkpoint, spec=spec, out_dir=out_dir)


@hookimpl
def hybridflow_register_training_engines(registry: Any) -> None:
    registry.register("deepspeed", build_deepspeed_training_engine, info=TrainingEngineInfo(capabilities=frozenset({
        "reshards_generation_weights", "parks_training_weights", "reports_handover", "holds_weights"}),
        features=frozenset({"bf16", "gradient_checkpointing", "token_budget_micro_batches"}),
        reusable_process=True))


@hookimpl
def hybridflow_register_checkpoint_exporters(registry: Any) -> None:
    registry.register("deepspeed", export_deepspeed_checkpoint)


@hookimpl
def hybridflow_register_layouts(registry: Any) -> None:
    registry.register("deepspeed", build_deepspeed_training_layout)


@hookimpl
def hybridflow_report_capabilities() -> dict[str, str]:
    import importlib.util

    installed = importlib.util.find_spec("deepspeed") is not None
    return {
        "deepspeed": "installed" if installed else 'absent: pip install "hybridflow-deepspeed[deepspeed]"',
        "training": "DeepSpeed ZeRO stage 1/2/3 (<role>.extra.zero_stage) over data-parallel ranks, torch AdamW, "
                    "optional optimizer-state CPU offload (extra.offload_optimizer), bf16 (mixed_precision=bf16); "
                    "roles actor, critic, reference, reward_model",
        "handover": "ZeRO-3 flat partitions as shard specs through the core reshard planner (lower-bound bytes); "
                    "ZeRO-1/2 hold full weights: 0 bytes",
        "export": "hybridflow export reads the checkpoint offline: ZeRO-3 partitions of all ranks reassembled, "
                  "ZeRO-1/2 module weights read whole",
    }
