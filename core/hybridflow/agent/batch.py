"""Conversations → the rollout batch columns of :mod:`hybridflow.engines`, and their per-sample metrics.

``responses`` hold every id after the prompt (model turns and tool turns, right-padded to ``max_tokens``);
``response_mask`` is 1 exactly on the ids the model generated, so the losses and GAE skip the tool turns;
``attention_mask`` is 1 on every real id (the model reads the tool output); ``rollout_log_probs`` is 0 on tool ids.
Per-sample columns ``num_turns``, ``tool_call_counts`` and ``tool_error_counts`` ride along for the metrics.
Running the conversations is :mod:`hybridflow.agent.loop`'s. Stability: public (experimental).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.agent.loop import Conversation
from hybridflow.batch import Batch

__all__ = ["build_rollout_batch", "summarize_agent_metrics", "AGENT_COLUMNS", "AGENT_STATUSES", "ENV_STATUSES"]

AGENT_COLUMNS = ("num_turns", "tool_call_counts", "tool_error_counts")
#: how an agent run by ``rollout.agent`` ended (``agent_status`` holds the index): ``ok`` or why its sample failed
AGENT_STATUSES = ("ok", "error", "timeout", "no_calls", "bad_return")
#: how an episode run by ``rollout.env`` ended (``env_status`` holds the index): ``ok`` or why its sample failed
ENV_STATUSES = ("ok", "error", "timeout", "bad_response")


def build_rollout_batch(prompts: Batch, conversations: Sequence[Conversation], *, width: int, pad_token_id: int,
                        policy_version: int) -> Batch:
    """One row per conversation (``prompts`` rows already repeated to match), responses ``width`` wide."""
    if len(prompts) != len(conversations):
        raise ValueError(f"{len(conversations)} conversations for {len(prompts)} prompt rows")
    rows = len(conversations)
    responses = torch.full((rows, width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, width), dtype=torch.long)
    attended = torch.zeros((rows, width), dtype=torch.long)
    log_probs = torch.zeros((rows, width), dtype=torch.float32)
    for row, conversation in enumerate(conversations):
        length = len(conversation.response_ids)
        if length > width:
            raise ValueError(f"conversation {row} has {length} response ids, more than the width {width}")
        responses[row, :length] = torch.tensor(conversation.response_ids, dtype=torch.long)
        response_mask[row, :length] = torch.tensor(conversation.generated, dtype=torch.long)
        attended[row, :length] = 1
        log_probs[row, :length] = torch.tensor(conversation.log_probs, dtype=torch.float32)
    prompt_ids = prompts["input_ids"].long()
    prompt_mask = prompts["attention_mask"].long()
    prompt_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    response_positions = prompt_positions[:, -1:] + torch.arange(1, width + 1).unsqueeze(0)
    output = Batch(prompts.tensors.clone(recurse=False), dict(prompts.non_tensors),
                   {**prompts.meta, "policy_version": policy_version})
    columns: dict[str, Any] = {
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, attended], dim=1).to(prompts["attention_mask"].dtype),
        "position_ids": torch.cat([prompt_positions, response_positions], dim=1),
        "response_mask": response_mask.to(prompts["attention_mask"].dtype),
        "rollout_log_probs": log_probs,
        "num_turns": torch.tensor([c.turns for c in conversations], dtype=torch.float32),
        "tool_call_counts": torch.tensor([c.tool_calls for c in conversations], dtype=torch.float32),
        "tool_error_counts": torch.tensor([c.tool_errors for c in conversations], dtype=torch.float32),
    }
    for name, tensor in columns.items():
        output[name] = tensor
    return output


def summarize_agent_metrics(batch: Batch) -> dict[str, float]:
    """verl's names: ``num_turns/{min,max,mean}``, ``tool_call_counts/{min,max,mean}``, plus
    ``tool_error_counts/{min,max,mean}``; with agents as code (``rollout.agent``) also ``agent/num_failed``,
    ``agent/failed_ratio``, ``agent/<status>`` per failure kind (error, timeout, no_calls, bad_return),
    ``agent/calls/mean``, ``agent/split_sequences`` (sequences beyond one per sample, not trained) and
    ``agent/truncated``; with environments (``rollout.env``) ``env/num_failed``, ``env/failed_ratio``,
    ``env/<status>`` per failure kind (error, timeout, bad_response), ``env/truncated``, ``env/steps/mean`` and
    ``env/reward/mean``; empty when the batch has no agent columns."""
    metrics: dict[str, float] = {}
    if "agent_failed" in batch and len(batch) > 0:
        metrics["agent/num_failed"] = float(batch["agent_failed"].sum())
        metrics["agent/failed_ratio"] = float(batch["agent_failed"].float().mean())
        for code, status in enumerate(AGENT_STATUSES[1:], start=1):
            metrics[f"agent/{status}"] = float((batch["agent_status"] == code).sum())
        metrics["agent/calls/mean"] = float(batch["agent_calls"].float().mean())
        metrics["agent/split_sequences"] = float((batch["agent_sequences"] - 1).clamp(min=0).sum())
        metrics["agent/truncated"] = float(batch["agent_truncated"].sum())
    if "env_failed" in batch and len(batch) > 0:
        metrics["env/num_failed"] = float(batch["env_failed"].sum())
        metrics["env/failed_ratio"] = float(batch["env_failed"].float().mean())
        for code, status in enumerate(ENV_STATUSES[1:], start=1):
            metrics[f"env/{status}"] = float((batch["env_status"] == code).sum())
        metrics["env/truncated"] = float(batch["env_truncated"].sum())
        metrics["env/steps/mean"] = float(batch["env_steps"].float().mean())
        metrics["env/reward/mean"] = float(batch["agent_rewards"].float().mean())
    for name in AGENT_COLUMNS:
        if name not in batch or len(batch) == 0:
            continue
        values = batch[name].float()
        metrics[f"{name}/min"] = float(values.min())
        metrics[f"{name}/max"] = float(values.max())
        metrics[f"{name}/mean"] = float(values.mean())
    return metrics
