"""Which rows of a batch repeat their predecessor's prompt (a rollout's n samples of one prompt do): the rule the
lean forward shares a prompt's forward by (:meth:`hybridflow_fsdp.lean_forward.LeanForward.response_logits`) and the
training engine routes micro-batches by (:func:`shares_prompts`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["distinct_prompt_rows", "shares_prompts"]


def shares_prompts(inputs: Mapping[str, torch.Tensor], response_length: int) -> bool:
    """Whether some row of ``inputs`` (``input_ids``, ``attention_mask``, ``position_ids``: left-padded prompts then
    ``response_length`` response columns) repeats the previous row's prompt, as a rollout's n samples do: the lean
    forward then computes that prompt once (:func:`distinct_prompt_rows` is the rule)."""
    width = inputs["input_ids"].shape[1] - response_length
    if width <= 0:
        return False
    return distinct_prompt_rows(inputs["input_ids"][:, :width], inputs["attention_mask"][:, :width],
                                inputs["position_ids"][:, :width]) is not None


def distinct_prompt_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                         prompt_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first row of each run of identical consecutive prompts, run index of every row), or None when no two
    consecutive rows share their prompt (nothing to share)."""
    if prompt_ids.shape[0] < 2:
        return None
    same = ((prompt_ids[1:] == prompt_ids[:-1]) & (prompt_mask[1:] == prompt_mask[:-1])
            & (prompt_positions[1:] == prompt_positions[:-1])).all(-1)
    if not bool(same.any()):
        return None
    starts = torch.cat((torch.ones(1, dtype=torch.bool, device=same.device), ~same))
    return starts.nonzero().squeeze(1), starts.long().cumsum(0) - 1
