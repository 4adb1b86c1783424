"""Batch plumbing of the megatron engine: row padding to the data-parallel size and the inputs of megatron's GPTModel
forward (positions, a boolean causal+padding mask); the column check is the core's
(:func:`hybridflow.columns.require_columns`, re-exported). Stability: developer.
"""

from __future__ import annotations

import torch

from hybridflow.batch import PADDING_KEY, Batch
from hybridflow.columns import position_ids_of, require_columns

__all__ = ["require_columns", "pad_rows", "attention_inputs"]


def pad_rows(batch: Batch, multiple: int) -> Batch:
    """``batch`` padded to a multiple of ``multiple`` rows, keeping any ``is_padding`` marks it already had."""
    if len(batch) % multiple == 0:
        return batch
    marks = batch.tensors[PADDING_KEY].clone() if PADDING_KEY in batch.tensors.keys() else None
    padded = batch.pad_to_multiple(multiple)
    if marks is not None:
        padded.tensors[PADDING_KEY][: len(marks)] = marks
    return padded


def attention_inputs(micro: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids, bool attention mask [B, 1, S, S] with True = masked: causal or padding key)."""
    attention = micro["attention_mask"].to(device)
    positions = position_ids_of(micro, attention)
    length = attention.shape[1]
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)
    mask = causal[None, None] | (attention == 0)[:, None, None, :]
    return micro["input_ids"].to(device), positions.to(device), mask
