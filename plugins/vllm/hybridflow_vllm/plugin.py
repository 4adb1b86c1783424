"""Hook implementations of hybridflow-vllm: the ``vllm`` rollout engine and its layout; imports no vLLM.

The factories import vLLM when called, inside the rollout worker, so listing plugins stays cheap.
"""

from __future__ import annotations

from typing import Any

from hybridflow.engines import RolloutEngineConfig, RolloutEngineInfo
from hybridflow.hookspecs import hookimpl
from hybridflow.registries import Registry


def build_vllm_rollout_engine(*, config: RolloutEngineConfig, device: str = "cpu") -> Any:
    """Factory of the ``vllm`` rollout engine (imports vLLM)."""
    from hybridflow_vllm.engine import VllmRolloutEngine

    return VllmRolloutEngine(config=config, device=device)


def build_vllm_layout(*args: Any, **kwargs: Any) -> Any:
    """Layout builder ``vllm``; see :func:`hybridflow_vllm.layout.build_vllm_layout`."""
    from hybridflow_vllm.layout import build_vllm_layout as build

    return build(*args, **kwargs)


@hookimpl
def hybridflow_register_rollout_engines(registry: Registry[Any]) -> None:
    # tensor-parallel generation on the caller's ranks through vLLM's external launcher, which groups consecutive
    # ranks (a group must be the actor's whole world) and pads the vocabulary to a multiple of 64 before splitting
    registry.register("vllm", build_vllm_rollout_engine, info=RolloutEngineInfo(
        capabilities=frozenset({"generates_tensor_parallel", "reports_parameter_shapes"}), weights_target="hf",
        vocab_multiple=64, tensor_parallel_world="whole"))


@hookimpl
def hybridflow_register_layouts(registry: Registry[Any]) -> None:
    registry.register("vllm", build_vllm_layout)


@hookimpl
def hybridflow_report_capabilities() -> dict[str, str]:
    from hybridflow_vllm.capabilities import describe_capabilities

    return describe_capabilities()
