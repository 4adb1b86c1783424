"""Autoregressive sampling with a KV cache over left-padded prompts: temperature, top-k, top-p, greedy, stop at EOS.

It samples token ids and their log-probs from any HF causal LM; assembling rollout batches is the rollout engine's
business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridflow.engines import SamplingParams
from hybridflow_fsdp.fast_decode import LeanDecoder, PastKV
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


def pick_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
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
        tokens = draw_from(probs, generator)
    return tokens, raw_log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def draw_from(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of ``probs`` [B, V] (rows need not sum to 1) by inverting the CDF at a uniform draw.

    Index i is drawn iff cdf[i-1] <= u·total < cdf[i], so zero-probability entries are never drawn; one uniform per
    row (``torch.multinomial`` draws an exponential per entry, several times the cost on small rows)."""
    cdf = probs.cumsum(-1)
    uniform = torch.rand(probs.shape[0], 1, generator=generator, device=generator.device).to(probs.device)
    return (cdf <= uniform.mul_(cdf[:, -1:])).sum(-1)


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
    repeats: int = 1,
    stop_token_ids: tuple[int, ...] = (),
    past: PastKV | None = None,
    keep_cache: bool = False,
) -> SampledTokens:
    """Generate ``sampling.max_new_tokens`` columns for every row; rows stop at EOS (kept, masked 1), then pad.

    ``repeats`` > 1 samples that many rows per prompt (``repeat_interleave`` order); with ``decoder`` (a
    :class:`~hybridflow_fsdp.fast_decode.LeanDecoder` of ``model``) the prompts' forward is computed once and shared,
    and the logits come from its lean forward; otherwise from ``model(...)`` with the HF KV cache. Both give the
    same logits. ``stop_token_ids`` stop a row like EOS (kept, masked 1).

    ``past`` (decoder only): the rows continue tokens whose keys/values an earlier call computed (the input ids
    are only the new tokens; their positions start at ``past.lengths``). ``keep_cache``: the decoder's cache is
    left for the caller to read (``decoder.cache_state()``) and release.
    """
    if (past is not None or keep_cache) and decoder is None:
        raise ValueError("past keys/values and keep_cache need the lean decoder")
    # inference mode (no version counters or autograd bookkeeping: ~10% off each decode step); what leaves it is
    # cloned into ordinary tensors, so callers may use the outputs in autograd
    with torch.inference_mode():
        sampled = _sample(model, input_ids, attention_mask, sampling=sampling, eos_token_id=eos_token_id,
                          pad_token_id=pad_token_id, generator=generator, decoder=decoder, repeats=repeats,
                          stop_token_ids=stop_token_ids, past=past, keep_cache=keep_cache)
    return SampledTokens(responses=sampled.responses.clone(), log_probs=sampled.log_probs.clone(),
                         response_mask=sampled.response_mask.clone())


def _sample(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, sampling: SamplingParams,
            eos_token_id: int, pad_token_id: int, generator: torch.Generator, decoder: LeanDecoder | None,
            repeats: int, stop_token_ids: tuple[int, ...] = (), past: PastKV | None = None,
            keep_cache: bool = False) -> SampledTokens:
    width = sampling.max_new_tokens
    if decoder is None and repeats > 1:
        input_ids = input_ids.repeat_interleave(repeats, dim=0)
        attention_mask = attention_mask.repeat_interleave(repeats, dim=0)
        repeats = 1
    rows = input_ids.shape[0] * repeats
    device = input_ids.device
    responses = torch.full((rows, width), pad_token_id, dtype=input_ids.dtype, device=device)
    log_probs = torch.zeros((rows, width), dtype=torch.float32, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    position_ids = compute_position_ids(attention_mask)
    if past is not None:
        position_ids = position_ids + past.lengths[:, None]
    if decoder is not None:
        logits = decoder.prefill(input_ids, attention_mask, position_ids, width, repeats=repeats, past=past)
    else:
        cache_argument = _cache_argument(model)
        output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
        logits = output.logits[:, -1, :]
    positions = position_ids[:, -1]
    steps = width
    stops = torch.tensor(sorted({eos_token_id, *stop_token_ids}), dtype=input_ids.dtype, device=device)
    for step in range(width):
        tokens, token_log_probs = pick_tokens(logits, sampling, generator)
        responses[:, step] = tokens
        log_probs[:, step] = token_log_probs
        finished |= torch.isin(tokens, stops)
        if step == width - 1 or bool(finished.all()):
            steps = step + 1
            break
        if decoder is not None:
            logits = decoder.step(tokens)  # rows past their EOS keep decoding; their columns are masked below
            continue
        positions = positions + 1
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        output = model(input_ids=tokens.unsqueeze(-1), attention_mask=attention_mask,
                       position_ids=positions.unsqueeze(-1), use_cache=True,
                       **{cache_argument: getattr(output, cache_argument)})
        logits = output.logits[:, -1, :]
    if decoder is not None and not keep_cache:
        decoder.release()
    # a column is alive until (and including) the row's first EOS (or stop token); after it: pad, log-prob 0, mask 0
    eos_before = torch.isin(responses[:, :steps], stops).long().cumsum(-1)
    eos_before = torch.cat([torch.zeros_like(eos_before[:, :1]), eos_before[:, :-1]], dim=1)
    alive = torch.zeros((rows, width), dtype=torch.bool, device=device)
    alive[:, :steps] = eos_before == 0
    responses.masked_fill_(~alive, pad_token_id)
    log_probs.masked_fill_(~alive, 0.0)
    return SampledTokens(responses=responses, log_probs=log_probs, response_mask=alive.to(attention_mask.dtype))
