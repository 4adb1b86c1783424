"""Environments as servers on the trainer's path (rollout.env): GRPO steps whose every sample is an episode against
the tool-calc environment served over OpenEnv's WebSocket protocol by a server outside the trainer
(``rollout.env.url``), on a tiny random chat model: each step opens one session per sample on that server, the
environment's reward is the step's score, and the trained rows are the rollout's tokens (the actor's recomputed
log-probs match the rollout's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.agent.env_server import EnvServer
from hybridflow.config import load_config
from hybridflow.tasks.tool_calc_env import ToolCalcEnv
from hybridflow.testing.chat_tokenizer import save_tiny_chat_model
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow  # one FSDP rank, 2 steps: 42 s wall on the loaded 2-core box (19 s of it Ray's start)
def test_grpo_steps_run_against_an_environment_server(tmp_path: Path) -> None:
    model = save_tiny_chat_model(tmp_path / "model")
    server = EnvServer(ToolCalcEnv)
    url = server.start()
    try:
        data = EXAMPLES / "data"
        config = load_config(EXAMPLES / "grpo_tool_calc_env.yaml", [
            f"model.path={model}", f"trainer.run_dir={tmp_path / 'run'}", "rollout.env.entry=null",
            f"rollout.env.url={url}", f"data.train_files=[{json.dumps(str(data / 'tool_calc_train.jsonl'))}]",
            "resource_pools.main.devices_per_node=[1]", "data.batch_size=2", "data.max_prompt_length=64",
            "rollout.env.tools=[]",  # the tiny chat tokenizer writes the calculator schema in 286 tokens
            "rollout.n=4", "rollout.max_new_tokens=8", "rollout.env.max_tokens=24", "trainer.total_steps=2",
            "trainer.val_every=0", "trainer.checkpoint_every=0", "trainer.progress=false", "trainer.tensorboard=false",
            "trainer.resume=never", "actor.recompute_log_probs=true"])
        history = fit_and_close(Trainer(config, progress=False))
    finally:
        server.stop()
    assert [metrics["actor/policy_version"] for metrics in history] == [1.0, 2.0]
    assert server.sessions_opened == 2 * 2 * 4 and server.sessions == 0  # one session per sample, all closed
    for metrics in history:
        assert metrics["env/num_failed"] == 0 and metrics["env/steps/mean"] >= 1, metrics
        assert metrics["reward/mean"] == pytest.approx(metrics["env/reward/mean"])  # the environment's reward
        assert metrics["training/rollout_probs_diff_max"] < 1e-3, metrics
