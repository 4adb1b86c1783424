"""Build the rollout Batch columns (see :mod:`hybridflow.engines`) from prompts and generated token ids.

Pure tensor code, no vLLM: the engine hands it token ids and per-token log-probs, this module pads and masks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["prompt_token_lists", "build_rollout_columns"]


def prompt_token_lists(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The unpadded token ids of each left-padded prompt row."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"expected input_ids and attention_mask of the same [B, P] shape; got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    mask = attention_mask.bool()
    return [row[keep].tolist() for row, keep in zip(input_ids, mask, strict=True)]


def build_rollout_columns(
    *,
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    response_length: int,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """Columns after ``generate`` for rows that already repeat each prompt ``n`` times (interleaved).

    ``responses[i]`` are the generated ids of row ``i`` (EOS included when produced), right-padded to
    ``response_length``; ``response_mask`` marks them, ``position_ids`` count attended tokens from 0.
    """
    rows = len(responses)
    if prompts.shape[0] != rows or len(log_probs) != rows:
        raise ValueError(f"got {prompts.shape[0]} prompt rows, {rows} responses, {len(log_probs)} log-prob rows")
    response_ids = torch.full((rows, response_length), pad_token_id, dtype=prompts.dtype)
    response_mask = torch.zeros((rows, response_length), dtype=prompt_mask.dtype)
    rollout_log_probs = torch.zeros((rows, response_length), dtype=torch.float32)
    for row, (tokens, token_log_probs) in enumerate(zip(responses, log_probs, strict=True)):
        length = len(tokens)
        if length > response_length or len(token_log_probs) != length:
            raise ValueError(
                f"row {row}: {length} tokens and {len(token_log_probs)} log-probs for a response length of "
                f"{response_length}"
            )
        response_ids[row, :length] = torch.as_tensor(list(tokens), dtype=prompts.dtype)
        response_mask[row, :length] = 1
        rollout_log_probs[row, :length] = torch.as_tensor(list(token_log_probs), dtype=torch.float32)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    return {
        "prompts": prompts,
        "responses": response_ids,
        "input_ids": torch.cat([prompts, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs,
    }
