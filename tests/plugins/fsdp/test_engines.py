"""In-process (1 gloo rank) behaviour of the fsdp training engine and the hf rollout engine beyond the contracts:
gradient accumulation, token-mean normalisation, mini-batches, schedules, sampling filters, bf16, errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hybridflow.engines import ModelSpec, OptimConfig, RolloutEngineConfig, SamplingParams, TrainingEngineConfig
from hybridflow.errors import CheckpointError, ConfigError, EngineError
from hybridflow.testing.contracts.rollout import build_prompt_batch, prepare_model, read_weights
from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll
from hybridflow_fsdp.optim import compute_lr_factor
from hybridflow_fsdp.rollout import HFRolloutEngine
from hybridflow_fsdp.sampling import filter_logits
from hybridflow_fsdp.training import LOSS_SCALE_TOKENS, FSDPTrainingEngine


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_model(tmp_path_factory.mktemp("fsdp_engines"))


def actor(path: Path, **options) -> FSDPTrainingEngine:
    options.setdefault("optim", OptimConfig(lr=1e-2))
    return FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(model=ModelSpec(path=str(path)), **options))


def weights(engine: FSDPTrainingEngine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.generation_weights()}


def token_mean_nll(outputs, micro_batch):
    """Token-mean NLL over the whole mini-batch, exact under micro-batching via the engine's global counts."""
    mask = micro_batch["response_mask"].float()
    return -(outputs["log_probs"] * mask).sum() / micro_batch.meta[LOSS_SCALE_TOKENS], {}


@pytest.mark.parametrize("loss_fn", [sequence_mean_nll, token_mean_nll], ids=["row_mean", "token_mean"])
def test_gradient_accumulation_equals_full_batch(model_path: Path, loss_fn) -> None:
    batch = build_training_batch(rows=8)
    results = []
    for micro_batch_size in (8, 3):
        engine = actor(model_path, micro_batch_size=micro_batch_size, optim=OptimConfig(lr=1e-2, eps=1e-2))
        engine.train_step(batch, loss_fn=loss_fn)
        results.append(weights(engine))
    # a large Adam eps keeps the update proportional to the gradient, so the comparison sees gradient errors
    initial = read_weights(model_path)
    moved = max((results[0][n] - initial[n]).abs().max().item() for n in results[0] if n in initial)
    gap = max((results[0][n] - results[1][n]).abs().max().item() for n in results[0])
    assert moved > 1e-3 and gap < 1e-6, f"micro-batches of 3 differ from one full batch by {gap}"


def test_mini_batches_take_several_optimizer_steps(model_path: Path) -> None:
    engine = actor(model_path, micro_batch_size=2)
    metrics = engine.train_step(build_training_batch(rows=8), loss_fn=sequence_mean_nll, mini_batch_size=4)
    assert metrics["optimizer_steps"] == 2 and engine.state_version() == 2
    with pytest.raises(ConfigError, match="multiple of"):
        engine.train_step(build_training_batch(rows=8), loss_fn=sequence_mean_nll, mini_batch_size=3)


def test_learning_rate_schedule() -> None:
    config = OptimConfig(lr=1.0, warmup_steps=2, total_steps=6, schedule="cosine", min_lr_ratio=0.1)
    factors = [compute_lr_factor(step, config) for step in range(7)]
    assert factors[:2] == [0.5, 1.0] and factors[2] == pytest.approx(1.0)
    assert factors[4] == pytest.approx(0.55) and factors[6] == pytest.approx(0.1)
    linear = OptimConfig(lr=1.0, total_steps=4, schedule="linear")
    assert [compute_lr_factor(s, linear) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    with pytest.raises(ConfigError, match="total_steps"):
        compute_lr_factor(0, OptimConfig(schedule="cosine"))


def test_bf16_mixed_precision_trains(model_path: Path) -> None:
    engine = actor(model_path, mixed_precision="bf16", micro_batch_size=4)
    batch = build_training_batch(rows=8)
    before = sequence_mean_nll(engine.compute_log_probs(batch), batch)[0].item()
    for _ in range(3):
        engine.train_step(batch, loss_fn=sequence_mean_nll)
    after = sequence_mean_nll(engine.compute_log_probs(batch), batch)[0].item()
    assert after < before - 1e-2
    assert all(t.dtype == torch.float32 for _, t in engine.generation_weights()), "master weights stay fp32"


def test_role_and_checkpoint_errors(model_path: Path, tmp_path: Path) -> None:
    reference = FSDPTrainingEngine(role="reference", config=TrainingEngineConfig(model=ModelSpec(path=str(model_path))))
    with pytest.raises(EngineError, match="train_step"):
        reference.train_step(build_training_batch(), loss_fn=sequence_mean_nll)
    with pytest.raises(EngineError, match="compute_values"):
        reference.compute_values(build_training_batch())
    with pytest.raises(CheckpointError, match="no complete fsdp checkpoint"):
        actor(model_path).load_checkpoint(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="role"):
        FSDPTrainingEngine(role="judge", config=TrainingEngineConfig(model=ModelSpec(path=str(model_path))))


def test_filter_logits_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.1)).tolist() == [[False, True, True, True]]


def test_top_k_one_sampling_is_greedy(model_path: Path) -> None:
    engine = HFRolloutEngine(config=RolloutEngineConfig(model=ModelSpec(path=str(model_path))))
    batch = build_prompt_batch()
    sampled = engine.generate(batch, SamplingParams(temperature=1.5, top_k=1, max_new_tokens=6, seed=9))
    greedy = engine.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=6))
    assert torch.equal(sampled["responses"], greedy["responses"])
    assert "input_ids" in batch and batch["input_ids"].shape[1] < sampled["input_ids"].shape[1], "input batch kept"


def test_rollout_weight_lifecycle_errors(model_path: Path) -> None:
    engine = HFRolloutEngine(config=RolloutEngineConfig(model=ModelSpec(path=str(model_path))))
    state = read_weights(model_path)
    with pytest.raises(EngineError, match="unknown parameter"):
        engine.update_weights([("not.a.weight", torch.zeros(1))], version=1)
    engine.sleep()
    assert engine.resident_weight_bytes() == 0
    with pytest.raises(EngineError, match="asleep"):
        engine.generate(build_prompt_batch(), SamplingParams())
    engine.wake()
    with pytest.raises(EngineError, match="weights were freed"):
        engine.generate(build_prompt_batch(), SamplingParams())
    partial = list(state.items())[:3]
    with pytest.raises(EngineError, match="cover every parameter"):
        engine.update_weights(partial, version=1)
    engine.update_weights(state.items(), version=2)
    assert engine.generate(build_prompt_batch(), SamplingParams(max_new_tokens=2)).meta["policy_version"] == 2


def test_plugin_registers_engines_and_layouts() -> None:
    from hybridflow import registries
    from hybridflow.plugins import load_plugins

    load_plugins(strict=False)
    assert "fsdp" in registries.training_engines.names() and "hf" in registries.rollout_engines.names()
    layout = registries.layouts.get("fsdp")({"w": (5, 4)}, data=2)
    assert [p.box for p in layout.pieces(1)["w"]] == [((3, 5), (0, 4))]
    assert [p.box for p in registries.layouts.get("hf")({"w": (5, 4)}, data=2).pieces(1)["w"]] == [((0, 5), (0, 4))]


def test_actor_train_step_reports_the_policy_entropy_of_its_forward(model_path: Path) -> None:
    """``actor/entropy`` of a step without entropy bonus = the mean token entropy the weights had before it."""
    from hybridflow.algorithms.losses import make_actor_loss_fn

    batch = build_training_batch(rows=4)
    engine = actor(model_path, micro_batch_size=4)
    before = engine.compute_log_probs(batch, with_entropy=True)
    mask = batch["response_mask"].bool()
    expected = float(before["entropy"][mask].mean())
    batch["old_log_probs"] = before["log_probs"]
    metrics = engine.train_step(batch, loss_fn=make_actor_loss_fn())
    assert metrics["actor/entropy"] == pytest.approx(expected, rel=1e-5)
    assert 0.0 < expected < math.log(engine.model.config.vocab_size)
