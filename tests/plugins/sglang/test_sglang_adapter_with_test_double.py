"""Adapter logic of the sglang rollout engine against a TEST DOUBLE of ``sglang.Engine`` (sglang needs CUDA).

Covers argument mapping (server args, sampling params), output parsing into a Batch, n samples, seeds, weight
handover and version bookkeeping, and the release → update → resume lifecycle. ``FakeSGLangEngine`` lives in
sglang_test_double.py; test_sglang_api_drift.py keeps its signatures equal to the released sglang's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.batch import Batch
from hybridflow.engines import ModelSpec, RolloutEngine, RolloutEngineConfig, SamplingParams
from hybridflow.errors import ConfigError, EngineError, VersionMismatchError
from hybridflow_sglang.api import SAMPLING_PARAM_NAMES, SERVER_ARG_NAMES
from hybridflow_sglang.engine import SGLangRolloutEngine, WeightSpec, build_sglang_rollout_engine
from hybridflow_sglang.outputs import parse_output

from sglang_test_double import FakeLocalSerializedTensor, build_fake_backend

PAD, EOS = 0, 2


def make_config(**overrides):
    values = dict(model=ModelSpec(path="/models/tiny", dtype="bfloat16"), tensor_parallel_size=1,
                  max_prompt_length=8, max_new_tokens=16, pad_token_id=PAD, eos_token_id=EOS, seed=7)
    values.update(overrides)
    return RolloutEngineConfig(**values)


def make_engine(device="cuda", **overrides):
    created = []
    engine = SGLangRolloutEngine(make_config(**overrides), device=device, backend=build_fake_backend(created))
    return engine, created[0]


def prompt_batch():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 0, 0, 11]])
    return Batch({"input_ids": ids, "attention_mask": (ids != 0).long()},
                 {"ground_truth": ["a", "b", "c"]}, {"iteration": 3})


def test_test_double_engine_gets_the_mapped_server_args():
    engine, fake = make_engine(device="cuda:1", tensor_parallel_size=2,
                               extra={"mem_fraction_static": 0.3, "enable_memory_saver": True,
                                      "server_args": {"disable_cuda_graph": True}})
    assert fake.server_args == {
        "model_path": "/models/tiny", "tp_size": 2, "dtype": "bfloat16", "random_seed": 7,
        "skip_tokenizer_init": True, "mem_fraction_static": 0.3, "enable_memory_saver": True,
        "enable_weights_cpu_backup": False, "enable_deterministic_inference": False, "context_length": 24,
        "device": "cuda", "base_gpu_id": 1, "log_level": "error", "disable_cuda_graph": True,
    }
    assert set(fake.server_args) - {"disable_cuda_graph"} <= set(SERVER_ARG_NAMES)  # declared for the drift check
    assert isinstance(engine, RolloutEngine)
    assert engine.capabilities == {"update_weights_in_memory", "log_probs", "sleep"}


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"device": "mps"}, 'runs on cuda or cpu: expected device "cuda", "cuda:<index>" or "cpu", got \'mps\''),
    ({"device": "cuda:x"}, "cannot read a GPU index"),
    ({"model": ModelSpec(config={"hidden_size": 8})}, "model_type"),
    ({"extra": {"mem_fraction": 0.5}}, "known:.*mem_fraction_static"),
    ({"extra": {"server_args": {"tp_size": 4}}}, "tensor_parallel_size"),
    ({"extra": {"memory_tags": ["gpu"]}}, "memory_tags"),
])
def test_bad_configuration_raises_config_error_with_a_fix(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make_engine(**kwargs)


def test_a_cpu_worker_selects_sglangs_cpu_backend():
    _, fake = make_engine(device="cpu")
    assert fake.server_args["device"] == "cpu" and "base_gpu_id" not in fake.server_args


def test_a_config_only_model_is_written_to_an_hf_directory_for_sglang_and_removed_at_shutdown():
    from hybridflow.testing.fixtures import tiny_model_config

    engine, fake = make_engine(model=ModelSpec(config=tiny_model_config(), seed=3))
    directory = Path(fake.server_args["model_path"])
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    weights = load_file(directory / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape == (45, 64)
    again, fake_again = make_engine(model=ModelSpec(config=tiny_model_config(), seed=3))
    assert torch.equal(load_file(Path(fake_again.server_args["model_path"]) / "model.safetensors")
                       ["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])  # the seed decides
    engine.shutdown()
    again.shutdown()
    assert not directory.exists() and fake.calls[-1][0] == "shutdown"


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_factory_without_sglang_says_how_to_install_it():
    with pytest.raises(EngineError, match=r'pip install "hybridflow-sglang\[sglang\]"'):
        build_sglang_rollout_engine(config=make_config(), device="cuda")


def test_unseeded_generate_sends_one_request_per_prompt_with_n_and_parses_a_batch():
    engine, fake = make_engine()
    out = engine.generate(prompt_batch(), SamplingParams(n=2, temperature=0.7, top_k=0, max_new_tokens=5))
    (name, call), = fake.calls
    assert name == "generate" and call["return_logprob"] is True
    assert call["input_ids"] == [[5, 6], [7, 8, 9, 10], [11]]
    assert call["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.7, "top_p": 1.0, "top_k": -1,
                                       "stop_token_ids": [EOS], "no_stop_trim": True, "n": 2}
    assert set(call["sampling_params"]) <= set(SAMPLING_PARAM_NAMES)
    assert len(out) == 6 and out.meta == {"iteration": 3, "policy_version": 0}
    assert list(out["ground_truth"]) == ["a", "a", "b", "b", "c", "c"]
    assert torch.equal(out["prompts"], prompt_batch()["input_ids"].repeat_interleave(2, dim=0))
    for row, raw in enumerate(fake.last_outputs):
        tokens = [entry[1] for entry in raw["meta_info"]["output_token_logprobs"]]
        length = len(tokens)
        assert out["responses"][row, :length].tolist() == tokens
        assert (out["responses"][row, length:] == PAD).all()
        assert out["response_mask"][row].tolist() == [1] * length + [0] * (5 - length)
        assert out["rollout_log_probs"][row, :length].tolist() == pytest.approx(
            [entry[0] for entry in raw["meta_info"]["output_token_logprobs"]])
        assert (out["rollout_log_probs"][row, length:] == 0).all()
    assert out["input_ids"].shape == (6, 4 + 5)
    assert torch.equal(out["attention_mask"], torch.cat([out["prompts"] != 0, out["response_mask"].bool()], 1).long())
    # left-padded prompt: positions start at 0 on the first real token and continue into the response
    row = 4  # prompt [0, 0, 0, 11]
    length = int(out["response_mask"][row].sum())
    assert out["position_ids"][row, :3 + 1 + length].tolist() == [0, 0, 0] + list(range(1 + length))


def test_generation_stops_at_eos_and_keeps_it_in_the_response_mask():
    engine, fake = make_engine()
    batch = Batch({"input_ids": torch.tensor([[p] for p in range(3, 40)]),
                   "attention_mask": torch.ones(37, 1, dtype=torch.long)})
    out = engine.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=6))
    stopped = [row for row, raw in enumerate(fake.last_outputs) if raw["meta_info"]["finish_reason"]["type"] == "stop"]
    assert stopped, "the test double should stop some rows on EOS"
    for row in stopped:
        length = int(out["response_mask"][row].sum())
        assert out["responses"][row, length - 1] == EOS and length <= 6


def test_seeded_generate_sends_one_request_per_sample_with_distinct_seeds_and_reproduces():
    engine, fake = make_engine(extra={"enable_deterministic_inference": True})
    sampling = SamplingParams(n=3, temperature=1.0, seed=11, max_new_tokens=4)
    first = engine.generate(prompt_batch(), sampling)
    call = fake.calls[-1][1]
    assert call["input_ids"] == [[5, 6]] * 3 + [[7, 8, 9, 10]] * 3 + [[11]] * 3
    seeds = [params["sampling_seed"] for params in call["sampling_params"]]
    assert len(set(seeds)) == 9 and all(params["n"] == 1 for params in call["sampling_params"])
    second = engine.generate(prompt_batch(), sampling)
    assert torch.equal(first["responses"], second["responses"])
    other = engine.generate(prompt_batch(), SamplingParams(n=3, temperature=1.0, seed=12, max_new_tokens=4))
    assert not torch.equal(first["responses"], other["responses"])
    assert "seed" in engine.capabilities


def test_seed_without_deterministic_inference_is_refused():
    engine, _ = make_engine()
    with pytest.raises(ConfigError, match="enable_deterministic_inference"):
        engine.generate(prompt_batch(), SamplingParams(seed=1))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        engine.generate(prompt_batch(), SamplingParams(max_new_tokens=17))


def test_parse_output_accepts_a_trimmed_stop_token_and_rejects_inconsistent_outputs():
    logprobs = [(-0.5, 9, None), (-0.25, EOS, None)]
    ok = {"output_ids": [9], "meta_info": {"output_token_logprobs": logprobs, "finish_reason": {"type": "stop"}}}
    assert parse_output(ok, row=0, max_new_tokens=4) == ([9, EOS], [-0.5, -0.25])
    with pytest.raises(EngineError, match="disagree"):
        parse_output({**ok, "output_ids": [8, EOS]}, row=0, max_new_tokens=4)
    with pytest.raises(EngineError, match="more than max_new_tokens"):
        parse_output(ok, row=0, max_new_tokens=1)
    with pytest.raises(EngineError, match="return_logprob"):
        parse_output({"output_ids": [9], "meta_info": {}}, row=0, max_new_tokens=4)
    aborted = {"output_ids": [], "meta_info": {"output_token_logprobs": [],
                                               "finish_reason": {"type": "abort", "message": "oom"}}}
    with pytest.raises(EngineError, match=r"aborted.*oom"):
        parse_output(aborted, row=0, max_new_tokens=4)


def named_weights(scale: float):
    return [("model.embed_tokens.weight", torch.full((45, 8), scale)), ("model.norm.weight", torch.full((8,), scale)),
            ("lm_head.weight", torch.full((45, 8), -scale))]


def test_update_weights_buckets_tensors_flushes_once_and_records_the_version():
    engine, fake = make_engine(extra={"weight_bucket_bytes": 45 * 8 * 4})
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4)
    before = engine.generate(prompt_batch(), sampling)
    engine.update_weights(iter(named_weights(0.37)), version=1)
    updates = [call for name, call in fake.calls if name == "update_weights_from_tensor"]
    assert [u["names"] for u in updates] == [["model.embed_tokens.weight"], ["model.norm.weight"], ["lm_head.weight"]] \
        or [u["names"] for u in updates] == [["model.embed_tokens.weight"], ["model.norm.weight", "lm_head.weight"]]
    assert [u["flush_cache"] for u in updates] == [False] * (len(updates) - 1) + [True]
    assert all(u["load_format"] is None for u in updates)
    for name, tensor in named_weights(0.37):
        assert torch.equal(fake.weights[name], tensor)
    after = engine.generate(prompt_batch(), sampling)
    assert engine.weights_version == 1 and after.meta["policy_version"] == 1 and before.meta["policy_version"] == 0
    assert not torch.equal(before["responses"], after["responses"])  # the double's outputs depend on its weights
    with pytest.raises(VersionMismatchError, match="already holds version 1"):
        engine.update_weights(named_weights(0.5), version=0)


def test_failed_update_keeps_the_version_and_blocks_generation_until_a_full_update():
    engine, fake = make_engine()
    fake.next_results = [(False, "shape mismatch for lm_head.weight")]
    with pytest.raises(EngineError, match="shape mismatch"):
        engine.update_weights(named_weights(0.1), version=4)
    assert engine.weights_version == 0
    with pytest.raises(EngineError, match="incomplete"):
        engine.generate(prompt_batch(), SamplingParams())
    engine.update_weights(named_weights(0.1), version=4)
    assert engine.generate(prompt_batch(), SamplingParams()).meta["policy_version"] == 4


def test_colocated_lifecycle_is_release_then_update_then_resume():
    engine, fake = make_engine(extra={"enable_memory_saver": True})
    engine.generate(prompt_batch(), SamplingParams(max_new_tokens=2))
    engine.sleep()
    with pytest.raises(EngineError, match="asleep"):
        engine.generate(prompt_batch(), SamplingParams())
    engine.update_weights(named_weights(0.2), version=1)
    engine.wake()
    out = engine.generate(prompt_batch(), SamplingParams(max_new_tokens=2))
    assert [(name, call.get("tags")) for name, call in fake.calls if name != "update_weights_from_tensor"] == [
        ("generate", None),
        ("release_memory_occupation", ["kv_cache", "weights"]),
        ("resume_memory_occupation", ["weights"]),
        ("resume_memory_occupation", ["kv_cache"]),
        ("generate", None),
    ]
    names = [name for name, _ in fake.calls]
    assert names.index("resume_memory_occupation") < names.index("update_weights_from_tensor") \
        < len(names) - 1 - names[::-1].index("resume_memory_occupation")
    assert out.meta["policy_version"] == 1 and not fake.released


def test_wake_before_update_resumes_everything_but_refuses_generation_until_weights_are_pushed():
    engine, fake = make_engine(extra={"enable_memory_saver": True})
    engine.sleep()
    engine.wake()
    assert fake.calls[-1] == ("resume_memory_occupation", {"tags": ["kv_cache", "weights"]})
    with pytest.raises(EngineError, match="incomplete"):  # released weights came back without their contents
        engine.generate(prompt_batch(), SamplingParams())
    engine.update_weights(named_weights(0.3), version=1)
    assert engine.generate(prompt_batch(), SamplingParams()).meta["policy_version"] == 1


def test_wake_without_update_is_allowed_with_a_cpu_backup_of_the_weights():
    engine, fake = make_engine(extra={"enable_memory_saver": True, "enable_weights_cpu_backup": True,
                                      "memory_tags": ["kv_cache", "weights", "cuda_graph"]})
    engine.sleep()
    engine.wake()
    assert fake.calls[-2:] == [("release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]}),
                               ("resume_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]})]
    assert engine.generate(prompt_batch(), SamplingParams()).meta["policy_version"] == 0


def test_sleep_is_an_absent_capability_without_the_memory_saver():
    engine, fake = make_engine()
    assert "sleep" not in engine.capabilities
    with pytest.raises(EngineError, match="enable_memory_saver"):
        engine.sleep()
    assert not any(name == "release_memory_occupation" for name, _ in fake.calls)


def test_update_weights_per_rank_sends_each_rank_its_own_shard_for_direct_loading():
    engine, fake = make_engine(tensor_parallel_size=2)
    shards = [{"model.layers.0.self_attn.qkv_proj.weight": torch.full((4, 8), float(rank)),
               "model.norm.weight": torch.ones(8)} for rank in range(2)]
    engine.update_weights_per_rank(shards, version=2)
    (update,) = fake.direct_updates
    assert fake.calls[-1][1]["load_format"] == "direct" and fake.calls[-1][1]["flush_cache"] is True
    name, local = update[0]
    assert name == "model.layers.0.self_attn.qkv_proj.weight" and isinstance(local, FakeLocalSerializedTensor)
    assert [value[1] for value in local.values] == [shards[0][name], shards[1][name]]
    assert engine.weights_version == 2
    with pytest.raises(EngineError, match="one shard dict per TP rank"):
        engine.update_weights_per_rank(shards[:1], version=3)
    with pytest.raises(EngineError, match="same parameter names"):
        engine.update_weights_per_rank([shards[0], {"model.norm.weight": torch.ones(8)}], version=3)


def test_distributed_update_records_the_version_only_after_the_last_bucket():
    engine, fake = make_engine()
    engine.init_weights_update_group(master_address="10.0.0.1", master_port=29555, world_size=2)
    assert fake.calls[-1] == ("init_weights_update_group", {
        "master_address": "10.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2,
        "group_name": "hybridflow_weights", "backend": "nccl"})
    with pytest.raises(ConfigError, match="1 trainer \\+ tp_size = 2"):
        engine.init_weights_update_group(master_address="10.0.0.1", master_port=29555, world_size=3)
    spec = WeightSpec(name="model.norm.weight", dtype="bfloat16", shape=(8,))
    engine.update_weights_from_distributed([spec], version=5, flush_cache=False)
    assert engine.weights_version == 0
    engine.update_weights_from_distributed([spec], version=5)
    assert engine.weights_version == 5
    assert fake.calls[-1][1] == {"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[8]],
                                 "group_name": "hybridflow_weights", "flush_cache": True}
    engine.destroy_weights_update_group()
    engine.shutdown()
    assert [name for name, _ in fake.calls[-2:]] == ["destroy_weights_update_group", "shutdown"]


def test_plugin_registers_engine_and_layout_and_reports_capabilities():
    from hybridflow import registries
    from hybridflow.plugins import load_plugins, plugin_infos

    load_plugins()
    assert registries.rollout_engines.get("sglang") is build_sglang_rollout_engine
    assert "sglang" in registries.layouts
    info = {i.name: i for i in plugin_infos()}["sglang"]
    if not torch.cuda.is_available():
        assert "not" in info.capabilities["engine"] and "GPU" in info.capabilities["engine"]
