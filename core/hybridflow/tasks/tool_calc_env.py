"""The tool-calculator task as an environment (reset/step, :mod:`hybridflow.agent.environment`): an episode is one
question "a*b"; each step takes the model's turn as ``{"message": text}``, runs the calculator on the tool calls in
it (the built-in loop's parsing, limits and tool-output texts) and answers them as ``tool`` messages, and a turn
without a call ends the episode with :func:`~hybridflow.tasks.tool_calc.tool_calc_reward` of its text.

Serve it with ``python -m hybridflow.agent.env_server hybridflow.tasks.tool_calc_env:ToolCalcEnv`` or name it in
``rollout.env.entry``. The task's data and reward are :mod:`hybridflow.tasks.tool_calc`'s. Stability: experimental.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.agent.environment import EnvStep
from hybridflow.agent.format import ToolCall, parse_tool_calls
from hybridflow.tasks.tool_calc import TOOL, tool_calc_reward
from hybridflow.tools import ToolResult, build_tools, call_tool

__all__ = ["ToolCalcEnv"]


class ToolCalcEnv:
    """One tool-calc episode. ``reset(ground_truth=..., prompt=...)`` takes the rollout's row (the product is the
    ground truth); ``reset(question="47*86")`` or ``reset(seed=k)`` make one without a dataset."""

    def __init__(self, *, tool_timeout_s: float = 5.0, max_tool_calls_per_turn: int = 4) -> None:
        self.tools = build_tools([TOOL])
        self.tool_timeout_s = tool_timeout_s
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.question = ""
        self.answer: str | None = None
        self.steps = 0
        self.tool_calls = 0
        self.episode_id: str | None = None

    def reset(self, *, seed: int | None = None, episode_id: str | None = None, question: str | None = None,
              ground_truth: Any = None, prompt: Sequence[Mapping[str, Any]] | None = None) -> EnvStep:
        if question is None and prompt:
            question = str(prompt[-1].get("content", ""))
        if question is None:
            rng = random.Random(seed)
            question = f"{rng.randint(10, 99)}*{rng.randint(10, 99)}"
        if ground_truth is None:
            left, _, right = question.partition("*")
            if not (left.strip().isdigit() and right.strip().isdigit()):
                raise ValueError(f"question {question!r} is not 'a*b' and no ground_truth was given")
            ground_truth = int(left) * int(right)
        self.question, self.answer, self.episode_id = question, str(ground_truth).strip(), episode_id
        self.steps = self.tool_calls = 0
        return EnvStep(observation={"messages": [{"role": "user", "content": question}]})

    async def step(self, action: Mapping[str, Any]) -> EnvStep:
        if self.answer is None:
            raise RuntimeError("step before reset: this session has no question yet")
        message = action.get("message")
        if not isinstance(message, str):
            raise ValueError(f"the action must be {{\"message\": str}}, got {dict(action)!r:.80}")
        self.steps += 1
        calls = parse_tool_calls(message)
        if not calls:
            reward = tool_calc_reward(responses=[message], ground_truths=[self.answer], data_sources=[""])[0]
            return EnvStep(observation={"messages": []}, reward=reward, done=True)
        limit = self.max_tool_calls_per_turn
        results: list[ToolResult] = list(await asyncio.gather(*[self._call(call) for call in calls[:limit]]))
        results += [ToolResult(text=f"Error: at most {limit} tool calls per turn; this one was not run.",
                               status="bad_call") for _ in calls[limit:]]
        self.tool_calls += len(calls)
        return EnvStep(observation={"messages": [{"role": "tool", "content": result.text} for result in results],
                                    "tool_statuses": [result.status for result in results]}, reward=0.0)

    async def _call(self, call: ToolCall) -> ToolResult:
        if call.error is not None:
            return ToolResult(text=call.error, status="bad_call")
        return await call_tool(self.tools, call.name, call.arguments, timeout_s=self.tool_timeout_s)

    def state(self) -> dict[str, Any]:
        return {"episode_id": self.episode_id, "step_count": self.steps, "question": self.question,
                "tool_calls": self.tool_calls}
