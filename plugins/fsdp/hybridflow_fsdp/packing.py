"""Padding removal for the training and log-prob passes: the rows of a micro-batch un-padded and packed into one
sequence (per-row position ids restarting at 0, attention restricted to each row), and micro-batches cut by a token
budget instead of a row count (verl's ``use_remove_padding`` / ``use_dynamic_bsz``).

It reads the column conventions of :mod:`hybridflow.engines` (left-padded prompt, right-padded response) and calls
the HF module the engine hands it; which micro-batches exist, gradients and sharding are the engine's business.
Stability: developer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.batch import Batch
from hybridflow.errors import ConfigError
from hybridflow_fsdp.lean_forward import upcast_for_backward
from hybridflow_fsdp.models import compute_position_ids

__all__ = [
    "VARLEN_ATTENTION",
    "PackedRows",
    "pack_rows",
    "packed_source_index",
    "register_varlen_attention",
    "packing_unsupported_reason",
    "packed_forward_outputs",
    "valid_token_outputs",
    "count_row_tokens",
    "partition_by_tokens",
    "count_token_bins",
]

#: the attention implementation name the packed forward runs under (HF's SDPA for padded calls, per-row SDPA for
#: packed ones); registered with transformers by :func:`register_varlen_attention`
VARLEN_ATTENTION = "hybridflow_varlen_sdpa"


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedRows:
    """The valid tokens of ``B`` padded rows as one sequence of ``N`` tokens, and where the response tokens go back.

    ``predictors`` [M]: the packed index of the token before each valid response token (its logits predict it);
    ``targets`` [M]: that response token; ``scatter_index`` [M]: its flat index in the ``[B, R]`` response layout.
    """

    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N], restarting at 0 in each row
    cu_seqlens: torch.Tensor  # [B + 1] int32, row boundaries in the packed sequence
    max_length: int
    predictors: torch.Tensor
    targets: torch.Tensor
    scatter_index: torch.Tensor
    rows: int
    response_width: int


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None,
              responses: torch.Tensor) -> PackedRows:
    """Pack the tokens with ``attention_mask`` set of each row into one sequence, rows ordered by length (stable).

    Position ids are the batch's own (rows restart at 0 in the rollout layout) or computed from the mask as the
    padded forward computes them, so the packed forward sees each row exactly as the padded one does. Rows of equal
    length end up adjacent, so the attention runs them as one batched call.
    """
    rows, width = input_ids.shape
    response_width = responses.shape[1]
    device = input_ids.device
    if position_ids is None:
        position_ids = compute_position_ids(attention_mask)
    lengths = attention_mask.bool().sum(1)
    order, valid, flat = _packing_order(attention_mask)
    total = int(flat.numel())
    cu_seqlens = torch.zeros(rows + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = lengths[order].cumsum(0)
    packed_index = torch.full((rows * width,), -1, dtype=torch.long, device=device)
    packed_index[flat] = torch.arange(total, device=device)
    response_valid = valid[:, width - response_width:]
    response_packed = packed_index.view(rows, width)[:, width - response_width:][response_valid]
    layout_index = order[:, None] * response_width + torch.arange(response_width, device=device)[None, :]
    return PackedRows(
        input_ids=input_ids[order].reshape(-1)[flat].unsqueeze(0),
        position_ids=position_ids[order].reshape(-1)[flat].unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_length=int(lengths.max()) if rows else 0,
        # a response token with no token before it in its row (an empty prompt) has no prediction in either path;
        # it reads the previous packed position, clamped into range
        predictors=(response_packed - 1).clamp_(min=0),
        targets=responses[order][response_valid],
        scatter_index=layout_index[response_valid],
        rows=rows,
        response_width=response_width,
    )


def _packing_order(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packing's row order (by length, stable), its valid mask in that order and the flat indices of the valid
    positions of the reordered [B, T] grid, in packed order."""
    order = torch.sort(attention_mask.bool().sum(1), stable=True).indices
    valid = attention_mask.bool()[order]
    return order, valid, valid.reshape(-1).nonzero().squeeze(1)


def packed_source_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[N]: for each token of the packed sequence :func:`pack_rows` builds, its flat index in the padded [B, T]
    layout (how per-position columns, e.g. recorded MoE routing, follow the packing)."""
    order, _, flat = _packing_order(attention_mask)
    width = attention_mask.shape[1]
    grid = order[:, None] * width + torch.arange(width, device=attention_mask.device)[None, :]
    return grid.reshape(-1)[flat]


def _varlen_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention interface: causal SDPA per row of a packed sequence when ``cu_seq_lens_q`` is passed (the rows
    do not see each other, and no [N, N] mask is built; adjacent rows of one length share a batched call), HF's SDPA
    otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    heads, dim = query.shape[1], query.shape[3]
    gqa = key.shape[1] != heads
    dtype = query.dtype
    if upcast_for_backward(query):
        query, key, value = query.float(), key.float(), value.float()
    outputs, start = [], 0
    for length, count in _runs(cu_seqlens.diff().tolist()):
        span = length * count
        # rows of one length as a batch [count, heads, length, dim] (a view: the token axis splits into rows)
        q, k, v = (t[0, :, start:start + span].view(t.shape[1], count, length, dim).transpose(0, 1)
                   for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling,
                                             enable_gqa=gqa)
        outputs.append(out.transpose(0, 1).reshape(heads, span, dim))
        start += span
    merged = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return merged.to(dtype).transpose(0, 1).unsqueeze(0), None  # [1, N, H, D], as HF's attention functions return


def _runs(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(length, count) of each run of equal consecutive lengths, zero lengths left out."""
    runs: list[tuple[int, int]] = []
    for length in lengths:
        if length <= 0:
            continue
        if runs and runs[-1][0] == length:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    return runs


def register_varlen_attention() -> None:
    """Register :data:`VARLEN_ATTENTION` with transformers (attention: per-row SDPA when packed; mask: SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN_ATTENTION, _varlen_sdpa_attention)
    if VARLEN_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(VARLEN_ATTENTION, sdpa_mask)


def packing_unsupported_reason(model: nn.Module) -> str | None:
    """Why the packed forward cannot run ``model`` (None when it can)."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no HF config"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention (the per-row attention is full causal)"
    return None


def _packed_model_kwargs(packed: PackedRows) -> dict[str, Any]:
    return {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        # all ones: HF's mask builder skips the [N, N] mask, the rows are kept apart by cu_seq_lens
        "attention_mask": torch.ones_like(packed.input_ids),
        "cu_seq_lens_q": packed.cu_seqlens, "cu_seq_lens_k": packed.cu_seqlens,
        "max_length_q": packed.max_length, "max_length_k": packed.max_length,
        "use_cache": False,
    }


def _to_response_layout(values: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """[M] values of the valid response tokens → [B, R], zeros at padding."""
    out = values.new_zeros(packed.rows * packed.response_width)
    return out.index_put((packed.scatter_index,), values).view(packed.rows, packed.response_width)


def packed_forward_outputs(module: nn.Module, micro: Batch, device: torch.device, *, role: str, with_entropy: bool,
                           entropy_metric: bool = False) -> dict[str, torch.Tensor]:
    """The padded forward's ``log_probs`` (and ``entropy``) or ``values`` [B, R], from one packed forward.

    Only valid response positions are computed (the LM head runs on them alone); padding positions hold 0.
    """
    position_ids = micro["position_ids"].to(device) if "position_ids" in micro else None
    packed = pack_rows(micro["input_ids"].to(device), micro["attention_mask"].to(device), position_ids,
                       micro["responses"].to(device))
    kwargs = _packed_model_kwargs(packed)
    if role == "critic":
        logits = module(**kwargs).logits
        return {"values": _to_response_layout(logits[0, packed.predictors, 0].float(), packed)}
    logits = module(**kwargs, logits_to_keep=packed.predictors).logits[0]  # [M, V]
    return valid_token_outputs(logits, packed.targets, packed.scatter_index, (packed.rows, packed.response_width),
                               with_entropy=with_entropy, entropy_metric=entropy_metric)


def valid_token_outputs(logits: torch.Tensor, targets: torch.Tensor, scatter_index: torch.Tensor,
                        shape: tuple[int, int], *, with_entropy: bool,
                        entropy_metric: bool = False) -> dict[str, torch.Tensor]:
    """``log_probs`` (and ``entropy``) [B, R] from the logits [M, V] of the M valid response tokens (``targets``
    [M], at flat [B·R] positions ``scatter_index``): one log-softmax over M rows, 0 at padding positions."""
    def layout(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(shape[0] * shape[1]).index_put((scatter_index,), values).view(shape)

    log_softmax = torch.log_softmax(logits.float(), dim=-1)
    outputs = {"log_probs": layout(log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1))}
    if with_entropy:
        outputs["entropy"] = layout(-(log_softmax.exp() * log_softmax).sum(-1))
    elif entropy_metric:
        with torch.no_grad():
            detached = log_softmax.detach()
            outputs["entropy"] = layout(-(detached.exp() * detached).sum(-1))
    return outputs


# --- dynamic micro-batches ------------------------------------------------------------------------------------------
def count_row_tokens(batch: Batch) -> list[int]:
    """Tokens each row's forward processes (its ``attention_mask`` count)."""
    return [int(count) for count in batch["attention_mask"].sum(1).tolist()]


def _first_fit_decreasing(tokens: Sequence[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for row in sorted(range(len(tokens)), key=lambda r: -tokens[r]):
        for index, load in enumerate(loads):
            if load + tokens[row] <= budget:
                bins[index].append(row)
                loads[index] += tokens[row]
                break
        else:
            bins.append([row])
            loads.append(tokens[row])
    return bins


def _check_budget(tokens: Sequence[int], budget: int, key: str) -> None:
    if budget <= 0:
        raise ConfigError(f"{key} must be a positive number of tokens, got {budget}")
    longest = max(tokens, default=0)
    if longest > budget:
        raise ConfigError(f"{key}={budget} is smaller than the longest row of the batch ({longest} tokens): a row "
                          f"cannot be split across micro-batches. Fix: set {key} >= {longest} (e.g. max prompt "
                          "length + max new tokens).")


def count_token_bins(tokens: Sequence[int], budget: int, *, key: str = "max_tokens_per_micro_batch") -> int:
    """The fewest micro-batches :func:`partition_by_tokens` fits ``tokens`` into under ``budget``."""
    _check_budget(tokens, budget, key)
    return len(_first_fit_decreasing(tokens, budget))


def partition_by_tokens(tokens: Sequence[int], budget: int, *, bins: int | None = None,
                        key: str = "max_tokens_per_micro_batch") -> list[list[int]]:
    """Row indices of each micro-batch: every micro-batch holds at most ``budget`` tokens, loads balanced.

    ``bins`` fixes the number of micro-batches (every data-parallel rank must run as many forwards; pass the
    largest :func:`count_token_bins` over ranks), at least the fewest that fit and at most the number of rows.
    Longest-processing-time first (each row, longest first, to the least loaded micro-batch) when that fits the
    budget; first-fit decreasing otherwise, with empty micro-batches then taking a row from the fullest ones.
    Rows keep their order inside a micro-batch; micro-batches come longest first.

    Raises:
        ConfigError: a row longer than ``budget`` (naming ``key``, the budget and the longest row).
    """
    _check_budget(tokens, budget, key)
    if not tokens:
        return []
    count = len(_first_fit_decreasing(tokens, budget)) if bins is None else bins
    if not 1 <= count <= len(tokens) or count < count_token_bins(tokens, budget, key=key):
        raise ValueError(f"cannot split {len(tokens)} rows of {sum(tokens)} tokens into {count} micro-batches of at "
                         f"most {budget} tokens")
    order = sorted(range(len(tokens)), key=lambda r: -tokens[r])
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for row in order:
        index = min(range(count), key=loads.__getitem__)
        groups[index].append(row)
        loads[index] += tokens[row]
    if max(loads) > budget:
        groups = _first_fit_decreasing(tokens, budget)
        groups += [[] for _ in range(count - len(groups))]
        for empty in (g for g in groups if not g):
            donor = max((g for g in groups if len(g) > 1), key=lambda g: sum(tokens[r] for r in g))
            empty.append(donor.pop())  # the donor's shortest row: a single row always fits
    groups = [sorted(group) for group in groups]
    return sorted(groups, key=lambda g: -sum(tokens[r] for r in g))

