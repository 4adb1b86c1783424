"""Agents as code on the trainer's path (rollout.agent), with a tiny random chat model: GRPO steps complete while
some agents crash and one hangs per worker (failed samples, counted, scored 0), a reward an agent returns replaces
the reward function's score, and the trained rows are the endpoint's records (the actor's recomputed log-probs
match the rollout's).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.testing.chat_tokenizer import save_tiny_chat_model
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
AGENT = '''
import time
import openai

def agent(base_url, api_key, sample):
    mode = sample["index"] % 4  # each worker gets one prompt x rollout.n = 4 rows
    if mode == 0:
        raise ValueError("tool server unreachable")
    if mode == 1:
        time.sleep(600)  # hangs: the rollout abandons it at rollout.agent.timeout_s
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(sample["prompt"])
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    if mode == 3:
        return None  # reward.function scores it
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return 1.0
'''


@pytest.mark.slow  # two FSDP ranks, 2 steps, a 5 s agent timeout per step: 110 s on a heavily loaded 2-core box
def test_failing_and_hanging_agents_do_not_stop_the_step(tmp_path: Path) -> None:
    model = save_tiny_chat_model(tmp_path / "model")
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    data = EXAMPLES / "data"
    config = load_config(EXAMPLES / "grpo_tool_calc_agent.yaml", [
        f"model.path={model}", f"trainer.run_dir={tmp_path / 'run'}", f"rollout.agent.entry={agent}:agent",
        f"data.train_files=[{json.dumps(str(data / 'tool_calc_train.jsonl'))}]",
        "data.batch_size=2", "data.max_prompt_length=64", "rollout.n=4", "rollout.max_new_tokens=8",
        "rollout.agent.timeout_s=5", "rollout.agent.max_tokens=48", "trainer.total_steps=2", "trainer.val_every=0",
        "trainer.checkpoint_every=0", "trainer.progress=false", "trainer.tensorboard=false", "trainer.resume=never",
        "actor.recompute_log_probs=true"])
    started = time.monotonic()
    history = fit_and_close(Trainer(config, progress=False))
    assert time.monotonic() - started < 600
    assert [metrics["actor/policy_version"] for metrics in history] == [1.0, 2.0]
    for metrics in history:
        # per worker: one crash, one hang; the others call once (mode 3) or twice (mode 2)
        assert metrics["agent/num_failed"] == 4 and metrics["agent/error"] == 2 and metrics["agent/timeout"] == 2
        assert metrics["agent/no_calls"] == 0 and metrics["agent/split_sequences"] == 0
        assert metrics["num_turns/max"] == 2 and metrics["agent/calls/mean"] == pytest.approx(3 / 4)
        # mode 2 returns 1.0 (2 of 8 rows); the random model's text scores 0 under tool_calc; failed rows score 0
        assert metrics["reward/mean"] == pytest.approx(0.25), metrics
        assert metrics["training/rollout_probs_diff_max"] < 1e-3, metrics
