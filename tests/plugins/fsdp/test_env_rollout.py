"""rollout.env's worker path (hybridflow.agent.env_rollout) on the real hf engine: with ``entry`` the worker serves the
tool-calc environment itself (loopback, its token) and its greedy episodes give the same rows as the built-in tool
loop's (``rollout.multi_turn``) on the same prompts; every session and KV-cache entry is released, and close()
stops the server.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.agent import ChatFormat
from hybridflow.agent.env_rollout import EnvRollout
from hybridflow.agent.worker import AgentRollout
from hybridflow.algorithms.helpers import decode_batch
from hybridflow.batch import Batch
from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams
from hybridflow.tasks.tool_calc import tool_calc_reward
from hybridflow.testing.chat_tokenizer import build_chat_tokenizer, save_tiny_chat_model
from hybridflow.tools import build_tools
from hybridflow_fsdp.rollout import HFRolloutEngine


def test_env_entry_rollout_matches_the_builtin_loop_on_the_hf_engine(tmp_path: Path) -> None:
    chat = ChatFormat(build_chat_tokenizer())
    tokenizer = chat.tokenizer
    config = RolloutEngineConfig(model=ModelSpec(path=str(save_tiny_chat_model(tmp_path / "model"))),
                                 max_prompt_length=160, max_new_tokens=40, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
    engine = HFRolloutEngine(config=config)
    schemas = [dict(tool.description) for tool in build_tools(["calculator"]).values()]
    questions = ["12*34", "56*78", "91*23"]
    messages = [[{"role": "user", "content": q}] for q in questions]
    prompts = [chat.render_prompt(m, schemas) for m in messages]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    answers = [str(eval(q)) for q in questions]
    rows = Batch({"input_ids": ids, "attention_mask": mask},
                 {"raw_prompt": messages, "ground_truth": answers, "data_source": ["hybridflow/tool_calc"] * 3,
                  "extra_info": [{}] * 3, "uid": ["a", "b", "c"]}, {"iteration": 0})
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, seed=0)

    rollout = EnvRollout(engine, config, {"entry": "hybridflow.tasks.tool_calc_env:ToolCalcEnv", "max_turns": 2,
                                          "max_tokens": 32, "timeout_s": 10.0})
    try:
        by_env = rollout.generate(rows, greedy)
        assert rollout.server is not None and rollout.server.sessions_opened == 6 and rollout.server.sessions == 0
        assert rollout.base_url().startswith("http://127.0.0.1:")
    finally:
        rollout.close()
    assert not rollout.server._server.running  # stopped
    builtin = AgentRollout(engine, config, {"max_turns": 2, "max_tokens": 32, "tool_timeout_s": 5.0,
                                            "max_tool_calls_per_turn": 4, "max_batch_rows": 0,
                                            "tools": ["calculator"]}).generate(rows, greedy)
    for column in ("responses", "response_mask", "attention_mask", "position_ids", "num_turns", "tool_call_counts"):
        assert torch.equal(by_env[column], builtin[column]), column
    assert torch.allclose(by_env["rollout_log_probs"], builtin["rollout_log_probs"], atol=1e-5)
    texts = decode_batch(tokenizer, [[t for t, m in zip(r, k) if m] for r, k in zip(
        builtin["responses"].tolist(), builtin["response_mask"].tolist())])
    expected = tool_calc_reward(responses=texts, ground_truths=[a for a in answers for _ in range(2)],
                                data_sources=[""] * 6)
    assert by_env["agent_rewards"].tolist() == expected and by_env["env_failed"].sum() == 0
    assert by_env["response_mask"].sum() > 0 and engine.kv_cache_stats["entries"] == 0
