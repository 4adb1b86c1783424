"""Multi-turn agentic rollouts: the agent loop (generate, call tools, append their output as tokens, continue), the
tool-call format and tool-turn rendering, and the assembly of conversations into rollout batches.

Stability: public (experimental). Tools themselves are :mod:`hybridflow.tools`; generation from token prefixes is
a rollout engine's ``continue_from_tokens`` capability.
"""

from __future__ import annotations

from hybridflow.agent.batch import AGENT_COLUMNS, build_rollout_batch, summarize_agent_metrics
from hybridflow.agent.format import CALL_END, CALL_START, ChatFormat, ToolCall, parse_tool_calls
from hybridflow.agent.loop import AgentLoop, Conversation, MultiTurnConfig, tool_schemas

__all__ = ["AgentLoop", "Conversation", "MultiTurnConfig", "ChatFormat", "ToolCall", "parse_tool_calls",
           "CALL_START", "CALL_END", "build_rollout_batch", "summarize_agent_metrics", "AGENT_COLUMNS",
           "tool_schemas"]
