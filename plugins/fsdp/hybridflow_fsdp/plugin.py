"""Hook implementations of hybridflow-fsdp: the ``fsdp`` training engine, the ``hf`` rollout engine and their
layouts. Imports no backend at module import: torch, transformers and the engines load inside the factories."""

from __future__ import annotations

from typing import Any

from hybridflow.engines import RolloutEngineInfo, TrainingEngineInfo
from hybridflow.hookspecs import hookimpl


def build_fsdp_training_engine(*, role: str, config: Any, device: str = "cpu") -> Any:
    """Training engine ``fsdp``: see :class:`hybridflow_fsdp.training.FSDPTrainingEngine`."""
    from hybridflow_fsdp.training import FSDPTrainingEngine

    return FSDPTrainingEngine(role=role, config=config, device=device)


def build_hf_rollout_engine(*, config: Any, device: str = "cpu") -> Any:
    """Rollout engine ``hf``: see :class:`hybridflow_fsdp.rollout.HFRolloutEngine`."""
    from hybridflow_fsdp.rollout import HFRolloutEngine

    return HFRolloutEngine(config=config, device=device)


def build_fsdp_training_layout(named_shapes: Any, *, data: int, **options: Any) -> Any:
    """Layout ``fsdp``: see :func:`hybridflow_fsdp.layouts.build_fsdp_training_layout`."""
    from hybridflow_fsdp.layouts import build_fsdp_training_layout as build

    return build(named_shapes, data=data, **options)


def build_hf_rollout_layout(named_shapes: Any, *, data: int = 1, **options: Any) -> Any:
    """Layout ``hf``: see :func:`hybridflow_fsdp.layouts.build_hf_rollout_layout`."""
    from hybridflow_fsdp.layouts import build_hf_rollout_layout as build

    return build(named_shapes, data=data, **options)


def export_fsdp_checkpoint(*, checkpoint: Any, spec: Any, out_dir: Any) -> None:
    """Checkpoint exporter ``fsdp``: see :func:`hybridflow_fsdp.export.export_checkpoint`."""
    from hybridflow_fsdp.export import export_checkpoint

    export_checkpoint(checkpoint=checkpoint, spec=spec, out_dir=out_dir)


@hookimpl
def hybridflow_register_training_engines(registry: Any) -> None:
    registry.register("fsdp", build_fsdp_training_engine, info=TrainingEngineInfo(capabilities=frozenset({
        "reshards_generation_weights", "parks_training_weights", "reports_handover", "holds_weights",
        "replays_routing", "hands_over_adapters"}),
        features=frozenset({"lora", "bf16", "gradient_checkpointing", "token_budget_micro_batches"}),
        auto_mixed_precision=True, reusable_process=True))


@hookimpl
def hybridflow_register_checkpoint_exporters(registry: Any) -> None:
    registry.register("fsdp", export_fsdp_checkpoint)


@hookimpl
def hybridflow_register_rollout_engines(registry: Any) -> None:
    registry.register("hf", build_hf_rollout_engine, info=RolloutEngineInfo(capabilities=frozenset({
        "binds_generation_weights", "generates_tensor_parallel", "holds_weights", "records_routing",
        "loads_adapters"}),
        weights_target="hf", reusable_process=True))


@hookimpl
def hybridflow_register_layouts(registry: Any) -> None:
    registry.register("fsdp", build_fsdp_training_layout)
    registry.register("hf", build_hf_rollout_layout)


@hookimpl
def hybridflow_report_capabilities() -> dict[str, str]:
    return {
        "training": "FSDP2 fully_shard over data-parallel ranks (gloo on CPU, nccl on CUDA); tp = pp = 1; "
                    "unsharded on a single fp32 rank; LoRA adapters on the actor (actor.lora: the hf engine gets "
                    "the base once, then the adapters alone each sync; merged for export)",
        "rollout": "hf: KV-cache sampling (lean Llama/Qwen2/Qwen3 decoder, HF forward otherwise); tg > 1: "
                   "Megatron-style shards over torch.distributed tensor groups (Llama/Qwen2/Qwen3); sleep frees "
                   "weights, wake + update_weights (copied, or bound zero-copy with bind=True)",
        "handover": "reshard (default): the 3D-HybridEngine planner and executor to the generation layout (pg=1, tg), "
                    "views of the FSDP shards where they coincide, the other FSDP shards parked in the generation "
                    "shards while generating (park=True), bytes counted from buffers next to the lower bound; "
                    "stream (actor.extra.handover=stream, tg=1 only): per-parameter DTensor all-gather",
    }
