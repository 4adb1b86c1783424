"""Turn a prompt :class:`~hybridflow.batch.Batch` into SGLang ``input_ids`` lists, and SGLang's output dicts back
into a rollout Batch with hybridflow's column conventions (see :mod:`hybridflow.engines`).

Pure tensor bookkeeping: it neither calls sglang nor decides sampling settings (:mod:`hybridflow_sglang.config`).
Stability: developer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.errors import EngineError

__all__ = ["extract_prompt_ids", "parse_output", "build_rollout_batch"]


def extract_prompt_ids(batch: Batch) -> list[list[int]]:
    """Unpadded prompt token ids per row, read from left-padded ``input_ids`` and ``attention_mask``."""
    for key in ("input_ids", "attention_mask"):
        if key not in batch.tensors.keys():
            raise EngineError(
                f'sglang generate expects a prompt batch with "input_ids" and "attention_mask" [B, P]; "{key}" is '
                f"missing from {batch!r}. Tokenize prompts left-padded (hybridflow dataset loaders do)."
            )
    input_ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    prompts = [row[row_mask].tolist() for row, row_mask in zip(input_ids, mask, strict=True)]
    empty = [index for index, ids in enumerate(prompts) if not ids]
    if empty:
        raise EngineError(f"prompt rows {empty[:8]} have no tokens (attention_mask all zero); drop or fix them.")
    return prompts


def parse_output(output: Mapping[str, Any], *, row: int, max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Response token ids and their log-probs from one sglang output dict (``generate(..., return_logprob=True)``).

    ``meta_info["output_token_logprobs"]`` holds one ``(logprob, token_id, text)`` per generated token, EOS included;
    it is the source of truth, and ``output_ids`` must agree with it (possibly without the final stop token).
    """
    meta = output.get("meta_info")
    if not isinstance(meta, Mapping) or "output_token_logprobs" not in meta:
        raise EngineError(
            f"sglang output {row} lacks meta_info.output_token_logprobs; expected generate(..., return_logprob=True) "
            f"output, got keys {sorted(output)} / meta {sorted(meta) if isinstance(meta, Mapping) else meta!r}."
        )
    finish = meta.get("finish_reason")
    if isinstance(finish, Mapping) and finish.get("type") == "abort":
        raise EngineError(f"sglang aborted request {row}: {finish.get('message', finish)!r}. Check the engine logs.")
    entries = meta["output_token_logprobs"]
    tokens = [int(entry[1]) for entry in entries]
    log_probs = [entry[0] for entry in entries]
    if any(value is None for value in log_probs):
        raise EngineError(f"sglang returned no log-prob for some response tokens of request {row}: {entries[:4]}")
    output_ids = [int(token) for token in output.get("output_ids", tokens)]
    if output_ids != tokens and output_ids != tokens[:-1]:
        raise EngineError(
            f"sglang output {row}: output_ids {output_ids[:8]}… disagree with the token ids of "
            f"output_token_logprobs {tokens[:8]}…; expected the same tokens."
        )
    if len(tokens) > max_new_tokens:
        raise EngineError(
            f"sglang output {row} has {len(tokens)} tokens, more than max_new_tokens={max_new_tokens}; "
            "expected the engine to stop at max_new_tokens."
        )
    return tokens, [float(value) for value in log_probs]


def build_rollout_batch(
    prompts: Batch,
    outputs: Sequence[Mapping[str, Any]],
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    pad_token_id: int,
    policy_version: int,
) -> Batch:
    """Rows ``i*n … i*n+n-1`` are the n samples of prompt ``i``; every other column of ``prompts`` is repeated."""
    rows = len(prompts) * samples_per_prompt
    if len(outputs) != rows:
        raise EngineError(
            f"sglang returned {len(outputs)} outputs for {len(prompts)} prompts × n={samples_per_prompt}; "
            f"expected {rows}."
        )
    responses = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, max_new_tokens), dtype=torch.long)
    log_probs = torch.zeros((rows, max_new_tokens), dtype=torch.float32)
    for row, output in enumerate(outputs):
        tokens, values = parse_output(output, row=row, max_new_tokens=max_new_tokens)
        length = len(tokens)
        responses[row, :length] = torch.tensor(tokens, dtype=torch.long)
        response_mask[row, :length] = 1
        log_probs[row, :length] = torch.tensor(values, dtype=torch.float32)

    out = prompts.repeat_interleave(samples_per_prompt).with_meta(policy_version=policy_version)
    prompt_ids = out["input_ids"].long()
    prompt_mask = out["attention_mask"].long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    out["prompts"] = prompt_ids
    out["responses"] = responses
    out["input_ids"] = torch.cat([prompt_ids, responses], dim=1)
    out["attention_mask"] = attention_mask
    out["position_ids"] = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    out["response_mask"] = response_mask
    out["rollout_log_probs"] = log_probs
    return out
