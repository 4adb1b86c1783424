"""Layer specs: megatron's local spec everywhere, TransformerEngine's spec on CUDA when TransformerEngine is installed,
and the two parameter renames between them, so conversion, layouts and handover see one (local-spec) naming.

TransformerEngine fuses each pre-norm into the following linear (``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``); every other parameter keeps its name. Not executed on the CPU box (no TE there).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["uses_transformer_engine", "build_layer_spec", "local_name", "spec_name", "named_local_parameters"]

_TE_TO_LOCAL = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
}


def uses_transformer_engine(device: str, extra: Mapping[str, Any]) -> bool:
    """TE spec on CUDA when ``transformer_engine`` imports, unless ``extra["transformer_engine"]`` is false."""
    wanted = extra.get("transformer_engine", "auto")
    if wanted is False or device != "cuda":
        return False
    return importlib.util.find_spec("transformer_engine") is not None


def build_layer_spec(*, transformer_engine: bool, qk_layernorm: bool = False) -> Any:
    """The layer spec; ``qk_layernorm``: RMSNorms over each query and key head (Qwen3), ``q_layernorm``/``k_layernorm``
    in both specs."""
    from megatron.core.models.gpt import gpt_layer_specs

    if transformer_engine:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)


def local_name(name: str) -> str:
    """The local-spec name of a parameter of either spec."""
    for te_suffix, local_suffix in _TE_TO_LOCAL.items():
        if name.endswith(te_suffix):
            return name[: -len(te_suffix)] + local_suffix
    return name


def spec_name(name: str, *, transformer_engine: bool) -> str:
    """The name a local-spec parameter has in the given spec."""
    if not transformer_engine:
        return name
    for te_suffix, local_suffix in _TE_TO_LOCAL.items():
        if name.endswith(local_suffix):
            return name[: -len(local_suffix)] + te_suffix
    return name


def named_local_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``module.named_parameters()`` under local-spec names, whatever spec built the module."""
    for name, parameter in module.named_parameters():
        yield local_name(name), parameter
