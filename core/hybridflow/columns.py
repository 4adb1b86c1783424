"""Helpers over the batch column conventions of :mod:`hybridflow.engines` that every engine and data path shares:
the check that a batch has the columns a method reads, position ids of left-padded rows, and the teacher-forcing
layout of tokenised demonstrations. What the columns mean is :mod:`hybridflow.engines`'; how engines compute on
them is theirs. Stability: developer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridflow.batch import Batch
from hybridflow.errors import DatasetError, EngineError

__all__ = ["require_columns", "compute_position_ids", "position_ids_of", "check_demonstration_fits",
           "build_teacher_forcing_batch"]


def require_columns(batch: Batch, *columns: str, method: str) -> None:
    """Raise naming the missing columns of ``batch`` for ``method``."""
    missing = [column for column in columns if column not in batch]
    if missing:
        raise EngineError(
            f"{method} expects columns {list(columns)}; the batch lacks {missing} (it has {batch.keys()}). "
            "Pass the output of a rollout engine's generate()."
        )


def compute_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on the first real token of each left-padded row."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def position_ids_of(batch: Batch, attention_mask: torch.Tensor) -> torch.Tensor:
    """The batch's ``position_ids`` column, or :func:`compute_position_ids` of ``attention_mask`` (the batch's, maybe
    already moved to the forward's device) when it has none."""
    if "position_ids" in batch:
        positions: torch.Tensor = batch["position_ids"]
        return positions
    return compute_position_ids(attention_mask)


def check_demonstration_fits(prompt: Sequence[int], response: Sequence[int], *, max_prompt_length: int,
                             max_response_length: int, where: str, prompt_label: str, response_label: str) -> None:
    """Raise :class:`DatasetError` when a tokenised demonstration's prompt or response (with its EOS) exceeds
    ``data.max_prompt_length`` / ``data.max_response_length``; the labels name the text in the message."""
    if len(prompt) > max_prompt_length:
        raise DatasetError(f"{where}: {prompt_label} has {len(prompt)} tokens, more than data.max_prompt_length="
                           f"{max_prompt_length}; raise the limit")
    if len(response) > max_response_length:
        raise DatasetError(f"{where}: {response_label} has {len(response)} tokens with the EOS, more than "
                           f"data.max_response_length={max_response_length}; raise it")


def build_teacher_forcing_batch(examples: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]], *,
                                max_prompt_length: int, max_response_length: int, pad_token_id: int) -> Batch:
    """Demonstrations as (prompt ids, response ids, loss mask over the response) → the engines' SFT layout:
    ``prompts`` left-padded, ``responses`` right-padded (both with ``pad_token_id``), ``input_ids`` and
    ``attention_mask`` of both (every response token attended), ``response_mask`` the loss mask. The callers check
    that each row fits (:func:`check_demonstration_fits`, naming their columns)."""
    prompts = torch.full((len(examples), max_prompt_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompts)
    responses = torch.full((len(examples), max_response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros_like(responses)
    attended = torch.zeros_like(responses)
    for index, (prompt, response, mask) in enumerate(examples):
        prompts[index, max_prompt_length - len(prompt):] = torch.tensor(prompt)
        prompt_mask[index, max_prompt_length - len(prompt):] = 1
        responses[index, :len(response)] = torch.tensor(response)
        response_mask[index, :len(response)] = torch.tensor(mask)
        attended[index, :len(response)] = 1
    return Batch({"prompts": prompts, "responses": responses, "response_mask": response_mask,
                  "input_ids": torch.cat([prompts, responses], dim=1),
                  "attention_mask": torch.cat([prompt_mask, attended], dim=1)})
