"""Per-token quantities of response tokens from one model forward: log-probs, entropy, values, sequence scores.

It reads the column conventions of :mod:`hybridflow.engines`; micro-batching, gradients and sharding are the
engine's business.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.batch import Batch
from hybridflow.columns import position_ids_of, require_columns

__all__ = [
    "require_columns",
    "response_length",
    "model_inputs",
    "compute_token_log_probs",
    "compute_entropy",
    "last_token_index",
]


def response_length(batch: Batch) -> int:
    """R: the width of ``responses``."""
    return int(batch["responses"].shape[1])


def model_inputs(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` (computed when absent) on ``device``."""
    attention_mask = batch["attention_mask"].to(device)
    position_ids = position_ids_of(batch, attention_mask)
    return {
        "input_ids": batch["input_ids"].to(device),
        "attention_mask": attention_mask,
        "position_ids": position_ids.to(device),
    }


def compute_token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per position, in float32; ``logits`` [B, R, V], ``tokens`` [B, R]."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, in float32; ``logits`` [B, R, V] → [B, R]."""
    logits = logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def response_logits(model: nn.Module, batch: Batch, device: torch.device) -> torch.Tensor:
    """Logits that predict each response token: positions ``T-R-1 .. T-2`` of the causal LM output, [B, R, V]."""
    length = response_length(batch)
    logits: torch.Tensor = model(**model_inputs(batch, device), use_cache=False).logits
    return logits[:, -length - 1 : -1, :]


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position with mask 1 in each row (rows are left-padded prompt + right-padded response)."""
    width = attention_mask.shape[1]
    flipped = attention_mask.flip(-1).long()
    return width - 1 - flipped.argmax(-1)
