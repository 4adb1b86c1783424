"""Layer-spec selection and the TransformerEngine ↔ local parameter renames (no megatron needed)."""

from __future__ import annotations

import pytest

from hybridflow_megatron.spec_names import local_name, spec_name, uses_transformer_engine

TE_NAMES = {
    "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": "decoder.layers.3.input_layernorm.weight",
    "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": "decoder.layers.0.pre_mlp_layernorm.weight",
    "decoder.layers.0.self_attention.linear_qkv.weight": "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.final_layernorm.weight": "decoder.final_layernorm.weight",
}


@pytest.mark.parametrize("te, local", TE_NAMES.items())
def test_renames_round_trip(te: str, local: str) -> None:
    assert local_name(te) == local
    assert spec_name(local, transformer_engine=True) == te
    assert spec_name(local, transformer_engine=False) == local


def test_transformer_engine_only_on_cuda_and_when_not_disabled() -> None:
    assert uses_transformer_engine("cpu", {}) is False
    assert uses_transformer_engine("cuda", {"transformer_engine": False}) is False
