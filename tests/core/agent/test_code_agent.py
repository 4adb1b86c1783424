"""Agents as code against the real endpoint and hf engine: K agents at once, each written with the openai client;
ones that crash, hang, call nothing, return junk or spend their budget end as failed samples (or, for the budget,
an ordinary one) within the timeout, and the rollout batch holds exactly the recorded tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.agent.batch import AGENT_STATUSES, summarize_agent_metrics
from hybridflow.agent.code_agent import CodeAgentConfig, build_code_agent_batch, load_agent_entry, run_agents
from hybridflow.agent.endpoint import OpenAIEndpoint
from hybridflow.agent.format import ChatFormat
from hybridflow.batch import Batch
from hybridflow.engines import ModelSpec, RolloutEngineConfig
from hybridflow.errors import ConfigError
from hybridflow.testing.chat_tokenizer import build_chat_tokenizer
from hybridflow.testing.fixtures import tiny_model_config

AGENTS = '''
import time
import openai

def agent(base_url, api_key, sample):
    """Two turns as any user writes them; the mode comes with the sample."""
    mode = sample["extra_info"]["mode"]
    if mode == "crash":
        raise RuntimeError("the agent broke")
    if mode == "hang":
        time.sleep(30)
    if mode == "silent":
        return None
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(sample["prompt"])
    calls = 2 if mode != "greedy_budget" else 10
    for _ in range(calls):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        except openai.RateLimitError:
            break
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    if mode == "junk":
        return "high"
    if mode == "reward":
        return 0.75
    return None
'''
MODES = ["ok", "reward", "crash", "hang", "silent", "junk", "greedy_budget", "ok"]


@pytest.fixture(scope="module")
def endpoint() -> Iterator[OpenAIEndpoint]:
    from hybridflow import registries
    from hybridflow.plugins import load_plugins

    load_plugins()
    tokenizer = build_chat_tokenizer()
    model = {**tiny_model_config(max_position_embeddings=2048), "vocab_size": len(tokenizer),
             "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None}
    config = RolloutEngineConfig(model=ModelSpec(config=model, seed=3), max_prompt_length=64, max_new_tokens=16,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=0)
    engine = registries.rollout_engines.get("hf")(config=config, device="cpu")
    served = OpenAIEndpoint(engine, ChatFormat(tokenizer), max_new_tokens=16, max_context_tokens=64 + 96, seed=0)
    yield served
    served.stop()


def _rows(tokenizer: Any, modes: list[str]) -> tuple[Batch, list[dict[str, Any]]]:
    prompts = [[{"role": "user", "content": f"What is {10 + i}*{20 + i}?"}] for i in range(len(modes))]
    ids = [ChatFormat(tokenizer).render_prompt(p) for p in prompts]
    width = 64
    input_ids = torch.full((len(modes), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(modes), width), dtype=torch.long)
    for row, row_ids in enumerate(ids):
        input_ids[row, width - len(row_ids):] = torch.tensor(row_ids)
        mask[row, width - len(row_ids):] = 1
    extra = [{"mode": mode} for mode in modes]
    batch = Batch({"input_ids": input_ids, "attention_mask": mask},
                  {"raw_prompt": prompts, "extra_info": extra, "uid": [str(i) for i in range(len(modes))]})
    samples = [{"prompt": prompts[i], "extra_info": extra[i], "index": i} for i in range(len(modes))]
    return batch, samples


def test_failing_agents_become_failed_samples_and_rows_hold_the_recorded_tokens(endpoint: OpenAIEndpoint,
                                                                                 tmp_path: Path) -> None:
    path = tmp_path / "agents.py"
    path.write_text(AGENTS)
    function = load_agent_entry(f"{path}:agent")
    config = CodeAgentConfig(entry=f"{path}:agent", max_concurrency=4, timeout_s=3.0, max_calls=3, max_tokens=96)
    rows, samples = _rows(endpoint.format.tokenizer, MODES)
    started = time.monotonic()
    outcomes = run_agents(endpoint, function, samples, config)
    elapsed = time.monotonic() - started
    assert elapsed < 3.0 * 2 + 15, elapsed  # the hung agent is abandoned at its timeout, not waited for
    statuses = [outcome.status for outcome in outcomes]
    assert statuses == ["ok", "ok", "error", "timeout", "no_calls", "bad_return", "ok", "ok"], statuses
    assert "the agent broke" in outcomes[2].error and outcomes[1].reward == 0.75
    assert len(outcomes[6].calls) == 3  # the budget: the fourth request got 429 and the agent stopped
    assert endpoint.sessions == {}  # every session closed, the hung agent's key revoked

    batch = build_code_agent_batch(rows, outcomes, width=96, max_prompt_length=64,
                                   pad_token_id=endpoint.format.tokenizer.pad_token_id, policy_version=0)
    assert batch["agent_failed"].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    rewards = batch["agent_rewards"].tolist()
    assert math.isnan(rewards[0]) and rewards[1] == 0.75 and rewards[2:6] == [0.0] * 4
    for row, outcome in enumerate(outcomes):
        response_mask = batch["response_mask"][row].bool()
        if outcome.failed:
            assert not response_mask.any()
            continue
        (sequence,) = outcome.sequences()  # the agent's turns extend each other: one sequence
        prompt = batch["input_ids"][row, :64][batch["attention_mask"][row, :64].bool()].tolist()
        response = batch["responses"][row][batch["attention_mask"][row, 64:].bool()].tolist()
        assert prompt == sequence.prompt_ids and response == sequence.response_ids
        generated = [t for calls in outcome.calls for t in calls.completion_ids]
        assert batch["responses"][row][response_mask].tolist() == generated
        assert batch["rollout_log_probs"][row][response_mask].tolist() == pytest.approx(
            [v for calls in outcome.calls for v in calls.log_probs])
    metrics = summarize_agent_metrics(batch)
    assert metrics["agent/num_failed"] == 4 and metrics["agent/failed_ratio"] == 0.5
    assert {status: metrics[f"agent/{status}"] for status in AGENT_STATUSES[1:]} == {
        "error": 1, "timeout": 1, "no_calls": 1, "bad_return": 1}
    assert metrics["agent/split_sequences"] == 0 and metrics["num_turns/max"] == 3


def test_bad_entries_are_refused_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"path/to/agent\.py:function"):
        load_agent_entry("no_colon_here")
    with pytest.raises(ConfigError, match=r"could not be loaded.*no file"):
        load_agent_entry(f"{tmp_path / 'missing.py'}:agent")
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="could not be loaded"):
        load_agent_entry(f"{tmp_path / 'a.py'}:agent")
    with pytest.raises(ConfigError, match="not a function"):
        load_agent_entry(f"{tmp_path / 'a.py'}:x")
