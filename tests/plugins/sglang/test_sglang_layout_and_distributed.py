"""SGLang's generation layout (fused qkv/gate_up per TP rank) checked against a hand-built QKVParallelLinear split,
and the distributed weight handover run for real over gloo between a sender process and a rollout process whose
sglang Engine is the declared TEST DOUBLE (it receives with torch.distributed.broadcast as sglang does).
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from hybridflow.errors import LayoutError
from hybridflow_sglang.layout import build_sglang_layout

CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "head_dim": 16, "vocab_size": 128}


def tiny_state_dict() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (128, 64), "model.norm.weight": (64,), "lm_head.weight": (128, 64)}
    prefix = "model.layers.0."
    shapes |= {f"{prefix}self_attn.q_proj.weight": (64, 64), f"{prefix}self_attn.k_proj.weight": (32, 64),
               f"{prefix}self_attn.v_proj.weight": (32, 64), f"{prefix}self_attn.q_proj.bias": (64,),
               f"{prefix}self_attn.k_proj.bias": (32,), f"{prefix}self_attn.v_proj.bias": (32,),
               f"{prefix}self_attn.o_proj.weight": (64, 64), f"{prefix}mlp.gate_proj.weight": (96, 64),
               f"{prefix}mlp.up_proj.weight": (96, 64), f"{prefix}mlp.down_proj.weight": (64, 96),
               f"{prefix}input_layernorm.weight": (64,)}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def test_sglang_layout_matches_qkv_and_gate_up_parallel_linear_shards():
    full = tiny_state_dict()
    layout = build_sglang_layout({n: tuple(t.shape) for n, t in full.items()}, model_config=CONFIG,
                                 tensor_parallel_size=2, dtype=torch.float32)
    p = "model.layers.0."
    assert f"{p}self_attn.qkv_proj.weight" in layout.params and f"{p}mlp.gate_up_proj.weight" in layout.params
    for rank in range(2):
        shards = layout.extract_shards(full, rank)
        half = lambda t, dim=0, rank=rank: t.chunk(2, dim=dim)[rank]  # noqa: E731
        expected_qkv = torch.cat([half(full[f"{p}self_attn.{x}_proj.weight"]) for x in "qkv"])
        assert torch.equal(shards[f"{p}self_attn.qkv_proj.weight"], expected_qkv)
        assert torch.equal(shards[f"{p}self_attn.qkv_proj.bias"],
                           torch.cat([half(full[f"{p}self_attn.{x}_proj.bias"]) for x in "qkv"]))
        assert torch.equal(shards[f"{p}mlp.gate_up_proj.weight"],
                           torch.cat([half(full[f"{p}mlp.gate_proj.weight"]), half(full[f"{p}mlp.up_proj.weight"])]))
        assert torch.equal(shards[f"{p}self_attn.o_proj.weight"], half(full[f"{p}self_attn.o_proj.weight"], 1))
        assert torch.equal(shards[f"{p}mlp.down_proj.weight"], half(full[f"{p}mlp.down_proj.weight"], 1))
        assert torch.equal(shards["model.embed_tokens.weight"], half(full["model.embed_tokens.weight"]))
        assert torch.equal(shards["model.norm.weight"], full["model.norm.weight"])


@pytest.mark.parametrize(("overrides", "tp", "match"), [
    ({"vocab_size": 45}, 1, "pads vocab-parallel rows"),
    ({"num_key_value_heads": 1, "num_attention_heads": 4}, 2, "replicates KV heads"),
    ({"hidden_size": None, "head_dim": None}, 1, "needs num_attention_heads"),
])
def test_sglang_layout_refuses_what_it_cannot_express(overrides, tp, match):
    shapes = {n: tuple(t.shape) for n, t in tiny_state_dict().items()}
    with pytest.raises(LayoutError, match=match):
        build_sglang_layout(shapes, model_config={**CONFIG, **overrides}, tensor_parallel_size=tp)


def _sender(port: int, queue) -> None:
    torch.set_num_threads(1)
    from hybridflow_sglang.distributed import SGLangWeightSender, plan_weight_buckets

    from sglang_test_double import stand_in_init_process_group

    sender = SGLangWeightSender(init_process_group=stand_in_init_process_group)
    sender.connect(master_address="127.0.0.1", master_port=port, world_size=2, backend="gloo")
    for bucket in plan_weight_buckets(tiny_state_dict().items(), bucket_bytes=64 * 64 * 4 * 3):
        sender.send_bucket(bucket)
    queue.put(("sender", sender.bytes_sent))
    sender.close()


def _receiver(port: int, queue) -> None:
    torch.set_num_threads(1)
    from hybridflow.engines import ModelSpec, RolloutEngineConfig
    from hybridflow_sglang.distributed import describe_bucket, plan_weight_buckets
    from hybridflow_sglang.engine import SGLangRolloutEngine

    from sglang_test_double import build_fake_backend

    created = []
    engine = SGLangRolloutEngine(RolloutEngineConfig(model=ModelSpec(path="/models/tiny")), device="cuda",
                                 backend=build_fake_backend(created))
    engine.init_weights_update_group(master_address="127.0.0.1", master_port=port, world_size=2, backend="gloo")
    # the controller sends the receiver the specs the trainer planned; here both sides plan from the same shapes
    buckets = [describe_bucket(b) for b in plan_weight_buckets(tiny_state_dict().items(), bucket_bytes=64 * 64 * 4 * 3)]
    versions = []
    for index, specs in enumerate(buckets):
        engine.update_weights_from_distributed(specs, version=1, flush_cache=index == len(buckets) - 1)
        versions.append(engine.weights_version)
    # numpy arrays pickle by value (torch tensors would travel as shared-memory handles that die with this process)
    queue.put(("receiver", {name: t.numpy().copy() for name, t in created[0].weights.items()}, versions, len(buckets)))


def test_distributed_handover_broadcasts_every_tensor_exactly_over_gloo():
    from hybridflow.controller.host import reserve_port

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    # sglang's weight-update group takes master_port as a number: held here until both processes end (the sender's
    # TCPStore still binds it; no other process is handed it), not bound and released before they start
    reservation = reserve_port("127.0.0.1")
    port = reservation.getsockname()[1]
    processes = [context.Process(target=target, args=(port, queue)) for target in (_sender, _receiver)]
    for process in processes:
        process.start()
    try:
        results = {}
        for _ in processes:
            item = queue.get(timeout=150)
            results[item[0]] = item[1:]
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        reservation.close()
    full = tiny_state_dict()
    received, versions, bucket_count = results["receiver"]
    assert bucket_count > 1
    assert versions == [0] * (bucket_count - 1) + [1]  # the version lands with the last bucket only
    assert set(received) == set(full)
    for name, tensor in full.items():
        assert torch.equal(torch.from_numpy(received[name]), tensor), name
    assert results["sender"][0] == sum(t.numel() * t.element_size() for t in full.values())
