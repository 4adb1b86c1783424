"""The reward model `hybridflow rm` writes, on the RL trainer's own path: a run configured with
``reward.model.path: RUN_DIR/hf`` builds its ``reward_model`` role from it (the RewardModelWorker on the Ray pool, the
fsdp engine sharded over 2 ranks), and that worker scores held-out preference pairs with the trained model's scores
and ranks them as the RM run measured. (The true preference score that PPO raises from it is bench/rm_pipeline.py's,
docs/benchmarks/rm_pipeline.md.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close
from hybridflow.trainer.rm import RewardModelTrainer, load_rm_config, score_sequences

RM_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rm_arithmetic.yaml"


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[RewardModelTrainer, Path]:
    """30 RM steps from the tiny preset (the from-scratch policy's model and character tokenizer)."""
    run_dir = tmp_path_factory.mktemp("rm_pipeline") / "rm"
    trainer = RewardModelTrainer(load_rm_config(RM_EXAMPLE, [
        "model.path=null", "model.preset=tiny-qwen2", "trainer.total_steps=30", "trainer.progress=false",
        "trainer.tensorboard=false", f"trainer.run_dir={run_dir}"]))
    return trainer, fit_and_close(trainer)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 169 s at a load average of ~20 on the 2-core box (Ray start-up, 2 workers, 30 RM steps)
def test_trainers_reward_model_role_scores_with_the_trained_model(tmp_path: Path, tiny_config: Any,
                                                                  rm_run) -> None:  # type: ignore[no-untyped-def]
    rm_trainer, target = rm_run
    config = tiny_config(tmp_path / "run", "trainer.total_steps=1", "trainer.checkpoint_every=0",
                         "reward.function=null", f"reward.model.path={target}")
    trainer = Trainer(config, progress=False)
    pairs = rm_trainer.val_pairs
    assert pairs is not None
    try:
        trainer.start()
        assert trainer.groups is not None
        reward_model = trainer.groups.role("reward_model")
        assert reward_model is not None, "reward.model.path set, but the run built no reward_model role"
        scores = {side: reward_model.compute_scores(getattr(pairs, side).with_meta(iteration=0, policy_version=0))
                  .get(timeout=300)["scores"] for side in ("chosen", "rejected")}
    finally:
        trainer.close()
    with torch.no_grad():
        trained = score_sequences(rm_trainer.model.eval(), pairs.chosen["input_ids"], pairs.chosen["attention_mask"])
    assert torch.allclose(scores["chosen"], trained, atol=1e-4), (scores["chosen"][:4], trained[:4])
    accuracy = float((scores["chosen"] > scores["rejected"]).float().mean())
    assert accuracy == pytest.approx(rm_trainer.validation_history[-1]["val/accuracy"], abs=1e-6)
    assert accuracy >= 0.9
