"""LoRA on the fsdp engine (1 gloo rank, in process): only the adapters train and hold optimizer state (counted from
tensors, against full fine-tuning), generation receives the merged weights and reflects the update, checkpoints
hold only the adapters and resume bit-identically, and bad settings are refused with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.engines import (
    LoraConfig,
    ModelSpec,
    OptimConfig,
    RolloutEngineConfig,
    SamplingParams,
    TrainingEngineConfig,
)
from hybridflow.errors import CheckpointError, ConfigError, EngineError
from hybridflow.testing.contracts.rollout import build_prompt_batch, prepare_model, read_weights
from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll
from hybridflow.testing.fixtures import EOS_ID, PAD_ID
from hybridflow.trainer.build import build_lora_config
from hybridflow_fsdp.lora import LoRALinear, lora_modules
from hybridflow_fsdp.rollout import HFRolloutEngine
from hybridflow_fsdp.training import FSDPTrainingEngine

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_model(tmp_path_factory.mktemp("fsdp_lora"))


def build_actor(path: Path, lora: LoraConfig | None = LORA, **options: object) -> FSDPTrainingEngine:
    config = TrainingEngineConfig(model=ModelSpec(path=str(path)), optim=OptimConfig(lr=3e-2), lora=lora,
                                  **options)  # type: ignore[arg-type]
    return FSDPTrainingEngine(role="actor", config=config)


def test_only_adapters_train_and_hold_optimizer_state(model_path: Path) -> None:
    batch = build_training_batch(rows=8)
    lora = build_actor(model_path)
    full = build_actor(model_path, lora=None, extra={"lean_forward": False})  # the HF forward, as LoRA runs it
    wrapped = lora_modules(lora.model)
    assert sorted({name.rsplit(".", 1)[-1] for name in wrapped}) == ["down_proj", "q_proj", "v_proj"]
    assert len(wrapped) == 3 * 2  # per decoder layer
    # B starts at zero: the wrapped model is the base model exactly
    assert torch.equal(lora.compute_log_probs(batch)["log_probs"], full.compute_log_probs(batch)["log_probs"])

    losses = [lora.train_step(batch, loss_fn=sequence_mean_nll)["loss"] for _ in range(4)]
    metrics = lora.train_step(batch, loss_fn=sequence_mean_nll)
    assert metrics["loss"] < losses[0] - 0.05, losses
    base = read_weights(model_path)
    state = dict(lora.model.named_parameters())
    frozen = [name for name in base if name in state]
    assert len(frozen) == len(base) == 26  # every base weight (the tied head is stored once, as the embeddings)
    assert all(torch.equal(state[name].detach(), base[name]) for name in frozen), "the base weights moved"
    assert all(state[f"{name}.lora_B"].abs().max() > 0 for name in wrapped), "an adapter did not train"

    # the optimizer steps only the adapters, and holds state only for them
    adapters = {id(p) for name, p in state.items() if name.endswith((".lora_A", ".lora_B"))}
    assert lora.optimizer is not None and {id(p) for p in lora.optimizer.state} == adapters
    expected_params = sum(m.lora_A.numel() + m.lora_B.numel() for m in wrapped.values())
    assert metrics["actor/trainable_params"] == metrics["actor/optimizer_params"] == expected_params
    assert expected_params == sum(4 * (m.in_features + m.out_features) for m in wrapped.values())
    moments = 2 * expected_params * 4  # AdamW's exp_avg and exp_avg_sq in fp32, plus one step count per tensor
    assert moments < metrics["actor/optimizer_state_bytes"] <= moments + len(adapters) * 8

    # against full fine-tuning on the same model: every weight trains, ~40x the optimizer state on this tiny model
    full_metrics = full.train_step(batch, loss_fn=sequence_mean_nll)
    total = sum(t.numel() for t in base.values())
    assert full_metrics["actor/trainable_params"] == total
    assert full_metrics["actor/optimizer_state_bytes"] > 2 * total * 4
    assert metrics["actor/optimizer_state_bytes"] * 20 < full_metrics["actor/optimizer_state_bytes"]
    assert metrics["actor/weight_bytes"] == full_metrics["actor/weight_bytes"] + expected_params * 4


def test_generation_gets_merged_weights_and_reflects_the_update(model_path: Path) -> None:
    actor = build_actor(model_path)
    batch = build_training_batch(rows=8)
    for _ in range(4):
        actor.train_step(batch, loss_fn=sequence_mean_nll)
    weights = {name: tensor.clone() for name, tensor in actor.generation_weights()}
    base = read_weights(model_path)
    assert weights.keys() == {n for n in dict(actor.model.named_parameters()) if not n.endswith(("_A", "_B"))}
    module = actor.model.get_submodule("model.layers.1.self_attn.q_proj")
    assert isinstance(module, LoRALinear) and module.scale == 2.0
    expected = base["model.layers.1.self_attn.q_proj.weight"] + 2.0 * module.lora_B.detach() @ module.lora_A.detach()
    assert torch.allclose(weights["model.layers.1.self_attn.q_proj.weight"], expected, atol=1e-6, rtol=0)
    unwrapped = "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(weights[unwrapped], base[unwrapped])

    rollout = HFRolloutEngine(config=RolloutEngineConfig(model=ModelSpec(path=str(model_path)), pad_token_id=PAD_ID,
                                                         eos_token_id=EOS_ID))
    prompts = build_prompt_batch()
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = rollout.generate(prompts, sampling)
    rollout.update_weights(actor.generation_weights(), version=actor.state_version())
    after = rollout.generate(prompts, sampling)
    # the rollout now computes the trained policy: its log-probs are the actor's (adapters unmerged) ...
    trained = actor.compute_log_probs(after)["log_probs"]
    mask = after["response_mask"].bool()
    assert torch.allclose(after["rollout_log_probs"][mask], trained[mask], atol=1e-5)
    # ... and no longer the base's
    base_actor = build_actor(model_path, lora=None)
    untrained = base_actor.compute_log_probs(after)["log_probs"]
    assert (untrained[mask] - trained[mask]).abs().max() > 1e-2
    assert not torch.equal(before["rollout_log_probs"], after["rollout_log_probs"])


def test_adapter_only_sync_generates_as_the_merged_sync(model_path: Path) -> None:
    """Adapter-only sync (hybridflow.adapter_sync): the base once, then the factors alone; the rollout engine merges
    them into its own base copy. Sampled generation (fp32) equals the merged handover's: same tokens, log-probs within
    1e-6, after each of two updates (the second merge starts from the kept base, not from the first merge)."""
    actor = build_actor(model_path)
    batch = build_training_batch(rows=8)
    config = RolloutEngineConfig(model=ModelSpec(path=str(model_path)), pad_token_id=PAD_ID, eos_token_id=EOS_ID)
    merged, adapters = HFRolloutEngine(config=config), HFRolloutEngine(config=config)
    scales = actor.adapter_scales()
    assert scales == {name: 2.0 for name in lora_modules(actor.model)}
    adapters.update_weights(actor.generation_base_weights(), version=0)
    base = read_weights(model_path)
    assert all(torch.equal(adapters._parameters[name], tensor) for name, tensor in base.items())
    prompts = build_prompt_batch()
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=7)
    factor_bytes = sum(p.numel() * 4 for name, p in actor.model.named_parameters() if name.endswith(("_A", "_B")))
    for version in (1, 2):
        for _ in range(2):
            actor.train_step(batch, loss_fn=sequence_mean_nll)
        merged.update_weights(actor.generation_weights(), version=version)
        adapters.update_adapters(actor.generation_adapters(), scales=scales, version=version)
        stats = actor.last_handover_stats
        # the factors alone moved: the rank-4 adapters, a small fraction of the model's bytes
        assert stats is not None and stats.path == "adapters" and stats.bytes_total == factor_bytes
        assert factor_bytes * 20 < sum(t.numel() * 4 for t in base.values())
        want, got = merged.generate(prompts, sampling), adapters.generate(prompts, sampling)
        assert got.meta["policy_version"] == want.meta["policy_version"] == version
        assert torch.equal(got["responses"], want["responses"])
        mask = want["response_mask"].bool()
        gap = (got["rollout_log_probs"][mask] - want["rollout_log_probs"][mask]).abs().max()
        assert gap <= 1e-6, gap
    # the update moved the policy off the base (the comparison above is not between two base models)
    assert not torch.equal(adapters._parameters["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])


def test_adapter_sync_refuses_bad_input(model_path: Path) -> None:
    actor = build_actor(model_path)
    config = RolloutEngineConfig(model=ModelSpec(path=str(model_path)), pad_token_id=PAD_ID, eos_token_id=EOS_ID)
    rollout = HFRolloutEngine(config=config)
    factors = dict(actor.generation_adapters())
    scales = actor.adapter_scales()
    missing = {name: t for name, t in factors.items() if not name.startswith("model.layers.0.self_attn.q_proj")}
    with pytest.raises(EngineError, match=r"missing \['model.layers.0.self_attn.q_proj.lora_A'"):
        rollout.update_adapters(missing.items(), scales=scales, version=1)
    wrong = dict(factors, **{"model.layers.0.self_attn.q_proj.lora_A": torch.zeros(4, 32)})
    with pytest.raises(EngineError, match=r"expected \[rank, 64\]"):
        rollout.update_adapters(wrong.items(), scales=scales, version=1)
    rollout.sleep()
    rollout.wake()
    with pytest.raises(EngineError, match="needs the base weights loaded"):
        rollout.update_adapters(factors.items(), scales=scales, version=1)
    with pytest.raises(ConfigError, match="lora_sync must be one of"):
        build_actor(model_path, extra={"lora_sync": "delta"}).adapter_scales()
    assert build_actor(model_path, extra={"lora_sync": "merged"}).adapter_scales() == {}
    assert rollout.weights_version == 0  # nothing refused moved the version


def test_checkpoint_holds_adapters_and_resumes_bit_identically(model_path: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    actor = build_actor(model_path, lora=LoraConfig(rank=2, dropout=0.1))  # dropout: the RNG state must resume too
    batch = build_training_batch(rows=8)
    actor.train_step(batch, loss_fn=sequence_mean_nll)
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    keys = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    model_keys = [key for key in keys if key.startswith("model.")]
    assert model_keys and all(key.endswith((".lora_A", ".lora_B")) for key in model_keys), model_keys
    assert len(model_keys) == 2 * 7 * 2  # all-linear: 7 projections × 2 layers, A and B each
    saved = sum(keys[key].size.numel() for key in model_keys)  # type: ignore[union-attr]
    assert saved == sum(p.numel() for name, p in actor.model.named_parameters() if name.endswith(("_A", "_B")))

    straight = [actor.train_step(batch, loss_fn=sequence_mean_nll)["loss"] for _ in range(2)]
    after_straight = {name: t.clone() for name, t in actor.generation_weights()}
    actor.load_checkpoint(str(tmp_path / "ckpt"))
    resumed = [actor.train_step(batch, loss_fn=sequence_mean_nll)["loss"] for _ in range(2)]
    assert straight == resumed
    assert all(torch.equal(after_straight[name], t) for name, t in actor.generation_weights())

    fresh = build_actor(model_path, lora=LoraConfig(rank=2, dropout=0.1))
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    assert [fresh.train_step(batch, loss_fn=sequence_mean_nll)["loss"] for _ in range(2)] == straight

    # adapters only mean something on their base, with their shapes; a full checkpoint is not an adapter checkpoint
    with pytest.raises(CheckpointError, match="another base model"):
        build_actor(prepare_model(tmp_path, seed=1), lora=LoraConfig(rank=2)).load_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match="rank"):
        build_actor(model_path, lora=LoraConfig(rank=3)).load_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match="holds LoRA adapters only"):
        build_actor(model_path, lora=None).load_checkpoint(str(tmp_path / "ckpt"))


def test_bad_lora_settings_are_refused_with_the_fix(model_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'qproj' names no module of Qwen2ForCausalLM.*Did you mean 'q_proj'"):
        build_actor(model_path, lora=LoraConfig(rank=4, target_modules=("qproj",)))
    with pytest.raises(ConfigError, match=r"LoRA wraps nn\.Linear layers only"):
        build_actor(model_path, lora=LoraConfig(rank=4, target_modules=("self_attn",)))
    with pytest.raises(ConfigError, match="tied to the input embeddings"):
        build_actor(model_path, lora=LoraConfig(rank=4, target_modules=("lm_head",)))
    with pytest.raises(ConfigError, match="lora trains the actor's adapters; this engine is a critic"):
        FSDPTrainingEngine(role="critic", config=TrainingEngineConfig(model=ModelSpec(path=str(model_path)),
                                                                      lora=LoraConfig(rank=4)))
    for bad in ({"rank": 0}, {"rank": -2}, {"rank": 4, "dropout": 1.0}, {"rank": 4, "target_modules": ()},
                {"rank": 4, "target_modules": "all"}):
        with pytest.raises(ConfigError, match="lora"):
            LoraConfig(**bad)  # type: ignore[arg-type]
    # the same checks at config load, naming the key
    with pytest.raises(ConfigError, match=r"actor.lora: lora.rank = 0: .*Fix: set actor.lora.rank"):
        load_config(None, ["actor.lora.rank=0"])
    with pytest.raises(ConfigError, match=r"actor\.lora\.rank: required but missing"):
        load_config(None, ["actor.lora.alpha=8"])
    with pytest.raises(ConfigError, match="target_modules is empty"):
        load_config(None, ["actor.lora.rank=4", "actor.lora.target_modules=[]"])
    # every key reaches the engine config the trainer builds
    config = load_config(None, ["actor.lora.rank=4", "actor.lora.alpha=2", "actor.lora.dropout=0.25",
                                "actor.lora.target_modules=[q_proj, v_proj]"])
    assert build_lora_config(config.actor) == LoraConfig(rank=4, alpha=2.0, dropout=0.25,
                                                         target_modules=("q_proj", "v_proj"))
    assert build_lora_config(load_config(None, []).actor) is None
    example = Path(__file__).resolve().parents[3] / "examples" / "grpo_arithmetic_lora.yaml"
    assert build_lora_config(load_config(example).actor) == LoraConfig(rank=8, alpha=16.0)


def _sharded_lora_rank(rank: int, world_size: int, model_path: str, workdir: str) -> None:
    """Module-level (spawned): a LoRA actor FSDP-sharded over 2 ranks trains, hands over on both paths, resumes."""
    # rank 3: lora_A's 3 rows shard unevenly over 2 ranks (2 + 1), which the adapters' one flat all-gather pads
    actor = build_actor(Path(model_path), lora=LoraConfig(rank=3, target_modules=("q_proj", "o_proj", "up_proj")),
                        micro_batch_size=2)
    batch = build_training_batch(rows=8).chunk(world_size)[rank]
    actor.train_step(batch, loss_fn=sequence_mean_nll)
    adapters = {name: tensor.clone() for name, tensor in actor.generation_adapters()}
    one_by_one = {name: p.full_tensor() for name, p in actor.model.named_parameters() if name.endswith("_A")
                  or name.endswith("_B")}
    assert adapters.keys() == one_by_one.keys() and len(adapters) == 3 * 2 * 2
    assert all(torch.equal(adapters[name], one_by_one[name]) for name in adapters)
    reshard = {name: tensor.clone() for name, tensor in actor.generation_weights()}
    from hybridflow_fsdp.handover import stream_generation_weights

    stream = {name: tensor.clone() for name, tensor in stream_generation_weights(actor)}
    actor.export_hf(f"{workdir}/exported")
    actor.save_checkpoint(f"{workdir}/checkpoint")
    straight = [actor.train_step(batch, loss_fn=sequence_mean_nll)["loss"] for _ in range(2)]
    actor.load_checkpoint(f"{workdir}/checkpoint")
    resumed = [actor.train_step(batch, loss_fn=sequence_mean_nll)["loss"] for _ in range(2)]
    torch.save({"reshard": reshard, "stream": stream, "straight": straight, "resumed": resumed,
                "sharded": actor.sharded}, f"{workdir}/rank{rank}.pt")


def test_sharded_adapters_merge_on_both_handover_paths_and_resume(model_path: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from hybridflow.testing.contracts.spawn import run_rank_groups

    run_rank_groups([(_sharded_lora_rank, 2, (str(model_path), str(tmp_path)))], workdir=tmp_path, timeout_s=240)
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    exported = load_file(tmp_path / "exported" / "model.safetensors")  # merged on rank 0 from the full state
    for result in results:
        assert result["sharded"] and result["straight"] == result["resumed"]
        # each rank's shards (reshard) and full tensors (stream) are the merged weights the export holds
        assert result["stream"].keys() - {"lm_head.weight"} == exported.keys()
        assert all(torch.allclose(result["stream"][name], exported[name], atol=1e-6) for name in exported)
        merged = "model.layers.0.self_attn.o_proj.weight"
        assert not torch.equal(exported[merged], read_weights(model_path)[merged])
    for name in exported:  # the two ranks' reshard shards together are the full merged tensor (tg = 1: full each)
        assert all(torch.allclose(r["reshard"][name], exported[name], atol=1e-6) for r in results), name


def _bf16_lora_rank(rank: int, world_size: int, model_path: str, workdir: str) -> None:
    """Module-level (spawned): a LoRA actor under mixed_precision=bf16 (what ``auto`` picks from 1M parameters on a
    CPU with native bf16) on 2 ranks trains, reduces its adapters' gradients in bf16, and hands the merged weights to
    a bf16 rollout engine (``rollout.dtype: auto``) that then computes the trained policy."""
    from hybridflow.testing.collectives import CollectiveCounter

    counter = CollectiveCounter()
    actor = build_actor(Path(model_path), micro_batch_size=2, mixed_precision="bf16")
    rollout = HFRolloutEngine(config=RolloutEngineConfig(model=ModelSpec(path=model_path, dtype="bfloat16"),
                                                         pad_token_id=PAD_ID, eos_token_id=EOS_ID))
    batch = build_training_batch(rows=8).chunk(world_size)[rank]
    counter.take()
    counter.phase = "update"
    losses = [actor.train_step(batch, loss_fn=sequence_mean_nll)["loss"] for _ in range(5)]
    counts = counter.take()
    counter.close()
    state = dict(actor.model.named_parameters())
    # the adapters' bf16 bytes (a DTensor's numel is the global tensor's)
    adapter_bytes = sum(p.numel() * 2 for name, p in state.items() if name.endswith((".lora_A", ".lora_B")))
    rollout.update_weights(actor.generation_weights(), version=actor.state_version())
    after = rollout.generate(build_prompt_batch(), SamplingParams(temperature=0.0, max_new_tokens=6))
    torch.save({"losses": losses, "counts": counts, "reduce_dtype": actor.reduce_dtype,
                "adapter_bytes": adapter_bytes, "rollout_dtypes": {p.dtype for p in rollout.model.parameters()},
                "rollout_log_probs": after["rollout_log_probs"], "mask": after["response_mask"].bool(),
                "trained": actor.compute_log_probs(after)["log_probs"]}, f"{workdir}/bf16_rank{rank}.pt")


def test_bf16_lora_trains_on_two_ranks_and_generates_the_trained_policy(model_path: Path, tmp_path: Path) -> None:
    from hybridflow.testing.contracts.spawn import run_rank_groups

    run_rank_groups([(_bf16_lora_rank, 2, (str(model_path), str(tmp_path)))], workdir=tmp_path, timeout_s=240)
    for rank in range(2):
        result = torch.load(tmp_path / f"bf16_rank{rank}.pt", weights_only=False)
        assert result["losses"][-1] < result["losses"][0] - 0.05, result["losses"]
        # only the adapters' gradients are reduced, in bf16 (auto on CPU), once a step however many micro-batches
        # (2 of 2 rows here; accumulated unsharded): a rank receives the other rank's half, half their bf16 bytes
        assert result["reduce_dtype"] == "bfloat16"
        _, nbytes = result["counts"]["update"]["reduce_scatter_single"]
        assert nbytes == 5 * result["adapter_bytes"] // 2, (result["counts"], result["adapter_bytes"])
        # the bf16 rollout engine computes the trained policy: its log-probs are the actor's within bf16's rounding
        assert result["rollout_dtypes"] == {torch.bfloat16}
        mask = result["mask"]
        difference = (result["rollout_log_probs"][mask] - result["trained"][mask]).abs().max()
        assert difference < 0.1, difference
