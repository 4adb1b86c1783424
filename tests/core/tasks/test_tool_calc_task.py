"""The tool-calculator task: its reward reads the final answer, its shipped files are what the generator writes, and
its multi-turn demonstrations tokenize exactly as the agent loop builds a conversation (tool output masked)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from hybridflow.agent import ChatFormat
from hybridflow.agent.loop import tool_schemas
from hybridflow.agent.sft import build_multiturn_sft_batch, encode_conversation
from hybridflow.errors import DatasetError
from hybridflow.tasks.tool_calc import (
    SFT_FILE,
    TRAIN_FILE,
    VAL_FILE,
    build_tool_calc_tokenizer,
    final_answer,
    tool_calc_reward,
    tool_call_text,
    write_tool_calc_files,
)
from hybridflow.tools import build_tools, call_tool

SHIPPED = Path(__file__).resolve().parents[3] / "examples" / "data"


def test_reward_reads_the_final_answer_only() -> None:
    call = '{"name": "calculator", "arguments": {"expression": "12*34"}}'  # special tokens are skipped in decoding
    responses = [f"{call}408", "408", f"{call}", f"{call}407", " 408 \n", "408 is it", ""]
    assert tool_calc_reward(responses=responses, ground_truths=["408"] * 7, data_sources=[""] * 7) == [
        1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert final_answer(f"{call}") == ""  # a call that was never answered ends in JSON, not a number


def test_shipped_files_are_the_generators_and_disjoint_from_validation(tmp_path: Path) -> None:
    for written in write_tool_calc_files(tmp_path):
        assert written.read_bytes() == (SHIPPED / written.name).read_bytes(), f"regenerate {written.name}: " \
            "python -m hybridflow.tasks.tool_calc"
    rows = {name: [json.loads(line) for line in (SHIPPED / name).read_text().splitlines()]
            for name in (SFT_FILE, TRAIN_FILE, VAL_FILE)}
    held_out = {row["prompt"][0]["content"] for row in rows[VAL_FILE]}
    assert not held_out & {row["prompt"][0]["content"] for row in rows[TRAIN_FILE]}
    assert not held_out & {row["messages"][0]["content"] for row in rows[SFT_FILE]}
    with_tool = sum(len(row["messages"]) == 4 for row in rows[SFT_FILE])
    assert 0.35 < with_tool / len(rows[SFT_FILE]) < 0.65  # both behaviours are demonstrated


def test_demonstrations_tokenize_as_the_agent_loop_builds_conversations() -> None:
    chat = ChatFormat(build_tool_calc_tokenizer())
    tools = build_tools(["calculator"])
    result = asyncio.run(call_tool(tools, "calculator", {"expression": "47*86"}, timeout_s=5))
    assert (result.status, result.text) == ("ok", "4042")
    messages = [{"role": "user", "content": "47*86"}, {"role": "assistant", "content": tool_call_text("47*86")},
                {"role": "tool", "content": result.text}, {"role": "assistant", "content": "4042"}]
    prompt, response, mask = encode_conversation(messages, chat, tools=tool_schemas(tools))
    # what the loop does: prompt from the template, the model's ids (stopped at </tool_call>), the tool turn's ids
    call_ids = chat.encode(tool_call_text("47*86"))
    assert call_ids[-1] in chat.stop_token_ids
    tool_turn = chat.tool_turn_ids(["4042"], ended_with_eos=False)
    answer = chat.encode("4042") + [chat.eos_token_id]
    assert prompt == chat.render_prompt(messages[:1], tool_schemas(tools))
    assert response == call_ids + tool_turn + answer
    assert mask == [1] * len(call_ids) + [0] * len(tool_turn) + [1] * len(answer)
    assert [chat.decode([t]) for t in chat.encode("4042")] == ["4", "0", "4", "2"]  # digits one by one

    batch = build_multiturn_sft_batch([{"messages": messages, "tools": tool_schemas(tools)}], chat,
                                      messages_key="messages", tools_key="tools", max_prompt_length=len(prompt) + 3,
                                      max_response_length=len(response) + 2, pad_token_id=0)
    assert batch["response_mask"][0].tolist() == mask + [0, 0]
    assert batch["attention_mask"][0].tolist() == [0] * 3 + [1] * (len(prompt) + len(response)) + [0, 0]
    with pytest.raises(DatasetError, match="ends with tool output"):
        encode_conversation(messages[:3], chat)
    with pytest.raises(DatasetError, match=r"more than data\.max_response_length"):
        build_multiturn_sft_batch([{"messages": messages}], chat, messages_key="messages", tools_key="tools",
                                  max_prompt_length=400, max_response_length=10, pad_token_id=0)
