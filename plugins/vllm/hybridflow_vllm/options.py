"""Settings of the ``vllm`` rollout engine (``RolloutEngineConfig.extra``), its process environment and what a weight
update reports. Stability: public (re-exported by :mod:`hybridflow_vllm.engine`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.errors import ConfigError

__all__ = ["ENGINE_ENVIRONMENT", "VllmOptions", "WeightUpdateStats"]

#: environment the in-process engine needs, set only where the user has not set it already
ENGINE_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # one process: tensors reach the worker without serialization
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # keep the caller's thread settings (OMP_NUM_THREADS) on a shared box
}


@dataclass(frozen=True, kw_only=True, slots=True)
class VllmOptions:
    """Engine-specific settings, read from ``RolloutEngineConfig.extra``.

    Args:
        kv_cache_memory_bytes: KV cache size; small by default so tests and CPU runs start fast.
        enforce_eager: skip CUDA graphs / torch.compile (start-up in seconds instead of minutes).
        enable_prefix_caching: reuse the prompt's KV cache across its n samples (reset on every weight update).
        sleep_level: vLLM sleep level used by ``sleep()`` where the platform supports it (1: offload weights,
            drop KV cache; 2: drop both).
        llm_kwargs: any other ``vllm.LLM`` keyword arguments (e.g. ``gpu_memory_utilization``), passed through.
    """

    kv_cache_memory_bytes: int = 64 * 2**20
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    sleep_level: int = 1
    llm_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_cache_memory_bytes <= 0:
            raise ConfigError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.sleep_level not in (1, 2):
            raise ConfigError(f"sleep_level must be 1 or 2 (vLLM's sleep levels), got {self.sleep_level}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> VllmOptions:
        """Options from ``RolloutEngineConfig.extra``; unknown keys raise, listing the known ones."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown vllm rollout option(s) {unknown}; known: {sorted(known)}. Put other vllm.LLM arguments "
                "under extra.llm_kwargs."
            )
        return cls(**dict(extra))


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightUpdateStats:
    """What the last ``update_weights`` moved."""

    version: int
    tensors: int
    bytes: int
    seconds: float
