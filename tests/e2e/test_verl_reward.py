"""End to end: a verl reward file (per-sample ``compute_score``) next to the job's YAML trains GRPO as it is; the
dataset's ``extra_info`` reaches it through the workers, and its extra dict keys land in the metrics."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from hybridflow.config import load_config
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close
from hybridflow.trainer.progress import read_metrics

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arithmetic_scratch.yaml"

VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == str(ground_truth)
    return {"score": float(correct), "acc": float(correct), "prompt_index": float(extra_info["index"]) + 1.0}
'''


@pytest.mark.slow
def test_grpo_with_a_verl_reward_file(tmp_path: Path) -> None:
    job = tmp_path / "job"
    (job / "rewards").mkdir(parents=True)
    (job / "rewards" / "gsm8k_like.py").write_text(textwrap.dedent(VERL_REWARD))
    config = yaml.safe_load(EXAMPLE.read_text())
    config["reward"] = {"function": "rewards/gsm8k_like.py:compute_score"}
    (job / "job.yaml").write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    trainer = Trainer(load_config(job / "job.yaml", [
        f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.tensorboard=false", "trainer.resume=never",
        "trainer.total_steps=2", "trainer.checkpoint_every=0", "trainer.val_every=0", "trainer.val_n=1",
        "data.task.num_val_prompts=0"]), progress=False)
    history = fit_and_close(trainer)
    assert len(history) == 2
    for metrics in history:
        assert metrics["reward/extra/acc"] == metrics["reward/mean"]
        assert metrics["reward/extra/prompt_index"] >= 1.0  # every row's extra_info reached the function
    assert [m["reward/extra/prompt_index"] for m in read_metrics(run_dir)] == [
        m["reward/extra/prompt_index"] for m in history]
