"""Per-role engine options in the fsdp engine (1 gloo rank): ``gradient_checkpointing`` recomputes decoder layers in
the backward pass without changing the update; ``mixed_precision`` computes the critic and reference in bf16."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.engines import ModelSpec, OptimConfig, TrainingEngineConfig
from hybridflow.testing.contracts.rollout import prepare_model
from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll
from hybridflow_fsdp.models import transformer_blocks
from hybridflow_fsdp.training import FSDPTrainingEngine


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_model(tmp_path_factory.mktemp("fsdp_checkpointing"))


def value_loss(outputs, micro_batch):  # type: ignore[no-untyped-def]
    """Squared values over response tokens (a loss for the critic's ``values``)."""
    mask = micro_batch["response_mask"].float()
    return (outputs["values"] ** 2 * mask).sum() / micro_batch.meta["loss_scale_tokens"], {}


@pytest.mark.parametrize("role, loss_fn", [("actor", sequence_mean_nll), ("critic", value_loss)])
def test_gradient_checkpointing_recomputes_layers_and_keeps_the_update(model_path: Path, role: str, loss_fn) -> None:
    results = {}
    for checkpointing in (False, True):
        engine = FSDPTrainingEngine(role=role, config=TrainingEngineConfig(
            model=ModelSpec(path=str(model_path)), micro_batch_size=4, optim=OptimConfig(lr=1e-2, eps=1e-2),
            gradient_checkpointing=checkpointing, extra={"lean_forward": False}))
        # HF checkpoints a layer's forward (the layer's own hooks stay outside): count its first module's calls
        calls = []
        transformer_blocks(engine.model)[0].self_attn.register_forward_hook(lambda *_, sink=calls: sink.append(1))
        engine.train_step(build_training_batch(rows=8), loss_fn=loss_fn)
        results[checkpointing] = ({n: p.detach().clone() for n, p in engine.model.named_parameters()}, len(calls))
    (plain, plain_calls), (checkpointed, checkpointed_calls) = results[False], results[True]
    assert (plain_calls, checkpointed_calls) == (2, 4)  # two micro-batches; each layer forward runs again in backward
    gap = max((plain[name] - checkpointed[name]).abs().max().item() for name in plain)
    assert gap < 1e-6, f"checkpointing changed the update by {gap}"


def test_a_frozen_role_never_checkpoints(model_path: Path) -> None:
    """The reference runs no backward pass (the config refuses the key there; the engine keeps it off)."""
    engine = FSDPTrainingEngine(role="reference", config=TrainingEngineConfig(
        model=ModelSpec(path=str(model_path)), gradient_checkpointing=True))
    assert not engine.model.is_activation_checkpointing
    assert engine.lean is not None  # the lean forward stays available to a frozen role


@pytest.mark.parametrize("role, method, column", [("critic", "compute_values", "values"),
                                                  ("reference", "compute_log_probs", "log_probs")])
def test_critic_and_reference_compute_in_bf16(model_path: Path, role: str, method: str, column: str) -> None:
    """``mixed_precision`` reaches the critic and the reference: bf16 compute (close to, not equal to, fp32)."""
    batch = build_training_batch(rows=4)
    outputs = {}
    for precision in ("none", "bf16"):
        engine = FSDPTrainingEngine(role=role, config=TrainingEngineConfig(
            model=ModelSpec(path=str(model_path)), mixed_precision=precision))
        assert engine.sharded == (precision == "bf16")
        outputs[precision] = getattr(engine, method)(batch)[column]
    gap = (outputs["none"] - outputs["bf16"]).abs().max().item()
    assert 0 < gap < 0.1, f"bf16 {column} differ from fp32 by {gap}"
