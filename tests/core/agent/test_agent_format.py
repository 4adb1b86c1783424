"""Parsing Hermes tool calls out of model text, and the tool turn written from the chat template or explicit
markers."""

from __future__ import annotations

import pytest

from hybridflow.agent import ChatFormat, MultiTurnConfig, parse_tool_calls
from hybridflow.errors import ConfigError
from hybridflow.testing.chat_tokenizer import build_chat_tokenizer


def test_parse_well_formed_and_malformed_calls() -> None:
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2*3"}, None), ("search", {"query": "x"}, None)]
    assert parse_tool_calls("no calls here") == []
    bad_json, = parse_tool_calls('<tool_call>{"name": "calculator", </tool_call>')
    assert bad_json.error is not None and "not valid JSON" in bad_json.error
    no_name, = parse_tool_calls('<tool_call>["calculator"]</tool_call>')
    assert no_name.error is not None and '"name"' in no_name.error
    dangling, = parse_tool_calls("garbage </tool_call>")
    assert dangling.error is not None and "without a matching" in dangling.error
    # an unclosed call is not a call (the turn was cut short)
    assert parse_tool_calls('<tool_call>{"name": "calculator"') == []


def test_tool_turn_from_the_chat_template() -> None:
    chat = ChatFormat(build_chat_tokenizer())
    after_stop = chat.tool_turn_text(["42"], ended_with_eos=False)
    assert after_stop == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                          "<|im_start|>assistant\n")
    # after an EOS (<|im_end|>) stop the model already closed its turn
    assert chat.tool_turn_text(["42"], ended_with_eos=True) == after_stop[len("<|im_end|>"):]
    assert chat.stop_token_ids == (chat.tokenizer.convert_tokens_to_ids("</tool_call>"),)


def test_explicit_markers_and_non_append_only_templates() -> None:
    tokenizer = build_chat_tokenizer()
    chat = ChatFormat(tokenizer, tool_turn_prefix="[", tool_turn_suffix="]", tool_separator="|")
    assert chat.tool_turn_text(["a", "b"], ended_with_eos=False) == "[a|b]"
    rewriting = build_chat_tokenizer()
    # a template that renders only the last message rewrites history when a tool message is added
    rewriting.chat_template = "{{ messages[-1].content }}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(ConfigError, match="not append-only"):
        ChatFormat(rewriting).tool_turn_text(["x"], ended_with_eos=False)
    rewriting.chat_template = None
    with pytest.raises(ConfigError, match="no chat_template"):
        ChatFormat(rewriting)


def test_multi_turn_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_turns must be ≥ 1, got 0"):
        MultiTurnConfig(max_turns=0)
    with pytest.raises(ConfigError, match="tool_timeout_s must be > 0"):
        MultiTurnConfig(tool_timeout_s=0)


def test_prompts_carry_the_tool_schemas() -> None:
    """A multi-turn run's chat prompts render its tools through the template (verl's ``tools=``)."""
    from hybridflow.data import PromptDataset
    from hybridflow.tools import build_tools

    schemas = [dict(tool.description) for tool in build_tools(["calculator"]).values()]
    rows = [{"prompt": [{"role": "user", "content": "What is 12*34?"}], "data_source": "d",
             "reward_model": {"ground_truth": "408"}}]
    tokenizer = build_chat_tokenizer()
    with_tools = PromptDataset.from_rows(rows, tokenizer, max_prompt_length=512, tools=schemas)
    plain = PromptDataset.from_rows(rows, tokenizer, max_prompt_length=512)
    assert '"name": "calculator"' in with_tools.prompt_texts[0] and "<tools>" in with_tools.prompt_texts[0]
    assert "<tools>" not in plain.prompt_texts[0]
    # the ids are the rendered text's
    real = with_tools.attention_mask[0].bool()
    assert tokenizer.decode(with_tools.input_ids[0][real].tolist()) == with_tools.prompt_texts[0]
