"""``rollout.multi_turn.enable`` runs the trainer's actor generation through the agent loop (GRPO, 2 CPU workers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.errors import ConfigError
from hybridflow.testing.chat_tokenizer import save_tiny_chat_model
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close


def _prompts(path: Path) -> Path:
    rows = [{"prompt": [{"role": "user", "content": f"What is {a}*{b}?"}], "data_source": "hybridflow/arithmetic",
             "reward_model": {"ground_truth": str(a * b)}, "extra_info": {"index": i}}
            for i, (a, b) in enumerate([(12, 34), (56, 78), (91, 23), (45, 67)] * 2)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.slow  # ~30-40 CPU-seconds: a 2-step run with 3-turn conversations
def test_grpo_with_multi_turn_rollouts(tmp_path: Path, tiny_config) -> None:  # type: ignore[no-untyped-def]
    model = save_tiny_chat_model(tmp_path / "chat-model")
    config = tiny_config(
        tmp_path / "run", "model.preset=null", f"model.path={model}",
        f"data.train_files=[{json.dumps(str(_prompts(tmp_path / 'prompts.jsonl')))}]", "data.max_prompt_length=400",
        "data.batch_size=4", "rollout.n=2", "rollout.max_new_tokens=12", "rollout.multi_turn.enable=true",
        'rollout.multi_turn.tools=["calculator"]', "rollout.multi_turn.max_turns=3",
        "rollout.multi_turn.max_tokens=80", "trainer.total_steps=2", "trainer.checkpoint_every=0")
    trainer = Trainer(config, progress=False)
    history = fit_and_close(trainer)
    assert len(history) == 2
    for metrics in history:
        # the agent path ran: its per-sample metrics are there (a random model rarely calls a tool)
        assert 1 <= metrics["num_turns/min"] <= metrics["num_turns/max"] <= 3
        assert metrics["tool_call_counts/min"] >= 0 and "tool_error_counts/mean" in metrics


def test_multi_turn_needs_a_chat_tokenizer(tmp_path: Path, tiny_config) -> None:  # type: ignore[no-untyped-def]
    config = tiny_config(tmp_path / "run", "rollout.multi_turn.enable=true", 'rollout.multi_turn.tools=["python"]')
    with pytest.raises(ConfigError, match="needs a tokenizer with a chat template"):
        Trainer(config, progress=False)
