"""Autoregressive sampling with a KV cache over left-padded prompts: temperature, top-k, top-p, greedy, stop at EOS.

It samples token ids and their log-probs from any HF causal LM; assembling rollout batches is the rollout engine's
business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridflow.engines import SamplingParams

from hybridflow_fsdp.fast_decode import LeanDecoder
from hybridflow_fsdp.models import compute_position_ids

__all__ = ["SampledTokens", "filter_logits", "pick_tokens", "sample_tokens"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SampledTokens:
    """``responses``, ``log_probs`` and ``response_mask``, each [B, max_new_tokens] (pad / 0 after EOS)."""

    responses: torch.Tensor
    log_probs: torch.Tensor
    response_mask: torch.Tensor


def filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` with everything outside the top-k and outside the top-p nucleus set to -inf (at least one kept)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def pick_tokens(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its log-prob under the raw (untempered, unfiltered) distribution."""
    logits = logits.float()
    raw_log_probs = torch.log_softmax(logits, dim=-1)
    if sampling.temperature == 0:
        tokens = logits.argmax(-1)
    else:
        if sampling.temperature == 1.0 and sampling.top_k <= 0 and sampling.top_p >= 1.0:
            probs = raw_log_probs.exp()  # nothing to temper or filter: the raw distribution
        else:
            filtered = filter_logits(logits / sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
            probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
    return tokens, raw_log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _cache_argument(model: nn.Module) -> str:
    """``cache`` (transformers ≥ 5.2x) or ``past_key_values`` (older): the name of the KV-cache argument/output."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def sample_tokens(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    sampling: SamplingParams,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator,
    decoder: LeanDecoder | None = None,
) -> SampledTokens:
    """Generate ``sampling.max_new_tokens`` columns for every row; rows stop at EOS (kept, masked 1), then pad.

    With ``decoder`` (a :class:`~hybridflow_fsdp.fast_decode.LeanDecoder` of ``model``) the logits come from its lean
    forward; otherwise from ``model(...)`` with the HF KV cache. Both give the same logits.
    """
    rows, width = input_ids.shape[0], sampling.max_new_tokens
    device = input_ids.device
    responses = torch.full((rows, width), pad_token_id, dtype=input_ids.dtype, device=device)
    log_probs = torch.zeros((rows, width), dtype=torch.float32, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    alive = torch.zeros((rows, width), dtype=torch.bool, device=device)
    position_ids = compute_position_ids(attention_mask)
    if decoder is not None:
        logits = decoder.prefill(input_ids, attention_mask, position_ids, width)
    else:
        cache_argument = _cache_argument(model)
        output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
        logits = output.logits[:, -1, :]
    positions = position_ids[:, -1]
    for step in range(width):
        tokens, token_log_probs = pick_tokens(logits, sampling, generator)
        tokens = tokens.masked_fill(finished, pad_token_id)
        responses[:, step] = tokens
        log_probs[:, step] = token_log_probs.masked_fill(finished, 0.0)
        alive[:, step] = ~finished
        finished |= tokens == eos_token_id
        if step == width - 1 or bool(finished.all()):
            break
        positions = positions + 1
        if decoder is not None:
            logits = decoder.step(tokens, positions)
            continue
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        output = model(input_ids=tokens.unsqueeze(-1), attention_mask=attention_mask,
                       position_ids=positions.unsqueeze(-1), use_cache=True,
                       **{cache_argument: getattr(output, cache_argument)})
        logits = output.logits[:, -1, :]
    if decoder is not None:
        decoder.release()
    return SampledTokens(responses=responses, log_probs=log_probs, response_mask=alive.to(attention_mask.dtype))
