"""The directory ``hybridflow rm`` writes, loaded the way an RL run loads its reward model (``reward.model.path``: the
fsdp training engine in role ``reward_model``, whose ``compute_scores`` the trainer's reward-model worker calls):
it scores held-out pairs with the trained model's scores and ranks them as the RM run measured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.engines import ModelSpec, TrainingEngineConfig
from hybridflow.trainer.cli import fit_and_close
from hybridflow.trainer.rm import RewardModelTrainer, load_rm_config, score_sequences
from hybridflow_fsdp.training import FSDPTrainingEngine

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "rm_arithmetic.yaml"


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[RewardModelTrainer, Path]:
    run_dir = tmp_path_factory.mktemp("rm_dir") / "rm"
    config = load_rm_config(EXAMPLE, ["model.path=null", "model.preset=tiny-qwen2", "trainer.total_steps=30",
                                      "trainer.progress=false", "trainer.tensorboard=false",
                                      f"trainer.run_dir={run_dir}"])
    trainer = RewardModelTrainer(config)
    return trainer, fit_and_close(trainer)


def test_fsdp_reward_model_engine_scores_with_the_trained_model(rm_run) -> None:  # type: ignore[no-untyped-def]
    trainer, target = rm_run
    engine = FSDPTrainingEngine(role="reward_model",
                                config=TrainingEngineConfig(model=ModelSpec(path=str(target)), micro_batch_size=64))
    pairs = trainer.val_pairs
    assert pairs is not None
    chosen = engine.compute_scores(pairs.chosen)["scores"]
    rejected = engine.compute_scores(pairs.rejected)["scores"]
    with torch.no_grad():
        trained = score_sequences(trainer.model.eval(), pairs.chosen["input_ids"], pairs.chosen["attention_mask"])
    # the engine reads the trained score head (a fresh head would score ~0 with std ~0.05 at init)
    assert torch.allclose(chosen, trained, atol=1e-4), (chosen[:4], trained[:4])
    accuracy = float((chosen > rejected).float().mean())
    assert accuracy == pytest.approx(trainer.validation_history[-1]["val/accuracy"], abs=1e-6)
    assert accuracy >= 0.9
