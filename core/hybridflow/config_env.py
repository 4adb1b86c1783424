"""The ``rollout.env`` section: multi-turn rollouts against an environment served over reset/step (OpenEnv's shape,
docs/guide/agent.md), validated at load with the expected value, what was given and the fix.

It only describes the environment; serving and driving it are :mod:`hybridflow.agent.env_server`'s and
:mod:`hybridflow.agent.env_loop`'s.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from hybridflow.config_sections import _Section

__all__ = ["EnvSection"]


def _reject(key: str, reason: str) -> PydanticCustomError:
    return PydanticCustomError("rejected_key", "{reason}", {"key": key, "reason": reason})


class EnvSection(_Section):
    """An environment each sample's conversation runs against: the model's turns are its actions, its observations
    the next turns, its rewards the score. Give ``entry`` (served by each actor worker) or ``url`` (already up)."""

    # an environment class, "package.module:Class", that each actor worker serves itself on host:port
    # (hybridflow.agent.env_server; e.g. hybridflow.tasks.tool_calc_env:ToolCalcEnv)
    entry: str | None = None
    # or the base URL of an OpenEnv-shaped server already running (its /ws sessions); one of entry, url
    url: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)  # keyword arguments of entry's constructor
    # registered tools whose function schemas are rendered into the prompts (the environment runs the calls: e.g.
    # [calculator] for ToolCalcEnv); [] renders none
    tools: list[str] = Field(default_factory=list)
    max_turns: int = Field(default=4, gt=0)  # model turns per episode; then it is truncated (reward so far)
    max_tokens: int = Field(default=256, gt=0)  # response ids per episode (model + observation turns): its width
    timeout_s: float = Field(default=30.0, gt=0)  # per environment call (connect, reset, step); past it: failed
    max_batch_rows: int = Field(default=0, ge=0)  # episodes per generate call (0: all ready ones)
    host: str = "127.0.0.1"  # entry's server address (loopback: only this machine's processes reach it)
    port: int = Field(default=0, ge=0, le=65535)  # entry's server port (0: a free port per worker)

    @model_validator(mode="after")
    def _entry_or_url(self) -> EnvSection:
        if (self.entry is None) == (self.url is None):
            raise _reject("entry", f"expected exactly one of rollout.env.entry (an environment class to serve) and "
                                   f"rollout.env.url (a running server); got entry={self.entry!r}, url={self.url!r}. "
                                   "Fix: set one of them")
        if self.entry is not None and (":" not in self.entry or self.entry.endswith(":")
                                       or self.entry.startswith(":")):
            raise _reject("entry", f"expected 'package.module:Class', got {self.entry!r}. Fix: e.g. "
                                   "hybridflow.tasks.tool_calc_env:ToolCalcEnv")
        if self.url is not None and not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise _reject("url", f"expected an http(s):// or ws(s):// base URL (the client appends /ws), got "
                                 f"{self.url!r}. Fix: e.g. http://127.0.0.1:8000")
        if self.url is not None and self.options:
            raise _reject("options", "options are entry's constructor arguments; a server at rollout.env.url was "
                                     "built by whoever started it. Fix: remove rollout.env.options")
        return self


def check_env_conflicts(rollout: Any) -> None:
    """``rollout.env`` with another way to roll out a sample, or where its loop cannot run: raised as a rejected
    key (called from ``RolloutConfig``'s validator)."""
    if rollout.env is None:
        return
    if rollout.agent is not None or rollout.multi_turn.enable:
        raise _reject("env", "rollout.env, rollout.agent and rollout.multi_turn.enable each choose how a sample is "
                             f"rolled out; got env and {'agent' if rollout.agent is not None else 'multi_turn'}. "
                             "Fix: keep one (remove rollout.agent / set rollout.multi_turn.enable=false)")
    if rollout.pool is not None or rollout.tensor_parallel_size != 1:
        raise _reject("env", "rollout.env runs on the actor's own rollout engine at tensor_parallel_size = 1; got "
                             f"pool={rollout.pool!r}, tensor_parallel_size={rollout.tensor_parallel_size}. Fix: "
                             "remove rollout.pool and set rollout.tensor_parallel_size=1")
