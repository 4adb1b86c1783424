"""The verl migration example end to end: ``examples/verl_gsm8k/prepare.py`` writes verl-format parquet (chat-message
prompts, ``reward_model.ground_truth``, ``extra_info``) and a model directory with a locally trained BPE tokenizer and
chat template; ``examples/grpo_verl_gsm8k.yaml`` trains GRPO on it with the example's verl-signature reward file,
taken as it is (its extra keys logged, validation named ``val-core/openai/gsm8k/...``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from example_scripts import load_example_script
from hybridflow.config import load_config
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close
from hybridflow.trainer.progress import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_verl_gsm8k.yaml"




@pytest.mark.slow
def test_grpo_on_the_verl_example_with_its_reward_file_unchanged(tmp_path: Path) -> None:
    prepare = load_example_script("verl_gsm8k/prepare.py").prepare
    out = prepare(tmp_path / "job", num_train=64, num_test=16, vocab_size=300)
    run_dir = tmp_path / "run"
    config = load_config(EXAMPLE, [
        f"model.path={out / 'model'}", f"data.train_files=[{out / 'data' / 'train.parquet'}]",
        f"data.val_files=[{out / 'data' / 'test.parquet'}]", f"trainer.run_dir={run_dir}", "trainer.progress=false",
        "trainer.tensorboard=false", "trainer.resume=never", "trainer.total_steps=2", "trainer.checkpoint_every=0",
        "trainer.val_every=2", "data.max_prompt_length=128", "rollout.max_new_tokens=12", "rollout.n=4",
        "trainer.val_n=4", "data.batch_size=8"])
    assert config.reward.function is not None and config.reward.function.endswith(
        "examples/verl_gsm8k/gsm8k_reward.py:compute_score")  # the shipped file, resolved next to the YAML
    trainer = Trainer(config, progress=False)
    history = fit_and_close(trainer)
    assert len(history) == 2
    for metrics in history:
        # the file's dict return: score is the reward, the other keys are logged as they are
        assert 0.0 <= metrics["reward/extra/acc"] <= metrics["reward/extra/formatted"] <= 1.0
        assert metrics["reward/mean"] >= metrics["reward/extra/acc"]
    validation = [row for row in read_metrics(run_dir) if "reward/mean" not in row]
    assert [row["step"] for row in validation] == [0, 2]
    for row in validation:  # per data_source as verl names it; the reward adds the format score to exact matches
        assert 0.0 <= row["val-core/openai/gsm8k/acc/mean@1"] <= row["val-aux/openai/gsm8k/reward/mean@1"] <= 1.0
