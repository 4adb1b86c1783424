"""The agent loop: many conversations in flight, each generate → parse tool calls → run tools → append the tool turn
as tokens → generate again, until no call, ``max_turns`` or the token budget.

Token-in/token-out: a conversation is the list of ids the engine was given and produced plus the tool-turn ids
(:class:`~hybridflow.agent.format.ChatFormat` tokenizes only that new text); nothing is decoded and re-encoded.
Turns are batched continuously: every conversation not waiting on a tool goes into the next
``generate_from_tokens`` call (run in a thread) while other conversations' tools run concurrently on the event loop.
With an engine that reports ``kv_cache_reuse`` each conversation passes its own cache key, so the engine prefills
only what was appended since its last turn; the key is released when the conversation ends.
Assembling the training batch is :mod:`hybridflow.agent.batch`'s. Stability: public (experimental).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hybridflow.agent.format import ChatFormat, ToolCall, parse_tool_calls
from hybridflow.agent.interaction import Interaction
from hybridflow.engines import KVCacheReuseEngine, SamplingParams, TokenCompletion, TokenContinuationEngine
from hybridflow.errors import ConfigError, EngineError
from hybridflow.tools import Tool, ToolResult, call_tool

__all__ = ["MultiTurnConfig", "Conversation", "AgentLoop", "AGENT_NAMES"]

#: the loops a row's ``agent_name`` (verl's column) may choose: ``tool_agent`` (the default: turns with tool calls)
#: or ``single_turn_agent`` (one model turn, tool calls in it are not run)
AGENT_NAMES = ("tool_agent", "single_turn_agent")

_CACHE_KEYS = itertools.count()  # conversation keys for an engine's kept keys/values, unique in the process


@dataclass(frozen=True, kw_only=True, slots=True)
class MultiTurnConfig:
    """Limits of one conversation: model turns, response tokens (generated + tool), per-call tool timeout."""

    max_turns: int = 4
    max_tokens: int = 256
    tool_timeout_s: float = 5.0
    max_tool_calls_per_turn: int = 4
    #: at most this many conversations per generate call (0: all that are ready). Smaller calls let one group's
    #: tools run while another group generates (the groups then stay out of phase)
    max_batch_rows: int = 0

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "max_tool_calls_per_turn"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.multi_turn.{name} must be ≥ 1, got {getattr(self, name)}")
        if self.max_batch_rows < 0:
            raise ConfigError(f"rollout.multi_turn.max_batch_rows must be ≥ 0 (0: no cap), got {self.max_batch_rows}")
        if self.tool_timeout_s <= 0:
            raise ConfigError(f"rollout.multi_turn.tool_timeout_s must be > 0, got {self.tool_timeout_s}")


@dataclass(slots=True)
class Conversation:
    """One rollout: ``prompt_ids`` then ``response_ids``; ``generated[i]`` is 1 where the model wrote the id."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_statuses: Counter[str] = field(default_factory=Counter)
    finish: str = ""
    agent_name: str = "tool_agent"
    #: verl's ``extra_info.tools_kwargs``: tool name → {"create_kwargs": {...}, "execute_kwargs": {...}}
    tools_kwargs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: what each stateful tool's ``create`` returned for this conversation (released when it ends)
    instances: dict[str, Any] = field(default_factory=dict)
    #: the interaction's state (rows with ``extra_info.interaction_kwargs`` when the loop has an interaction)
    interaction_state: Any = None
    user_turns: int = 0
    #: the engine's key for this conversation's kept keys/values (capability kv_cache_reuse)
    cache_key: int = field(default_factory=lambda: next(_CACHE_KEYS))

    @property
    def tool_errors(self) -> int:
        return sum(count for status, count in self.tool_statuses.items() if status != "ok")

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append(self, ids: Sequence[int], *, generated: bool, log_probs: Sequence[float] = ()) -> None:
        self.response_ids.extend(ids)
        self.generated.extend([1 if generated else 0] * len(ids))
        self.log_probs.extend(log_probs if generated else [0.0] * len(ids))


class AgentLoop:
    """Runs conversations against one engine with capability ``continue_from_tokens`` and a set of tools."""

    def __init__(self, engine: TokenContinuationEngine, tools: Mapping[str, Tool], chat_format: ChatFormat,
                 config: MultiTurnConfig, *, interaction: Interaction | None = None) -> None:
        if "continue_from_tokens" not in engine.capabilities:
            raise EngineError(f"multi-turn rollouts need a rollout engine with capability continue_from_tokens; "
                              f"{type(engine).__name__} has {sorted(engine.capabilities)}. Use rollout.engine: hf")
        self.engine = engine
        self.tools = dict(tools)
        self.format = chat_format
        self.config = config
        self.interaction = interaction
        self.generate_calls = 0
        self.reuse: KVCacheReuseEngine | None = engine if "kv_cache_reuse" in engine.capabilities and isinstance(
            engine, KVCacheReuseEngine) else None

    def run(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
            tools_kwargs: Sequence[Mapping[str, Any] | None] | None = None,
            agent_names: Sequence[str | None] | None = None,
            interaction_kwargs: Sequence[Mapping[str, Any] | None] | None = None) -> list[Conversation]:
        """Run one conversation per prompt to the end (blocking; the event loop lives inside, in a helper thread
        when the caller's thread already runs one). ``tools_kwargs``/``agent_names``: per prompt, verl's
        ``extra_info.tools_kwargs`` and ``agent_name`` column (None: defaults); ``interaction_kwargs`` start the
        interaction's state for a row (None: no simulated user for it)."""
        work = self.run_async(prompts, sampling, tools_kwargs=tools_kwargs, agent_names=agent_names,
                              interaction_kwargs=interaction_kwargs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(work)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, work).result()

    async def run_async(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                        tools_kwargs: Sequence[Mapping[str, Any] | None] | None = None,
                        agent_names: Sequence[str | None] | None = None,
                        interaction_kwargs: Sequence[Mapping[str, Any] | None] | None = None) -> list[Conversation]:
        conversations = [Conversation(prompt_ids=[int(t) for t in prompt]) for prompt in prompts]
        for name, per_row in (("tools_kwargs", tools_kwargs), ("agent_names", agent_names),
                              ("interaction_kwargs", interaction_kwargs)):
            if per_row is not None and len(per_row) != len(conversations):
                raise ConfigError(f"{name} has {len(per_row)} entries for {len(conversations)} prompts")
        for row, conversation in enumerate(conversations):
            if agent_names is not None and agent_names[row] is not None:
                conversation.agent_name = str(agent_names[row])
                if conversation.agent_name not in AGENT_NAMES:
                    raise ConfigError(f"row {row}: unknown agent_name {conversation.agent_name!r}; known: "
                                      f"{', '.join(AGENT_NAMES)} (or leave the column out)")
            if tools_kwargs is not None and tools_kwargs[row]:
                conversation.tools_kwargs = _check_tools_kwargs(tools_kwargs[row], row)
        if self.interaction is not None and interaction_kwargs is not None:
            for conversation, kwargs in zip(conversations, interaction_kwargs):
                if kwargs is not None:
                    conversation.interaction_state = await self.interaction.start(**dict(kwargs))
        try:
            return await self._run_conversations(conversations, sampling)
        finally:
            self._release_caches(conversations)
            await asyncio.gather(*[self._release(conversation) for conversation in conversations])
            if self.interaction is not None:
                for conversation in conversations:
                    if conversation.interaction_state is not None:
                        await self.interaction.finish(conversation.interaction_state)

    async def _run_conversations(self, conversations: list[Conversation],
                                 sampling: SamplingParams) -> list[Conversation]:
        ready: list[Conversation] = list(conversations)
        waiting: set[asyncio.Task[Conversation]] = set()
        while ready or waiting:
            if ready:
                cap = self.config.max_batch_rows or len(ready)
                batch, ready = ready[:cap], ready[cap:]
                completions = await asyncio.to_thread(self._generate, batch, sampling)
                ended = []
                for conversation, completion in zip(batch, completions):
                    calls = self._take_turn(conversation, completion)
                    if calls is not None:
                        waiting.add(asyncio.create_task(self._run_tools(conversation, calls)))
                    elif self._user_answers(conversation):
                        waiting.add(asyncio.create_task(self._run_interaction(conversation, completion)))
                    else:
                        ended.append(conversation)
                self._release_caches(ended)
                finished = {task for task in waiting if task.done()}
            else:
                finished, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            waiting -= finished
            results = [task.result() for task in finished]
            ready.extend(conversation for conversation in results if not conversation.finish)
            self._release_caches([conversation for conversation in results if conversation.finish])
        return conversations

    def _release_caches(self, conversations: Sequence[Conversation]) -> None:
        """The engine frees the kept keys/values of conversations that ended (called between generate calls)."""
        if self.reuse is not None and conversations:
            self.reuse.release_cache([conversation.cache_key for conversation in conversations])

    def _generate(self, batch: list[Conversation], sampling: SamplingParams) -> list[TokenCompletion]:
        budgets = [self.config.max_tokens - len(c.response_ids) for c in batch]
        width = min(sampling.max_new_tokens, max(budgets))
        seed = None if sampling.seed is None else sampling.seed + 7919 * self.generate_calls
        self.generate_calls += 1
        prefixes, turn_sampling = [c.ids for c in batch], replace(sampling, n=1, max_new_tokens=width, seed=seed)
        if self.reuse is not None:  # the engine continues from each conversation's kept keys/values
            completions = self.reuse.generate_from_tokens(prefixes, turn_sampling,
                                                          stop_token_ids=self.format.stop_token_ids,
                                                          cache_keys=[c.cache_key for c in batch])
        else:
            completions = self.engine.generate_from_tokens(prefixes, turn_sampling,
                                                           stop_token_ids=self.format.stop_token_ids)
        if len(completions) != len(batch):
            raise EngineError(f"generate_from_tokens returned {len(completions)} completions for {len(batch)} "
                              "prefixes; an engine must continue every prefix it is given")
        clipped = []
        for completion, budget in zip(completions, budgets):
            if len(completion.log_probs) != len(completion.token_ids):
                raise EngineError(f"generate_from_tokens returned {len(completion.token_ids)} ids but "
                                  f"{len(completion.log_probs)} log-probs; an engine must give one per sampled id")
            if len(completion.token_ids) > budget:  # a prefix of what was sampled is still exactly what was sampled
                completion = TokenCompletion(token_ids=completion.token_ids[:budget],
                                             log_probs=completion.log_probs[:budget], finish_reason="length")
            clipped.append(completion)
        return clipped

    def _take_turn(self, conversation: Conversation, completion: TokenCompletion) -> list[ToolCall] | None:
        """Append the model's turn; the calls to run next, or None when the conversation ends here."""
        conversation.append(completion.token_ids, generated=True, log_probs=completion.log_probs)
        conversation.turns += 1
        calls = parse_tool_calls(self.format.decode(completion.token_ids))
        if not calls or conversation.agent_name == "single_turn_agent":
            conversation.finish = "stop" if completion.finish_reason == "stop" else "length"
        elif conversation.turns >= self.config.max_turns:
            conversation.finish = "max_turns"
        elif len(conversation.response_ids) >= self.config.max_tokens:
            conversation.finish = "max_tokens"
        else:
            return calls
        return None

    async def _run_tools(self, conversation: Conversation, calls: list[ToolCall]) -> Conversation:
        limit = self.config.max_tool_calls_per_turn
        results: list[ToolResult] = list(await asyncio.gather(*[
            self._call(conversation, call) for call in calls[:limit]]))
        results += [ToolResult(text=f"Error: at most {limit} tool calls per turn; this one was not run.",
                               status="bad_call") for _ in calls[limit:]]
        conversation.tool_calls += len(calls)
        conversation.tool_statuses.update(result.status for result in results)
        ended_with_eos = bool(conversation.response_ids) and conversation.response_ids[-1] == self.format.eos_token_id
        ids = self.format.tool_turn_ids([result.text for result in results], ended_with_eos=ended_with_eos)
        room = self.config.max_tokens - len(conversation.response_ids)
        conversation.append(ids[:room], generated=False)
        if len(ids) >= room:
            conversation.finish = "max_tokens"  # no room left for another model turn
        return conversation

    def _user_answers(self, conversation: Conversation) -> bool:
        """Whether the simulated user gets the turn the model just ended without a tool call."""
        return (self.interaction is not None and conversation.interaction_state is not None
                and conversation.finish == "stop" and conversation.turns < self.config.max_turns
                and len(conversation.response_ids) < self.config.max_tokens)

    async def _run_interaction(self, conversation: Conversation, completion: TokenCompletion) -> Conversation:
        assert self.interaction is not None
        reply = await self.interaction.respond(conversation.interaction_state, self.format.decode(
            [t for t in completion.token_ids if t != self.format.eos_token_id]))
        if reply.done:
            conversation.finish = "interaction_done"
            return conversation
        ended_with_eos = conversation.response_ids[-1] == self.format.eos_token_id
        ids = self.format.user_turn_ids(reply.text, ended_with_eos=ended_with_eos)
        room = self.config.max_tokens - len(conversation.response_ids)
        conversation.append(ids[:room], generated=False)
        conversation.user_turns += 1
        conversation.finish = "max_tokens" if len(ids) >= room else ""
        return conversation

    async def _call(self, conversation: Conversation, call: ToolCall) -> ToolResult:
        if call.error is not None:
            return ToolResult(text=call.error, status="bad_call")
        options = conversation.tools_kwargs.get(call.name, {}) if isinstance(call.name, str) else {}
        tool = self.tools.get(call.name) if isinstance(call.name, str) else None
        if tool is None or not hasattr(tool, "create"):
            return await call_tool(self.tools, call.name, call.arguments, timeout_s=self.config.tool_timeout_s)
        if call.name not in conversation.instances:  # a stateful tool: one instance per conversation (verl)
            try:
                conversation.instances[call.name] = await asyncio.wait_for(
                    tool.create(**dict(options.get("create_kwargs", {}))), timeout=self.config.tool_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the model sees the failure as the tool's output
                return ToolResult(text=f"Error: {call.name} could not start: {type(exc).__name__}: {exc}",
                                  status="error")
        return await call_tool(self.tools, call.name, call.arguments, timeout_s=self.config.tool_timeout_s,
                               call_kwargs={"instance": conversation.instances[call.name],
                                            **dict(options.get("execute_kwargs", {}))})

    async def _release(self, conversation: Conversation) -> None:
        for name, instance in conversation.instances.items():
            release = getattr(self.tools[name], "release", None)
            if release is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(release(instance), timeout=self.config.tool_timeout_s)
        conversation.instances.clear()


def _check_tools_kwargs(value: Any, row: int) -> Mapping[str, Mapping[str, Any]]:
    """verl's ``extra_info.tools_kwargs`` of one row, checked: tool name → {"create_kwargs", "execute_kwargs"}."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"row {row}: extra_info.tools_kwargs must map tool names to {{create_kwargs, "
                          f"execute_kwargs}}, got {type(value).__name__}")
    for name, options in value.items():
        if not isinstance(options, Mapping) or set(options) - {"create_kwargs", "execute_kwargs"} or not all(
                isinstance(v, Mapping) for v in options.values()):
            raise ConfigError(f"row {row}: extra_info.tools_kwargs[{name!r}] must be {{\"create_kwargs\": {{...}}, "
                              f"\"execute_kwargs\": {{...}}}} (verl's layout), got {options!r}")
    return value


def tool_schemas(tools: Mapping[str, Tool]) -> list[dict[str, Any]]:
    """The tools' function schemas, for ``ChatFormat.render_prompt(..., tools=...)``."""
    return [dict(tool.description) for tool in tools.values()]
