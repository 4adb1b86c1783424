"""The actor worker's multi-turn path: ``rollout.multi_turn.enable`` makes ``ActorRolloutWorker.generate`` run the
agent loop here instead of the engine's single-turn ``generate``.

It builds the tools, the chat format and the loop once per worker, repeats each prompt ``sampling.n`` times, strips
the prompts' left padding, runs the conversations and assembles the batch (responses ``max_tokens`` wide).
Placement, weights and versions stay the worker's business. Stability: developer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hybridflow.agent.batch import build_rollout_batch
from hybridflow.agent.format import ChatFormat
from hybridflow.agent.interaction import load_interaction
from hybridflow.agent.loop import AgentLoop, MultiTurnConfig
from hybridflow.batch import Batch
from hybridflow.engines import RolloutEngine, RolloutEngineConfig, SamplingParams, TokenContinuationEngine
from hybridflow.errors import ConfigError, EngineError
from hybridflow.tools import build_tools

__all__ = ["AgentRollout", "multi_turn_enabled", "prompt_tool_schemas"]


def multi_turn_enabled(extra: Mapping[str, Any]) -> bool:
    """Whether a role spec's ``extra`` turns the agent path on."""
    return bool((extra.get("multi_turn") or {}).get("enable"))


def prompt_tool_schemas(config: Any) -> list[dict[str, Any]] | None:
    """The function schemas of a run's ``rollout.multi_turn.tools`` (or ``rollout.env.tools``) for its chat prompts
    (None when off)."""
    env = getattr(config.rollout, "env", None)
    if env is not None:  # rollout.env: the environment runs the calls; the prompts only show their schemas
        return [dict(tool.description) for tool in build_tools(list(env.tools)).values()] if env.tools else None
    section = config.rollout.multi_turn
    if not section.enable or not section.tools:
        return None
    tools = build_tools(list(section.tools), section.tool_options)
    return [dict(tool.description) for tool in tools.values()]


class AgentRollout:
    """One worker's agent loop over its rollout engine (built on first use)."""

    def __init__(self, engine: RolloutEngine, rollout_config: RolloutEngineConfig, options: Mapping[str, Any]) -> None:
        if not isinstance(engine, TokenContinuationEngine) or "continue_from_tokens" not in engine.capabilities:
            raise EngineError(f"rollout.multi_turn needs a rollout engine with capability continue_from_tokens; "
                              f"{type(engine).__name__} has {sorted(engine.capabilities)}")
        if rollout_config.model.path is None:
            raise ConfigError("rollout.multi_turn needs the model's tokenizer and chat template: set actor.model.path "
                              "to an HF model directory saved with a chat tokenizer")
        from hybridflow.model_dir import load_tokenizer

        self.chat_format = ChatFormat(load_tokenizer(rollout_config.model.path))
        self.config = MultiTurnConfig(max_turns=int(options["max_turns"]), max_tokens=int(options["max_tokens"]),
                                      tool_timeout_s=float(options["tool_timeout_s"]),
                                      max_tool_calls_per_turn=int(options["max_tool_calls_per_turn"]),
                                      max_batch_rows=int(options["max_batch_rows"]))
        tools = build_tools(list(options.get("tools", [])), options.get("tool_options") or {})
        interaction = load_interaction(str(options["interaction"])) if options.get("interaction") else None
        self.loop = AgentLoop(engine, tools, self.chat_format, self.config, interaction=interaction)
        self.pad_token_id = rollout_config.pad_token_id
        self.engine = engine

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Columns as ``RolloutEngine.generate`` returns them, plus the per-sample agent columns. Each row's
        ``extra_info.tools_kwargs`` and ``agent_name`` (verl's multi-turn data; the dataset copies a top-level
        ``agent_name`` column into ``extra_info``) go to its conversation, and ``extra_info.interaction_kwargs``
        start the simulated user (``rollout.multi_turn.interaction``) for it."""
        rows = prompts.repeat_interleave(sampling.n) if sampling.n > 1 else prompts
        ids, mask = rows["input_ids"], rows["attention_mask"]
        prefixes = [ids[row][mask[row].bool()].tolist() for row in range(len(rows))]
        extras = list(rows.non_tensors["extra_info"]) if "extra_info" in rows.non_tensors else [{}] * len(rows)
        conversations = self.loop.run(prefixes, replace(sampling, n=1),
                                      tools_kwargs=[dict(extra or {}).get("tools_kwargs") for extra in extras],
                                      agent_names=[dict(extra or {}).get("agent_name") for extra in extras],
                                      interaction_kwargs=[dict(extra or {}).get("interaction_kwargs")
                                                          for extra in extras])
        return build_rollout_batch(rows, conversations, width=self.config.max_tokens, pad_token_id=self.pad_token_id,
                                   policy_version=self.engine.weights_version)
