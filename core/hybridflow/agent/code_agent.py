"""Agents as code (``rollout.agent.entry: path.py:function``): a user's agent program, written against the OpenAI
client, runs once per sample against this worker's :class:`~hybridflow.agent.endpoint.OpenAIEndpoint`; what it
called is recorded token for token and becomes the sample's training row.

The entry is called as ``function(base_url=..., api_key=..., sample={...})`` (``async def`` works too) with the
sample's fields (``prompt``: the dataset's chat messages, ``prompt_text``, ``data_source``, ``ground_truth``,
``extra_info``, ``uid``, ``index``) and returns a reward (a number) or None to let ``reward.function`` score the
trajectory. ``max_concurrency`` agents run at once, each in a thread of its own; one that raises, outlives
``timeout_s``, returns something else or makes no call becomes a failed sample (its session's key is revoked, its
row trains on nothing and scores 0, ``agent/*`` metrics count it); the step goes on. The row is the sequence of the
sample's last call (:func:`~hybridflow.agent.trajectories.build_sequences`); earlier sequences split off by a
template that rewrote history are counted (``agent/split_sequences``), not trained. Stability: experimental.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import itertools
import logging
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridflow.agent.batch import AGENT_STATUSES, build_rollout_batch
from hybridflow.agent.endpoint import OpenAIEndpoint
from hybridflow.agent.format import ChatFormat
from hybridflow.agent.loop import Conversation
from hybridflow.agent.trajectories import CallRecord, TrajectorySequence, build_sequences
from hybridflow.batch import Batch
from hybridflow.engines import RolloutEngine, RolloutEngineConfig, SamplingParams, TokenContinuationEngine
from hybridflow.errors import ConfigError, EngineError

__all__ = ["CodeAgentConfig", "AgentOutcome", "load_agent_entry", "run_agents", "CodeAgentRollout",
           "build_code_agent_batch", "CODE_AGENT_COLUMNS", "AGENT_STATUSES"]

#: per-row columns the rollout adds (summed/averaged into ``agent/*`` metrics by hybridflow.agent.batch)
CODE_AGENT_COLUMNS = ("agent_status", "agent_failed", "agent_calls", "agent_sequences", "agent_truncated",
                      "agent_rewards")
_SESSIONS = itertools.count()
_LOG = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class CodeAgentConfig:
    """``rollout.agent``: the entry, how many agents run at once (0: all), each one's wall-clock limit and call
    budget, and the response width of a row (tokens after the sample's first prompt, tool turns included)."""

    entry: str
    max_concurrency: int = 0
    timeout_s: float = 60.0
    max_calls: int = 8
    max_tokens: int = 256
    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        if self.max_concurrency < 0 or self.max_calls < 1 or self.max_tokens < 1 or self.timeout_s <= 0:
            raise ConfigError(f"rollout.agent needs max_concurrency >= 0, max_calls >= 1, max_tokens >= 1 and "
                              f"timeout_s > 0; got {self.max_concurrency}, {self.max_calls}, {self.max_tokens}, "
                              f"{self.timeout_s}")


@dataclass(slots=True)
class AgentOutcome:
    """One sample's agent run: its status, the reward it returned (None: the reward function scores), its calls."""

    session_id: str
    status: str = "ok"
    reward: float | None = None
    error: str = ""
    calls: list[CallRecord] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status != "ok"

    def sequences(self) -> list[TrajectorySequence]:
        return build_sequences(self.calls)


def load_agent_entry(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names: ``path/to/file.py:function`` or ``package.module:function``."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ConfigError(f"rollout.agent.entry must be 'path/to/agent.py:function' or 'package.module:function', "
                          f"got {spec!r}")
    try:
        if target.endswith(".py"):
            path = Path(target).expanduser().resolve()
            if not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            module_name = f"hybridflow_agent_{abs(hash(str(path)))}"
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise ImportError(f"cannot load {path} as a module")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        function = getattr(module, name)
    except (ImportError, AttributeError, FileNotFoundError, SyntaxError) as exc:
        raise ConfigError(f"rollout.agent.entry {spec!r} could not be loaded: {type(exc).__name__}: {exc}. Fix: give "
                          "an existing file (absolute, or relative to where the run starts) and a function in it"
                          ) from exc
    if not callable(function):
        raise ConfigError(f"rollout.agent.entry {spec!r} names a {type(function).__name__}, not a function")
    return function  # type: ignore[no-any-return]


def _call_agent(function: Callable[..., Any], base_url: str, api_key: str, sample: Mapping[str, Any]) -> Any:
    result = function(base_url=base_url, api_key=api_key, sample=dict(sample))
    if inspect.isawaitable(result):
        return asyncio.run(_await(result))
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable


def run_agents(endpoint: OpenAIEndpoint, function: Callable[..., Any], samples: Sequence[Mapping[str, Any]],
               config: CodeAgentConfig, *, greedy: bool = False) -> list[AgentOutcome]:
    """Run ``function`` once per sample, ``config.max_concurrency`` at a time, each in a daemon thread with its own
    session; never waits past an agent's ``timeout_s`` (a hung agent's thread is left behind, its key revoked)."""
    base_url = endpoint.start()
    outcomes = [AgentOutcome(session_id=f"s{next(_SESSIONS)}") for _ in samples]
    limit = config.max_concurrency or len(samples)
    waiting = list(range(len(samples)))
    running: dict[int, tuple[threading.Thread, float, list[Any]]] = {}
    done = threading.Event()

    def start(row: int) -> None:
        session = endpoint.open_session(outcomes[row].session_id, max_calls=config.max_calls, greedy=greedy)
        result: list[Any] = []

        def target() -> None:
            try:
                result.append(("ok", _call_agent(function, base_url, session.api_key, samples[row])))
            except BaseException:  # noqa: BLE001 - the agent's failure is its sample's, reported with its trace
                result.append(("error", traceback.format_exc(limit=-3)))
            done.set()

        thread = threading.Thread(target=target, name=f"agent-{outcomes[row].session_id}", daemon=True)
        running[row] = (thread, time.monotonic(), result)
        thread.start()

    while waiting or running:
        while waiting and len(running) < limit:
            start(waiting.pop(0))
        done.wait(timeout=0.05)
        done.clear()
        now = time.monotonic()
        for row, (_, started, result) in list(running.items()):
            outcome = outcomes[row]
            if result:
                kind, value = result[0]
                outcome.calls = endpoint.close_session(outcome.session_id)
                outcome.seconds = now - started
                _settle(outcome, kind, value)
                del running[row]
            elif now - started > config.timeout_s:
                outcome.calls = endpoint.close_session(outcome.session_id)
                outcome.seconds = now - started
                outcome.status, outcome.error = "timeout", f"the agent ran past rollout.agent.timeout_s = " \
                                                           f"{config.timeout_s} s"
                del running[row]
    return outcomes


def _settle(outcome: AgentOutcome, kind: str, value: Any) -> None:
    if kind == "error":
        outcome.status, outcome.error = "error", str(value)
    elif not outcome.calls:
        outcome.status, outcome.error = "no_calls", "the agent made no call to the endpoint"
    elif value is None:
        outcome.status = "ok"
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        outcome.status, outcome.error = "bad_return", (f"the agent returned {type(value).__name__} {value!r:.80}; "
                                                       "it must return a finite number (the reward) or None")
    else:
        outcome.reward = float(value)


def build_code_agent_batch(rows: Batch, outcomes: Sequence[AgentOutcome], *, width: int, max_prompt_length: int,
                           pad_token_id: int, policy_version: int) -> Batch:
    """One row per sample: the sequence holding its last call (prompt left-padded to ``max_prompt_length``,
    response ``width`` wide, cut there if longer: ``agent_truncated``); a failed sample's row has no response and
    ``agent_rewards`` 0; ``agent_rewards`` is NaN where the reward function scores."""
    conversations: list[Conversation] = []
    prompts: list[list[int]] = []
    failed, truncated, sequences, calls, rewards, statuses = [], [], [], [], [], []
    for row, outcome in enumerate(outcomes):
        mask = rows["attention_mask"][row].bool()
        chosen = None
        built = outcome.sequences() if outcome.calls else []
        if not outcome.failed and built:
            last = max(call.index for call in outcome.calls)
            chosen = next(sequence for sequence in built if last in sequence.calls)
            if len(chosen.prompt_ids) > max_prompt_length:
                outcome.status, outcome.error = "error", (f"the agent's first prompt has {len(chosen.prompt_ids)} "
                                                          f"tokens, more than data.max_prompt_length = "
                                                          f"{max_prompt_length}")
                chosen = None
        if chosen is None:
            prompts.append(rows["input_ids"][row][mask].tolist())
            conversations.append(Conversation(prompt_ids=prompts[-1]))
            failed.append(1.0)
            truncated.append(0.0)
            rewards.append(0.0)
        else:
            cut = min(width, len(chosen.response_ids))
            prompts.append(chosen.prompt_ids)
            conversations.append(Conversation(
                prompt_ids=chosen.prompt_ids, response_ids=chosen.response_ids[:cut],
                generated=chosen.generated[:cut], log_probs=chosen.log_probs[:cut], turns=len(chosen.calls),
                tool_calls=sum(call.tool_calls for call in outcome.calls if call.index in chosen.calls)))
            failed.append(0.0)
            truncated.append(float(cut < len(chosen.response_ids)))
            rewards.append(math.nan if outcome.reward is None else outcome.reward)
        sequences.append(float(len(built)))
        calls.append(float(len(outcome.calls)))
        statuses.append(float(AGENT_STATUSES.index(outcome.status)))
    input_ids = torch.full((len(rows), max_prompt_length), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), max_prompt_length), dtype=rows["attention_mask"].dtype)
    for row, ids in enumerate(prompts):
        if ids:
            input_ids[row, max_prompt_length - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention[row, max_prompt_length - len(ids):] = 1
    own_prompts = Batch(rows.tensors.clone(recurse=False), dict(rows.non_tensors), dict(rows.meta))
    own_prompts["input_ids"] = input_ids
    own_prompts["attention_mask"] = attention
    batch = build_rollout_batch(own_prompts, conversations, width=width, pad_token_id=pad_token_id,
                                policy_version=policy_version)
    for name, values in (("agent_status", statuses), ("agent_failed", failed), ("agent_truncated", truncated),
                         ("agent_sequences", sequences), ("agent_calls", calls), ("agent_rewards", rewards)):
        batch[name] = torch.tensor(values, dtype=torch.float32)
    return batch


def _samples(rows: Batch) -> list[dict[str, Any]]:
    columns = {name: list(values) for name, values in rows.non_tensors.items()}
    samples = []
    for row in range(len(rows)):
        sample = {name: values[row] for name, values in columns.items()}
        sample["prompt"] = sample.pop("raw_prompt", sample.get("prompt_text"))
        sample["index"] = row
        samples.append(sample)
    return samples


class CodeAgentRollout:
    """One worker's endpoint (started on first use, on ``host``, a free port by default) and its agent entry."""

    def __init__(self, engine: RolloutEngine, rollout_config: RolloutEngineConfig, options: Mapping[str, Any],
                 *, max_new_tokens: int) -> None:
        if not isinstance(engine, TokenContinuationEngine) or "continue_from_tokens" not in engine.capabilities:
            raise EngineError(f"rollout.agent serves its agents from token ids, which needs a rollout engine with "
                              f"capability continue_from_tokens; {type(engine).__name__} has "
                              f"{sorted(engine.capabilities)}. Use rollout.engine: hf or vllm")
        if rollout_config.model.path is None:
            raise ConfigError("rollout.agent needs the model's tokenizer and chat template: set actor.model.path to "
                              "an HF model directory saved with a chat tokenizer")
        from hybridflow.model_dir import load_tokenizer

        self.config = CodeAgentConfig(**{key: options[key] for key in CodeAgentConfig.__slots__ if key in options})
        self.function = load_agent_entry(self.config.entry)
        self.chat_format = ChatFormat(load_tokenizer(rollout_config.model.path))
        self.max_prompt_length = rollout_config.max_prompt_length
        self.pad_token_id = rollout_config.pad_token_id
        self.engine = engine
        self.endpoint = OpenAIEndpoint(engine, self.chat_format, max_new_tokens=max_new_tokens,
                                       max_context_tokens=self.max_prompt_length + self.config.max_tokens,
                                       host=self.config.host, port=self.config.port, seed=rollout_config.seed)

    def generate(self, prompts: Batch, sampling: SamplingParams, *, greedy: bool = False) -> Batch:
        """``sampling.n`` agent runs per prompt; rows as ``RolloutEngine.generate`` returns them plus the agent
        columns. The agents' own ``temperature`` applies (``greedy``: forced to 0)."""
        rows = prompts.repeat_interleave(sampling.n) if sampling.n > 1 else prompts
        self.endpoint.seed = sampling.seed
        outcomes = run_agents(self.endpoint, self.function, _samples(rows), self.config, greedy=greedy)
        batch = build_code_agent_batch(rows, outcomes, width=self.config.max_tokens,
                                       max_prompt_length=self.max_prompt_length, pad_token_id=self.pad_token_id,
                                       policy_version=self.engine.weights_version)
        for outcome in outcomes:
            if outcome.failed:
                last = outcome.error.strip().splitlines()[-1] if outcome.error.strip() else ""
                _LOG.warning("rollout.agent: sample %s failed (%s, scored 0): %s", outcome.session_id,
                             outcome.status, last)
        return batch

    def close(self) -> None:
        self.endpoint.stop()


def code_agent_options(extra: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A role spec's ``rollout.agent`` options (None when the agent path is off)."""
    options = extra.get("agent")
    return options if isinstance(options, Mapping) and options.get("entry") else None

