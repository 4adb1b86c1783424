"""The shipped tool task learns on CPU: SFT on the shipped multi-turn demonstrations (examples/sft_tool_calc.yaml),
then GRPO with the calculator tool (examples/grpo_tool_calc.yaml) raises the tool-call rate and the reward.

Measured on a 2-core box shared with other jobs (one seed, hf engine): the tool-call rate went 0.78 at step 1 to
0.95-0.98 over steps 13-16, the reward from 0.42-0.70 over steps 1-4 to 0.44-0.73 over steps 13-16 (the SFT model
already copies the tool's result about two times in three). Slow: the SFT fixture took 362 s here, the hf GRPO run
65 s. The reward assertion is weak on purpose (no drop, a floor): one seed does not support a stated rise. The vllm
engine runs 2 steps of the same job from the same SFT model (a full learning run of it cost 71 s more in CI).
The SFT fixture's 200 steps are not cut: after 100 or 150 SFT steps (one seed each, same box) the 16 GRPO steps
collapsed instead (tool-call rate 0.64 -> 0.06-0.34 and reward 0.0 throughout after 100; 0.58-0.84 over steps 1-4,
then 0.0-0.02 and reward 0.0 from step 5 after 150), failing every assertion below. The GRPO run has 12 steps
(was 16; constant lr, so they are the first 12 of a 16-step run): after 200 SFT steps one run went tool-call rate
0.61 at step 1 to 0.95 over steps 9-12 (0.93 over 13-16), reward 0.38 over steps 1-4 and 0.62 over steps 5-12 (the
floor below; 0.56 over steps 9-16).
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

import pytest

from hybridflow.config import load_config
from hybridflow.tasks.tool_calc import save_tool_calc_model
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close
from hybridflow.trainer.sft import SFTTrainer, load_sft_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tool-calc")
    init = save_tool_calc_model(root / "init")
    config = load_sft_config(EXAMPLES / "sft_tool_calc.yaml", [
        f"model.path={init}", f"trainer.run_dir={root / 'sft'}", "trainer.progress=false",
        "trainer.tensorboard=false", "trainer.total_steps=200"])
    trainer = SFTTrainer(config, progress=False)
    return fit_and_close(trainer)


def _tool_calc_config(model: Path, run_dir: Path, engine: str, steps: int):  # type: ignore[no-untyped-def]
    data = EXAMPLES / "data"
    return load_config(EXAMPLES / "grpo_tool_calc.yaml", [
        f"model.path={model}", f"trainer.run_dir={run_dir}", f"rollout.engine={engine}",
        f"data.train_files=[{json.dumps(str(data / 'tool_calc_train.jsonl'))}]",
        f"data.val_files=[{json.dumps(str(data / 'tool_calc_val.jsonl'))}]",
        f"trainer.total_steps={steps}", "trainer.val_every=0", "trainer.val_n=8", "trainer.checkpoint_every=0",
        "trainer.progress=false", "trainer.tensorboard=false", "trainer.resume=never"])


@pytest.mark.slow  # ~5 min on a loaded 2-core box: 200 SFT steps, 12 GRPO steps of 64 conversations
def test_grpo_raises_tool_use_and_reward(sft_model: Path, tmp_path: Path) -> None:
    """The learning run (hf engine): the tool-call rate rises and the reward holds a floor."""
    history = fit_and_close(Trainer(_tool_calc_config(sft_model, tmp_path / "run", "hf", 12), progress=False))
    tool_rate = [metrics["tool_call_counts/mean"] for metrics in history]
    reward = [metrics["reward/mean"] for metrics in history]
    assert mean(tool_rate[-4:]) >= tool_rate[0] + 0.1, tool_rate
    assert mean(tool_rate[-4:]) >= 0.85, tool_rate
    assert mean(reward[-4:]) >= mean(reward[:4]) - 0.05 and mean(reward[-8:]) >= 0.5, reward


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_engine_runs_the_tool_conversations_and_updates(sft_model: Path, tmp_path: Path) -> None:
    """The same job on the vllm engine, 2 steps: the learning itself is the hf run's (the trainer, the agent loop and
    the update are shared code) and vllm's weight handover is test_vllm_grpo's; this checks that vllm runs the
    conversations of the agent path from the SFT model: it calls the tool and some final answers are right, which a
    model that cannot multiply two-digit numbers only reaches when the calculator's result came back into its
    context. Measured once (loaded 2-core box): tool-call rate 0.40 over the 2 steps, reward 0.19 and 0.25 (below
    the hf engine's first steps, 0.73-0.78 and 0.42-0.70); asserted: ≥ 0.2 and ≥ 0.1 over 128 conversations."""
    pytest.importorskip("vllm")
    history = fit_and_close(Trainer(_tool_calc_config(sft_model, tmp_path / "run", "vllm", 2), progress=False))
    assert [m["actor/policy_version"] for m in history] == [1.0, 2.0]
    assert mean(m["tool_call_counts/mean"] for m in history) >= 0.2, history
    assert mean(m["reward/mean"] for m in history) >= 0.1, history
