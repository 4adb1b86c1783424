"""Multi-turn demonstrations (verl's SFT ``messages`` column) → the SFT batch, tokenized exactly as the agent loop
tokenizes a conversation, with the tool turns masked out of the loss.

The prompt is the chat template over the messages before the first assistant turn (with the row's ``tools``
schemas); each assistant turn is its content's ids (plus EOS when it is the last turn, as the model ends a
conversation), each run of tool messages is :meth:`ChatFormat.tool_turn_ids` — the same ids the loop appends at RL
time, so SFT trains on the token stream RL will see. Running SFT is :mod:`hybridflow.trainer.sft`'s.
Stability: experimental.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.agent.format import ChatFormat
from hybridflow.batch import Batch
from hybridflow.columns import build_teacher_forcing_batch, check_demonstration_fits
from hybridflow.errors import DatasetError

__all__ = ["encode_conversation", "build_multiturn_sft_batch"]


def encode_conversation(messages: Sequence[Mapping[str, Any]], chat_format: ChatFormat, *,
                        tools: Sequence[Mapping[str, Any]] = (), where: str = "row") -> tuple[list[int], list[int],
                                                                                                list[int]]:
    """(prompt ids, response ids, loss mask over the response): 1 on assistant tokens, 0 on tool turns."""
    if not isinstance(messages, Sequence) or not all(isinstance(m, Mapping) and "role" in m and "content" in m
                                                      for m in messages):
        raise DatasetError(f"{where}: `messages` must be a list of {{role, content}} mappings (verl's multi-turn SFT "
                           f"layout), got {type(messages).__name__}")
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise DatasetError(f"{where}: a demonstration needs prompt messages followed by at least one assistant "
                           f"message; roles are {[m['role'] for m in messages]}")
    prompt = chat_format.render_prompt([dict(m) for m in messages[:first]], tools)
    response: list[int] = []
    mask: list[int] = []
    pending_tools: list[str] = []
    ended_with_eos = False
    for index, message in enumerate(messages[first:], start=first):
        role = message["role"]
        if role == "tool":
            pending_tools.append(str(message["content"]))
            continue
        if role != "assistant":
            raise DatasetError(f"{where}: message {index} has role {role!r}; after the prompt only assistant and "
                               "tool messages are supported")
        if pending_tools:
            ids = chat_format.tool_turn_ids(pending_tools, ended_with_eos=ended_with_eos)
            response += ids
            mask += [0] * len(ids)
            pending_tools = []
        elif index > first:
            raise DatasetError(f"{where}: assistant message {index} follows another assistant message; put the tool "
                               "output between them")
        ids = chat_format.encode(str(message["content"]))
        last = index == len(messages) - 1
        if last:
            ids.append(chat_format.eos_token_id)
        ended_with_eos = last
        response += ids
        mask += [1] * len(ids)
    if pending_tools:
        raise DatasetError(f"{where}: the conversation ends with tool output; end it with the assistant's answer")
    return prompt, response, mask


def build_multiturn_sft_batch(rows: Sequence[Mapping[str, Any]], chat_format: ChatFormat, *, messages_key: str,
                              tools_key: str, max_prompt_length: int, max_response_length: int,
                              pad_token_id: int) -> Batch:
    """The SFT batch layout (:func:`hybridflow.columns.build_teacher_forcing_batch`) of multi-turn rows;
    ``response_mask`` has holes at the tool turns (``attention_mask`` does not: the model reads them)."""
    examples = []
    for index, row in enumerate(rows):
        where = f"demonstration {index}"
        if messages_key not in row:
            raise DatasetError(f"{where} lacks column {messages_key!r} (data.messages_key); found {sorted(row)}")
        prompt, response, mask = encode_conversation(row[messages_key], chat_format, tools=row.get(tools_key) or (),
                                                     where=where)
        check_demonstration_fits(prompt, response, max_prompt_length=max_prompt_length,
                                 max_response_length=max_response_length, where=where, prompt_label="the prompt",
                                 response_label="the response (the turns after the prompt)")
        examples.append((prompt, response, mask))
    return build_teacher_forcing_batch(examples, max_prompt_length=max_prompt_length,
                                       max_response_length=max_response_length, pad_token_id=pad_token_id)
