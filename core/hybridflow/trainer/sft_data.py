"""SFT demonstrations: reading them (verl's SFT columns, or multi-turn ``messages``) and laying them out as the
training engines' teacher-forcing batch. Training on them is :mod:`hybridflow.trainer.sft`'s. Stability: experimental.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridflow.batch import Batch
from hybridflow.columns import build_teacher_forcing_batch, check_demonstration_fits
from hybridflow.errors import ConfigError, DatasetError
from hybridflow.trainer.sft_config import SFTDataSection

__all__ = ["PROMPT_FIELD", "RESPONSE_FIELD", "load_demonstrations", "build_sft_batch", "build_demonstration_batch"]

#: where :func:`load_demonstrations` puts each row's resolved prompt (text or chat messages) and response text
PROMPT_FIELD, RESPONSE_FIELD = "__sft_prompt__", "__sft_response__"


def _resolve(row: Mapping[str, Any], key: str, dict_keys: Sequence[str], *, where: str) -> Any:
    """``row[key]``, then each of ``dict_keys`` into it (verl's ``*_dict_keys``), with an error naming the path."""
    value: Any = row[key]
    path = key
    for part in dict_keys:
        if isinstance(value, str):  # a dict column written through pandas may hold JSON text
            with contextlib.suppress(json.JSONDecodeError):
                value = json.loads(value)
        if not isinstance(value, Mapping) or part not in value:
            found = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            raise DatasetError(f"{where}: {path!r} has no key {part!r} (found {found}); check "
                               "data.prompt_dict_keys / data.response_dict_keys")
        value = value[part]
        path = f"{path}.{part}"
    return value


def load_demonstrations(files: Sequence[str], *, prompt_key: str, response_key: str,
                        prompt_dict_keys: Sequence[str] = (), response_dict_keys: Sequence[str] = (),
                        messages_key: str | None = None) -> list[dict[str, Any]]:
    """Rows of the demonstration files, each checked for a prompt (text or chat messages) and a text response, or
    for a ``messages_key`` column when given (DatasetError naming the file, the row and the columns found
    otherwise); a prompt/response row's resolved values are stored under :data:`PROMPT_FIELD` /
    :data:`RESPONSE_FIELD`."""
    from hybridflow.data import load_rows

    if not files:
        raise DatasetError("no demonstration files given; set data.train_files (jsonl/parquet with prompt and "
                           "response columns)")
    rows: list[dict[str, Any]] = []
    for file in files:
        if not Path(file).exists():
            raise DatasetError(f"demonstrations file {file} does not exist; check data.train_files / "
                               "data.val_files (the shipped task's file is made by `python -m "
                               "hybridflow.tasks.arithmetic`)")
        for index, row in enumerate(load_rows(file)):
            if messages_key is not None:
                if not isinstance(row.get(messages_key), list):
                    raise DatasetError(f"{file} row {index}: column {messages_key!r} (data.messages_key) must be a "
                                       f"list of {{role, content}} messages; found columns {sorted(row)}")
                rows.append(row)
                continue
            missing = [key for key in (prompt_key, response_key) if key not in row]
            if missing:
                raise DatasetError(
                    f"{file} row {index} lacks column(s) {missing}; found {sorted(row)}. SFT expects a prompt and "
                    f"a response per row (data.prompt_key={prompt_key!r}, data.response_key={response_key!r}); set "
                    "those keys to your columns' names")
            where = f"{file} row {index}"
            prompt = _resolve(row, prompt_key, prompt_dict_keys, where=where)
            response = _resolve(row, response_key, response_dict_keys, where=where)
            is_chat = isinstance(prompt, list) and all(isinstance(m, Mapping) and "content" in m for m in prompt)
            if not (isinstance(prompt, str) or is_chat):
                raise DatasetError(f"{where}: column {prompt_key!r} must be text or chat messages "
                                   f"[{{role, content}}], got {type(prompt).__name__}")
            if not isinstance(response, str):
                raise DatasetError(f"{where}: column {response_key!r} must be text, got "
                                   f"{type(response).__name__}")
            rows.append({**row, PROMPT_FIELD: prompt, RESPONSE_FIELD: response})
    return rows


def build_sft_batch(rows: Sequence[Mapping[str, Any]], tokenizer: Any, *, max_prompt_length: int,
                    max_response_length: int) -> Batch:
    """The engines' column layout for teacher forcing: ``prompts`` left-padded, ``responses`` (the response's
    tokens then EOS) right-padded, ``input_ids``/``attention_mask`` of both, ``response_mask`` on the response
    tokens and EOS: the tokens the loss is taken over. ``rows`` come from :func:`load_demonstrations`; a chat prompt
    is rendered with the tokenizer's chat template (generation prompt added), as the RL dataset renders it."""
    from hybridflow.data import render_prompt

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ConfigError("the tokenizer has no eos token; SFT appends it to each response so that generation stops")
    examples = []
    for index, row in enumerate(rows):
        prompt_text = render_prompt(row[PROMPT_FIELD], tokenizer, where=f"demonstration {index}")
        prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        response = [*tokenizer(row[RESPONSE_FIELD], add_special_tokens=False)["input_ids"], eos_id]
        if not prompt:
            raise DatasetError(f"demonstration {index}: the prompt is empty after tokenisation")
        check_demonstration_fits(prompt, response, max_prompt_length=max_prompt_length,
                                 max_response_length=max_response_length, where=f"demonstration {index}",
                                 prompt_label=f"prompt {prompt_text!r}",
                                 response_label=f"response {row[RESPONSE_FIELD]!r}")
        examples.append((prompt, response, [1] * len(response)))
    return build_teacher_forcing_batch(examples, max_prompt_length=max_prompt_length,
                                       max_response_length=max_response_length, pad_token_id=pad_id)


def build_demonstration_batch(rows: Sequence[Mapping[str, Any]], tokenizer: Any, data: SFTDataSection) -> Batch:
    """The batch of ``rows`` as ``data`` configures them: multi-turn conversations (``data.messages_key``, through
    :func:`hybridflow.agent.sft.build_multiturn_sft_batch`) or prompt/response rows (:func:`build_sft_batch`)."""
    if data.messages_key is None:
        return build_sft_batch(rows, tokenizer, max_prompt_length=data.max_prompt_length,
                               max_response_length=data.max_response_length)
    from hybridflow.agent.format import ChatFormat
    from hybridflow.agent.sft import build_multiturn_sft_batch

    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.messages_key (multi-turn demonstrations) needs a tokenizer with a chat template; set "
                          "model.path to an HF model directory saved with a chat tokenizer")
    return build_multiturn_sft_batch(rows, ChatFormat(tokenizer), messages_key=data.messages_key,
                                     tools_key=data.tools_key, max_prompt_length=data.max_prompt_length,
                                     max_response_length=data.max_response_length,
                                     pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
