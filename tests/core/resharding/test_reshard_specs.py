"""Shard specs: FSDP chunks, tensor-parallel kinds, fused qkv / gate_up, reference slicing."""

from __future__ import annotations

import pytest
import torch

from hybridflow.errors import LayoutError
from hybridflow.resharding import (
    FusedLayout,
    GenerationLayout,
    ModelLayout,
    ParallelLayout,
    ParamShardSpec,
    build_fsdp_layout,
    build_tensor_parallel_layout,
    classify_llama_param,
    tiny_llama_shapes,
)


def test_fsdp_chunks_like_fsdp2() -> None:
    layout = build_fsdp_layout({"w": (10, 3)}, data=4)
    rows = [layout.pieces(r)["w"][0].box[0] for r in range(4)]
    assert rows == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert layout.params["w"].local_shape(layout.mesh, 3) == (1, 3)


def test_fsdp_rank_past_the_end_holds_an_empty_shard() -> None:
    layout = build_fsdp_layout({"w": (2, 3)}, data=4)
    assert layout.params["w"].local_shape(layout.mesh, 3) == (0, 3)  # like FSDP2's empty local tensor
    assert layout.shard_bytes(3) == 0 and layout.shard_bytes(0) == 3 * 4


def test_tensor_parallel_kinds() -> None:
    assert classify_llama_param("model.layers.0.self_attn.q_proj.weight") == "column"
    assert classify_llama_param("model.layers.0.mlp.down_proj.weight") == "row"
    assert classify_llama_param("model.layers.0.self_attn.o_proj.bias") == "replicated"
    assert classify_llama_param("model.norm.weight") == "replicated"
    assert classify_llama_param("model.embed_tokens.weight") == "vocab"
    with pytest.raises(LayoutError, match="kinds="):
        classify_llama_param("model.layers.0.router.weight")


def test_row_and_column_parallel_boxes() -> None:
    layout = build_tensor_parallel_layout(tiny_llama_shapes(), tensor=2)
    down = layout.pieces(1)["model.layers.0.mlp.down_proj.weight"][0]
    gate = layout.pieces(1)["model.layers.0.mlp.gate_proj.weight"][0]
    assert down.box == ((0, 64), (64, 128))
    assert gate.box == ((64, 128), (0, 64))
    assert layout.pieces(1)["model.norm.weight"][0].box == ((0, 64),)


def test_pipeline_stages_hold_their_layers() -> None:
    layout = build_tensor_parallel_layout(tiny_llama_shapes(layers=4), pipeline=2)
    stage0, stage1 = set(layout.pieces(0)), set(layout.pieces(1))
    assert "model.embed_tokens.weight" in stage0 and "lm_head.weight" in stage1
    assert "model.layers.1.mlp.up_proj.weight" in stage0 and "model.layers.2.mlp.up_proj.weight" in stage1
    assert not stage0 & stage1


def test_fused_qkv_vllm_and_megatron_orders() -> None:
    heads, kv_heads, head_dim = 4, 2, 16
    full = {
        "a.q_proj.weight": torch.arange(64.0).repeat_interleave(8).reshape(64, 8),
        "a.k_proj.weight": 100 + torch.arange(32.0).repeat_interleave(8).reshape(32, 8),
        "a.v_proj.weight": 200 + torch.arange(32.0).repeat_interleave(8).reshape(32, 8),
    }
    for interleaved in (False, True):
        spec = ParamShardSpec(name="a.qkv_proj.weight", shape=(128, 8), splits=((0, "tensor"),),
                              fused=FusedLayout.qkv(heads, kv_heads, head_dim, interleaved=interleaved))
        layout = ModelLayout(mesh=ParallelLayout(tensor=2), params={spec.name: spec})
        shard = layout.extract_shards(full, 1)["a.qkv_proj.weight"]
        q, k, v = full["a.q_proj.weight"][32:], full["a.k_proj.weight"][16:], full["a.v_proj.weight"][16:]
        assert torch.equal(shard, torch.cat([q, k, v]))  # one kv group per rank: both orders agree
    spec = ParamShardSpec(name="a.qkv_proj.weight", shape=(128, 8), fused=FusedLayout.qkv(4, 2, 16, interleaved=True))
    whole = ModelLayout(mesh=ParallelLayout(), params={spec.name: spec}).extract_shards(full, 0)[spec.name]
    expected = torch.cat([full["a.q_proj.weight"][:32], full["a.k_proj.weight"][:16], full["a.v_proj.weight"][:16],
                          full["a.q_proj.weight"][32:], full["a.k_proj.weight"][16:], full["a.v_proj.weight"][16:]])
    assert torch.equal(whole, expected)


def test_fused_target_layout_covers_canonical_tensors() -> None:
    shapes = tiny_llama_shapes()
    fused = build_tensor_parallel_layout(shapes, mesh=GenerationLayout(tensor=2), fuse_attention=(4, 2, 16),
                                         fuse_mlp=True)
    plain = build_tensor_parallel_layout(shapes, tensor=2)
    assert fused.canonical_shapes() == plain.canonical_shapes()
    assert "model.layers.0.self_attn.qkv_proj.weight" in fused.params
    assert "model.layers.0.mlp.gate_up_proj.weight" in fused.params


def test_spec_validation() -> None:
    with pytest.raises(LayoutError, match="does not split evenly"):
        ParamShardSpec(name="w", shape=(3, 2), splits=((0, "tensor"),)).pieces(ParallelLayout(tensor=2), 0)
    with pytest.raises(LayoutError, match="add up"):
        ParamShardSpec(name="x.gate_up_proj.weight", shape=(5, 2), fused=FusedLayout.gate_up(2))
    with pytest.raises(LayoutError, match="heads"):
        FusedLayout.qkv(4, 1, 8).blocks(0, 2)
    with pytest.raises(LayoutError, match="axis"):
        ParamShardSpec(name="w", shape=(4,), splits=((0, "expert"),))  # type: ignore[arg-type]
    spec = ParamShardSpec(name="w", shape=(4,))
    with pytest.raises(LayoutError, match="differs"):
        ModelLayout(mesh=ParallelLayout(), params={"v": spec})
