"""The OpenAI-compatible endpoint, driven by the real ``openai`` client against the real hf engine (a tiny random
chat model): every recorded call is exactly what the engine was given and sampled, multi-turn calls merge into one
training sequence whose generated tokens carry the engine's own log-probs (checked by teacher forcing the trained
sequence through the engine's model), a template that drops earlier reasoning splits them (counted), and bad
requests get OpenAI's error bodies.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from hybridflow.agent.endpoint import OpenAIEndpoint
from hybridflow.agent.format import ChatFormat
from hybridflow.agent.templates import CHAT_TEMPLATE
from hybridflow.agent.trajectories import CallRecord, build_sequences
from hybridflow.engines import ModelSpec, RolloutEngineConfig
from hybridflow.testing.chat_tokenizer import build_chat_tokenizer
from hybridflow.testing.fixtures import tiny_model_config

# Qwen3's habit, in the test tokenizer's markers: the generation prompt opens an empty reasoning block, and
# assistant turns before the last user message are rendered without it (tool loops after it keep it)
STRIPPING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user %}<think>\n\n</think>\n\n{% endif %}{{ message.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)
CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}, "required": ["expression"]}}}


def _engine(tokenizer: Any) -> Any:
    from hybridflow import registries
    from hybridflow.plugins import load_plugins

    load_plugins()
    model = {**tiny_model_config(max_position_embeddings=2048), "vocab_size": len(tokenizer),
             "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None}
    config = RolloutEngineConfig(model=ModelSpec(config=model, seed=3), max_prompt_length=768, max_new_tokens=16,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, seed=0)
    return registries.rollout_engines.get("hf")(config=config, device="cpu")


@pytest.fixture(scope="module")
def engine() -> Any:
    return _engine(build_chat_tokenizer())


def _served(engine: Any, template: str) -> Iterator[OpenAIEndpoint]:
    tokenizer = build_chat_tokenizer()
    tokenizer.chat_template = template
    endpoint = OpenAIEndpoint(engine, ChatFormat(tokenizer), max_new_tokens=16, max_context_tokens=1024, seed=0)
    endpoint.start()
    yield endpoint
    endpoint.stop()


@pytest.fixture(scope="module")
def endpoint(engine: Any) -> Iterator[OpenAIEndpoint]:
    yield from _served(engine, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def stripping_endpoint(engine: Any) -> Iterator[OpenAIEndpoint]:
    yield from _served(engine, STRIPPING_TEMPLATE)


def _client(endpoint: OpenAIEndpoint, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0, timeout=120)


def _converse(endpoint: OpenAIEndpoint, session_id: str, rng: random.Random) -> tuple[list[dict[str, Any]], int]:
    """One scripted multi-turn conversation (1-2 user turns, each 0-2 tool rounds) as any openai user writes it;
    returns (per call: what the client got back, with the token ids it asked for) and the number of user turns."""
    session = endpoint.open_session(session_id, max_calls=32)
    client = _client(endpoint, session.api_key)
    messages: list[dict[str, Any]] = []
    got = []
    user_turns = rng.randint(1, 2)
    for _ in range(user_turns):
        messages.append({"role": "user", "content": f"What is {rng.randint(10, 99)}*{rng.randint(10, 99)}?"})
        for round_ in range(rng.randint(0, 2) + 1):
            response = client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR], temperature=1.0,
                max_tokens=rng.randint(3, 14), extra_body={"return_token_ids": True})
            choice = response.choices[0]
            got.append({"token_ids": choice.model_extra["token_ids"],  # type: ignore[index]
                        "prompt_token_ids": response.model_extra["prompt_token_ids"]})  # type: ignore[index]
            messages.append(choice.message.model_dump(exclude_none=True))
            if round_ < 2 and rng.random() < 0.6:
                messages.append({"role": "tool", "tool_call_id": "x", "content": str(rng.randint(0, 10 ** 6))})
            else:
                break
        if messages[-1]["role"] == "tool":  # end the user turn with the assistant's answer
            response = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR],
                                                      max_tokens=6, extra_body={"return_token_ids": True})
            got.append({"token_ids": response.choices[0].model_extra["token_ids"],  # type: ignore[index]
                        "prompt_token_ids": response.model_extra["prompt_token_ids"]})  # type: ignore[index]
            messages.append(response.choices[0].message.model_dump(exclude_none=True))
    return got, user_turns


def _run_many(endpoint: OpenAIEndpoint, count: int, seed: int) -> list[tuple[list[CallRecord], list[Any], int]]:
    """``count`` conversations, 16 at a time (the endpoint batches their calls); (records, client view, users)."""
    results: list[Any] = [None] * count
    order = list(range(count))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not order:
                    return
                index = order.pop()
            got, users = _converse(endpoint, f"conv-{seed}-{index}", random.Random(seed * 10_000 + index))
            results[index] = (endpoint.close_session(f"conv-{seed}-{index}"), got, users)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert all(result is not None for result in results)
    return results


def _check_exact(engine: Any, endpoint: OpenAIEndpoint, results: list[Any]) -> dict[str, int]:
    """Every sequence is token-exact: each call's prompt and completion sit in it where the engine saw/produced
    them, the generated positions carry the recorded log-probs, and teacher forcing the sequence through the
    engine's model gives those log-probs back. Returns counts."""
    counts = {"calls": 0, "sequences": 0, "mismatches": 0, "retokenized_differs": 0, "spliced": 0}
    rows = []
    for records, got, _ in results:
        assert len(records) == len(got)
        for record, view in zip(sorted(records, key=lambda r: r.index), got):
            # what the client got is what was recorded, and the prompt ids stand for the rendered text exactly
            assert list(record.completion_ids) == view["token_ids"]
            assert list(record.prompt_ids) == view["prompt_token_ids"]
            assert endpoint.format.decode(record.prompt_ids) == record.prompt_text
            counts["spliced"] += record.spliced_on is not None
            counts["retokenized_differs"] += endpoint.format.encode(record.prompt_text) != list(record.prompt_ids)
        by_index = {record.index: record for record in records}
        for sequence in build_sequences(records):
            counts["sequences"] += 1
            ids = sequence.ids
            for index in sequence.calls:
                call = by_index[index]
                start, end = len(call.prompt_ids), len(call.prompt_ids) + len(call.completion_ids)
                offset = len(sequence.prompt_ids)
                exact = (ids[:start] == list(call.prompt_ids) and ids[start:end] == list(call.completion_ids)
                         and sequence.generated[start - offset:end - offset] == [1] * (end - start)
                         and sequence.log_probs[start - offset:end - offset] == list(call.log_probs))
                counts["mismatches"] += not exact
                counts["calls"] += 1
            assert sum(sequence.generated) == sum(len(by_index[i].completion_ids) for i in sequence.calls)
            rows.append(sequence)
    # teacher forcing: the trained sequence through the engine's own weights reproduces the sampled log-probs
    worst = 0.0
    for sequence in rows[::3]:
        ids = torch.tensor([sequence.ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits.float()
        log_probs = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        offset = len(sequence.prompt_ids)
        generated = torch.tensor(sequence.generated, dtype=torch.bool)
        forced = log_probs[offset - 1:][generated]
        recorded = torch.tensor(sequence.log_probs)[generated]
        worst = max(worst, float((forced - recorded).abs().max()))
    assert worst < 2e-3, worst
    return counts


@pytest.mark.slow  # 240 conversations, ~800 calls: ~40 s on a loaded 2-core box
def test_token_exact_over_many_multi_turn_conversations(engine: Any, endpoint: OpenAIEndpoint,
                                                        stripping_endpoint: OpenAIEndpoint) -> None:
    """240 conversations (120 per template): zero mismatches; the append-only template merges each conversation's
    calls into one sequence; the reasoning-stripping one starts a new sequence at each later user turn."""
    plain = _run_many(endpoint, 120, seed=1)
    counts = _check_exact(engine, endpoint, plain)
    assert counts["mismatches"] == 0 and counts["calls"] >= 300, counts
    assert counts["sequences"] == len(plain), counts  # append-only: one sequence per conversation
    # the hazard the splicing avoids is real here: re-tokenizing the rendered prompt gives other ids
    assert counts["retokenized_differs"] > 0 and counts["spliced"] == counts["calls"] - len(plain), counts

    stripped = _run_many(stripping_endpoint, 120, seed=2)
    counts = _check_exact(engine, stripping_endpoint, stripped)
    users = sum(users for _, _, users in stripped)
    assert counts["mismatches"] == 0, counts
    assert counts["sequences"] == users > len(stripped), (counts, users)  # one split per later user turn


def test_chat_features_n_logprobs_streaming_and_completions(endpoint: OpenAIEndpoint) -> None:
    session = endpoint.open_session("features", max_calls=16)
    client = _client(endpoint, session.api_key)
    messages = [{"role": "user", "content": "What is 12*34?"}]
    response = client.chat.completions.create(model="policy", messages=messages, n=3, logprobs=True,
                                              max_tokens=5, temperature=1.0)
    assert len(response.choices) == 3 and response.usage is not None
    assert response.usage.completion_tokens == sum(len(c.logprobs.content) for c in response.choices)  # type: ignore[union-attr]
    for choice in response.choices:
        assert choice.logprobs is not None and all(t.logprob <= 0 for t in choice.logprobs.content or [])
    stream = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, stream=True,
                                            logprobs=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(finish) == 1 and len(usage) == 1 and usage[0].completion_tokens >= 1
    completion = client.completions.create(model="policy", prompt="hello there", max_tokens=4, logprobs=1,
                                           extra_body={"return_token_ids": True})
    token_ids = completion.choices[0].model_extra["token_ids"]  # type: ignore[index]
    # a call near the context cap (1024) is cut to the room left, as the built-in loop's token budget cuts a turn
    near = client.completions.create(model="policy", prompt=[97] * 1020, max_tokens=16, temperature=1.0)
    assert near.usage is not None and 1 <= near.usage.completion_tokens <= 4
    records = sorted(endpoint.close_session("features"), key=lambda record: record.index)[:-1]
    assert len(records) == 3 + 1 + 1
    streamed = records[3]
    eos = endpoint.format.eos_token_id
    assert text == endpoint.format.decode([t for t in streamed.completion_ids if t != eos])
    assert list(records[-1].completion_ids) == token_ids
    assert completion.choices[0].logprobs is not None
    assert completion.choices[0].logprobs.token_logprobs == pytest.approx(list(records[-1].log_probs))
    # the n choices share one prompt and branch: three sequences
    assert len(build_sequences(records[:3])) == 3


def _raw_post(endpoint: OpenAIEndpoint, body: bytes, key: str | None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(endpoint.base_url + "/chat/completions", data=body, method="POST",
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_bad_requests_get_openai_error_bodies(endpoint: OpenAIEndpoint) -> None:
    session = endpoint.open_session("errors", max_calls=2)
    messages = [{"role": "user", "content": "hi"}]
    # (the openai client refuses to send a request without a key: this one goes without the header)
    status, body = _raw_post(endpoint, json.dumps({"messages": messages}).encode(), None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and "API key" in body["error"]["message"]
    with pytest.raises(openai.AuthenticationError) as wrong:
        _client(endpoint, "sk-not-this-run").chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
    assert wrong.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    client = _client(endpoint, session.api_key)
    for bad, param in (({"messages": []}, "messages"), ({"messages": messages, "temperature": 7}, "temperature"),
                       ({"messages": messages, "n": 0}, "n"), ({"messages": messages, "max_tokens": -1}, "max_tokens"),
                       ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
                       ({"messages": messages, "stop": ["\n"]}, "stop")):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="policy", **bad)  # type: ignore[call-overload]
        assert error.value.status_code == 400 and error.value.param == param, error.value.body
        assert str(error.value.body["message"])  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x " * 1200}])
    assert long.value.code == "context_length_exceeded"
    status, body = _raw_post(endpoint, b"{not json", session.api_key)
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    # refused requests spend no budget; two calls do, the third gets 429
    for _ in range(2):
        client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as budget:
        client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    assert budget.value.code == "call_budget_exhausted"
    assert len(endpoint.close_session("errors")) == 2
    with pytest.raises(openai.AuthenticationError):  # a closed session's key stops working
        client.chat.completions.create(model="policy", messages=messages, max_tokens=2)


def test_the_example_agent_ends_its_conversation_when_the_context_is_full(endpoint: OpenAIEndpoint) -> None:
    """examples/agents/tool_calc_agent.py ends on ``context_length_exceeded`` instead of failing its sample (a
    conversation whose tool turns outgrow the context is a finished trajectory, scored by the reward function);
    any other 400 still raises."""
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "examples" / "agents" / "tool_calc_agent.py"
    spec = importlib.util.spec_from_file_location("tool_calc_agent", path)
    assert spec is not None and spec.loader is not None
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    session = endpoint.open_session("full", max_calls=4)
    assert agent.run(endpoint.base_url, session.api_key, {"prompt": [{"role": "user", "content": "x " * 1200}]}) is None
    assert endpoint.close_session("full") == []
    session = endpoint.open_session("bad", max_calls=4)
    with pytest.raises(openai.BadRequestError) as error:
        agent.run(endpoint.base_url, session.api_key, {"prompt": [{"role": "robot", "content": "x"}]})
    assert error.value.param == "messages[0]"
    endpoint.close_session("bad")


def test_streamed_pieces_hold_a_character_split_over_tokens_until_it_is_whole() -> None:
    """Byte-level tokens can split a UTF-8 character: the prefix ending inside it decodes to U+FFFD, and a streamed
    delta cut there would repeat the text before it once the character completes (the flake this test pins)."""
    from hybridflow.agent.endpoint import _pieces

    class Bytes:  # id 1 and 2: the two bytes of "ű"; other ids: their own byte
        def decode(self, ids: list[int]) -> str:
            raw = {1: b"\xc5", 2: b"\xb1"}
            return b"".join(raw.get(i, bytes([i])) for i in ids).decode("utf-8", "replace")

    tokens = Bytes()
    ids = [89, 1, 2, 104, 101, 1]  # "Y", "ű" in two ids, "he", then a character cut off at the end
    pieces = _pieces(tokens, ids)  # type: ignore[arg-type]
    assert pieces == ["Y", "", "ű", "h", "e", "\ufffd"]
    assert "".join(pieces) == tokens.decode(ids)
