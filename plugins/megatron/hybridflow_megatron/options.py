"""The generic training-engine keys the megatron engine does not implement: refused with a fix, never ignored."""

from __future__ import annotations

from hybridflow.engines import TrainingEngineConfig
from hybridflow.errors import ConfigError

__all__ = ["check_engine_keys"]


def check_engine_keys(role: str, config: TrainingEngineConfig) -> None:
    """Refuse the generic engine keys this engine does not implement, rather than ignore them."""
    if config.mixed_precision != "none":
        raise ConfigError(f"{role}.mixed_precision={config.mixed_precision!r}: the megatron engine computes in the "
                          f"model's dtype. Fix: set {role}.model.dtype=bfloat16 and {role}.mixed_precision=none")
    if config.lora is not None:
        raise ConfigError(f"{role}.lora: the megatron engine does not train LoRA adapters; the fsdp engine does. Fix: "
                          f"set {role}.engine=fsdp, or remove {role}.lora to train every weight")
    if config.gradient_checkpointing:
        raise ConfigError(f"{role}.gradient_checkpointing=true: the megatron engine takes activation recomputation "
                          f"from Megatron's TransformerConfig. Fix: set {role}.gradient_checkpointing=false and "
                          f"{role}.extra.transformer_overrides: {{recompute_granularity: full, recompute_method: "
                          "uniform, recompute_num_layers: 1}")
    if config.max_tokens_per_micro_batch is not None:
        raise ConfigError(f"{role}.max_tokens_per_micro_batch={config.max_tokens_per_micro_batch}: the megatron "
                          f"engine's pipeline schedule runs micro-batches of micro_batch_size rows. Fix: remove "
                          f"{role}.max_tokens_per_micro_batch and set {role}.micro_batch_size")
