"""The ``megatron`` layout describes exactly the shards the HF → megatron conversion produces (no megatron needed)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.errors import LayoutError
from hybridflow.resharding.builders import named_shapes_of
from hybridflow.testing.fixtures import tiny_model_config
from hybridflow_megatron.convert import (
    ShardPosition,
    hf_from_megatron_shards,
    megatron_shard_from_hf,
    read_arch_info,
)
from hybridflow_megatron.layout import build_megatron_training_layout, layout_name_of

pytest.importorskip("transformers")


def _hf_state(architecture: str, vocab: int = 48):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = tiny_model_config(architecture=architecture, num_heads=4, num_kv_heads=2, num_layers=4,
                               tie_word_embeddings=architecture == "qwen2")
    values["vocab_size"] = vocab
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return config, state


def _local_from_layout(layout, rank, state):
    """Each layout parameter's local shard on ``rank``, assembled from canonical HF tensors by the spec's pieces."""
    out = {}
    for name, pieces in layout.pieces(rank).items():
        spec = layout.params[name]
        local = torch.zeros(spec.local_shape(layout.mesh, rank))
        for piece in pieces:
            source = state[piece.canonical][tuple(slice(a, b) for a, b in piece.box)]
            local[piece.local_slices(piece.box)] = source
        out[name] = local
    return out


@pytest.mark.parametrize("architecture,tp,pp", [("qwen2", 2, 2), ("llama", 2, 1), ("qwen2", 1, 2)])
def test_layout_matches_conversion_on_every_rank(architecture, tp, pp):
    config, state = _hf_state(architecture)
    arch = read_arch_info(config, tp_size=tp)
    assert arch.padded_vocab_size == arch.vocab_size == 48
    layout = build_megatron_training_layout(
        named_shapes_of(state), tensor=tp, pipeline=pp, data=2,
        num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
    )
    per_stage = arch.num_layers // pp
    for rank in range(layout.world_size):
        coords = layout.mesh.coords(rank)
        position = ShardPosition(tp_rank=coords.tensor, tp_size=tp, layer_offset=coords.pipeline * per_stage,
                                 num_local_layers=per_stage, pre_process=coords.pipeline == 0,
                                 post_process=coords.pipeline == pp - 1)
        shard = megatron_shard_from_hf(state, arch=arch, position=position)
        if arch.tied_embeddings and not position.pre_process:
            shard.pop("output_layer.weight", None)  # the last stage's copy of the tied embedding
        expected = {layout_name_of(k, layer_offset=position.layer_offset): v for k, v in shard.items()}
        actual = _local_from_layout(layout, rank, state)
        assert sorted(actual) == sorted(expected), rank
        for name in expected:
            assert torch.equal(actual[name], expected[name]), (rank, name)


@pytest.mark.parametrize("tp", [1, 2])
def test_conversion_round_trip_is_exact(tp):
    config, state = _hf_state("qwen2", vocab=45)
    arch = read_arch_info(config, tp_size=tp)
    assert arch.padded_vocab_size % (8 * tp) == 0 and arch.padded_vocab_size > 45
    shards = [megatron_shard_from_hf(state, arch=arch, position=ShardPosition(
        tp_rank=r, tp_size=tp, num_local_layers=arch.num_layers)) for r in range(tp)]
    back = hf_from_megatron_shards(shards, arch=arch, layer_offset=0)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_padded_vocab_is_refused_by_the_layout():
    _, state = _hf_state("qwen2", vocab=45)
    with pytest.raises(LayoutError, match="multiple of tensor_parallel_size=2"):
        build_megatron_training_layout(named_shapes_of(state), tensor=2, num_heads=4, num_kv_heads=2, head_dim=16)
