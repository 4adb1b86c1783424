"""Multi-turn rollouts against environments served over reset/step (:mod:`hybridflow.agent.env_client`): each
conversation opens a session and resets it with its row, the rollout engine writes the model's turn, the turn's text
goes to ``step`` as ``{"message": text}``, and the observation's ``messages`` are appended as the next turn's tokens
(``tool`` messages as a tool turn, one ``user`` message as a user turn) until the environment says ``done``, or
``max_turns`` / ``max_tokens`` run out (truncated). The episode's reward is the sum of the rewards its steps returned.

Generation is the agent loop's (:class:`~hybridflow.agent.loop.AgentLoop`: ready conversations batched into one
``generate_from_tokens`` call, KV-cache keys, token budget) and so is token-exactness: nothing is re-tokenized.
An environment that errors, drops the session, answers junk or takes longer than ``timeout_s`` for a call fails
only its own episode (``status``); building the training rows is :mod:`hybridflow.agent.env_rollout`'s.
Stability: experimental.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from hybridflow.agent.env_client import EnvCallError, EnvResponseError, EnvSession, EnvTimeoutError
from hybridflow.agent.environment import EnvStep
from hybridflow.agent.format import ChatFormat
from hybridflow.agent.loop import AgentLoop, Conversation, MultiTurnConfig
from hybridflow.engines import SamplingParams, TokenCompletion, TokenContinuationEngine

__all__ = ["EnvEpisode", "EnvLoop"]


@dataclass(slots=True)
class EnvEpisode:
    """One conversation with its environment session: ``status`` is ``ok`` or why it failed (``error``,
    ``timeout``, ``bad_response``); ``truncated`` when the budget ended it before the environment said done."""

    conversation: Conversation
    reset_kwargs: Mapping[str, Any] = field(default_factory=dict)
    status: str = "ok"
    error: str = ""
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    steps: int = 0
    session: EnvSession | None = None

    @property
    def ended(self) -> bool:
        return self.done or self.truncated or self.status != "ok"

    def fail(self, status: str, error: str) -> None:
        self.status, self.error = status, error


class EnvLoop(AgentLoop):
    """Runs episodes against the environment at ``base_url`` with one engine (capability ``continue_from_tokens``).

    ``config``: ``max_turns``, ``max_tokens``, ``max_batch_rows`` as for the tool loop; ``timeout_s`` bounds every
    environment call (connect, reset, step)."""

    def __init__(self, engine: TokenContinuationEngine, chat_format: ChatFormat, config: MultiTurnConfig, *,
                 base_url: str, timeout_s: float) -> None:
        super().__init__(engine, {}, chat_format, config)
        self.base_url = base_url
        self.timeout_s = timeout_s

    def run_episodes(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                     reset_kwargs: Sequence[Mapping[str, Any]]) -> list[EnvEpisode]:
        """One episode per prompt, run to its end (blocking). ``reset_kwargs``: per prompt, what ``reset`` gets."""
        episodes = [EnvEpisode(Conversation(prompt_ids=[int(t) for t in prompt]), reset_kwargs=kwargs)
                    for prompt, kwargs in zip(prompts, reset_kwargs, strict=True)]
        work = self._run_episodes(episodes, sampling)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(work)
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, work).result()

    async def _run_episodes(self, episodes: list[EnvEpisode], sampling: SamplingParams) -> list[EnvEpisode]:
        # every episode holds its session from reset to its end: no connection-pool cap, which would park a reset
        # behind sessions that end only after the resets
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            try:
                await asyncio.gather(*[self._reset(episode, http) for episode in episodes])
                await self._run_turns([episode for episode in episodes if not episode.ended], sampling)
            finally:
                self._release_caches([episode.conversation for episode in episodes])
                await asyncio.gather(*[episode.session.close() for episode in episodes
                                       if episode.session is not None])
        return episodes

    async def _run_turns(self, ready: list[EnvEpisode], sampling: SamplingParams) -> None:
        waiting: set[asyncio.Task[EnvEpisode]] = set()
        while ready or waiting:
            if ready:
                cap = self.config.max_batch_rows or len(ready)
                batch, ready = ready[:cap], ready[cap:]
                completions = await asyncio.to_thread(self._generate, [e.conversation for e in batch], sampling)
                for episode, completion in zip(batch, completions):
                    waiting.add(asyncio.create_task(self._step(episode, completion)))
                finished = {task for task in waiting if task.done()}
            else:
                finished, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            waiting -= finished
            results = [task.result() for task in finished]
            ready.extend(episode for episode in results if not episode.ended)
            self._release_caches([episode.conversation for episode in results if episode.ended])

    async def _reset(self, episode: EnvEpisode, http: aiohttp.ClientSession) -> None:
        episode.session = EnvSession(http, self.base_url, timeout_s=self.timeout_s)
        await self._ask_env(episode, lambda session: session.reset(**episode.reset_kwargs))

    async def _ask_env(self, episode: EnvEpisode, ask: Any) -> EnvStep | None:
        """``ask(session)`` under the deadline; a failure marks the episode and returns None."""
        assert episode.session is not None
        try:
            step: EnvStep = await asyncio.wait_for(ask(episode.session), timeout=self.timeout_s * 2)
            return step
        except (EnvTimeoutError, TimeoutError, asyncio.TimeoutError) as exc:
            episode.fail("timeout", str(exc) or f"no answer within rollout.env.timeout_s = {self.timeout_s} s")
        except EnvResponseError as exc:
            episode.fail("bad_response", str(exc))
        except EnvCallError as exc:
            episode.fail("error", str(exc))
        return None

    async def _step(self, episode: EnvEpisode, completion: TokenCompletion) -> EnvEpisode:
        """Append the model's turn, send its text to ``step``, append the observation's messages (or end)."""
        conversation = self._take_model_turn(episode, completion)
        eos = self.format.eos_token_id
        text = self.format.decode([token for token in completion.token_ids if token != eos])
        result = await self._ask_env(episode, lambda session: session.step({"message": text}))
        if result is None:
            return episode
        episode.steps += 1
        episode.reward += result.reward or 0.0
        if result.done:
            episode.done = True
            conversation.finish = "done"
            return episode
        if conversation.turns >= self.config.max_turns or len(conversation.response_ids) >= self.config.max_tokens:
            episode.truncated = True
            conversation.finish = "max_turns" if conversation.turns >= self.config.max_turns else "max_tokens"
            return episode
        turn = self._observation_turn(episode, result.observation)
        if turn is None:
            return episode
        room = self.config.max_tokens - len(conversation.response_ids)
        conversation.append(turn[:room], generated=False)
        if len(turn) >= room:  # no room left for another model turn
            episode.truncated = True
            conversation.finish = "max_tokens"
        return episode

    def _take_model_turn(self, episode: EnvEpisode, completion: TokenCompletion) -> Conversation:
        conversation = episode.conversation
        conversation.append(completion.token_ids, generated=True, log_probs=completion.log_probs)
        conversation.turns += 1
        return conversation

    def _observation_turn(self, episode: EnvEpisode, observation: Mapping[str, Any]) -> list[int] | None:
        """The next turn's ids from ``observation["messages"]``; None (the episode failed) when it holds none."""
        messages = observation.get("messages")
        valid = isinstance(messages, list) and messages and all(
            isinstance(m, Mapping) and m.get("role") in ("tool", "user") and isinstance(m.get("content"), str)
            for m in messages)
        roles = {m["role"] for m in messages} if valid and isinstance(messages, list) else set()
        if not valid or len(roles) != 1 or (roles == {"user"} and len(messages or []) != 1):
            episode.fail("bad_response", "a step that is not done must return observation.messages: a non-empty "
                         "list of {role: tool, content: str} (tool results) or one {role: user, content: str}; "
                         f"got {messages!r:.120}")
            return None
        assert isinstance(messages, list)
        conversation = episode.conversation
        ended_with_eos = conversation.response_ids[-1] == self.format.eos_token_id
        if roles == {"user"}:
            conversation.user_turns += 1
            return self.format.user_turn_ids(str(messages[0]["content"]), ended_with_eos=ended_with_eos)
        statuses = observation.get("tool_statuses")
        if not (isinstance(statuses, list) and len(statuses) == len(messages)):
            statuses = ["ok"] * len(messages)
        conversation.tool_calls += len(messages)
        conversation.tool_statuses.update(str(status) for status in statuses)
        return self.format.tool_turn_ids([str(m["content"]) for m in messages], ended_with_eos=ended_with_eos)
