"""Environments with reset/step (OpenEnv's shape): what an environment class implements to be served by
:mod:`hybridflow.agent.env_server`, the step result on the wire, and loading a class from ``package.module:Class``.

An environment is one episode's state: ``reset(**kwargs)`` starts it and ``step(action)`` answers an action with an
:class:`EnvStep` (observation, reward, done). For LLM rollouts (:mod:`hybridflow.agent.env_loop`) the action is
``{"message": <the model turn's text>}`` and a not-done observation holds the next turn as chat ``messages``
(``[{"role": "tool" | "user", "content": str}, ...]``). Serving and driving episodes are the server's and the
loop's. Stability: experimental.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from hybridflow.errors import ConfigError

__all__ = ["EnvStep", "Environment", "load_environment_class", "parse_step", "filter_kwargs", "EnvResponseError"]


class EnvResponseError(ValueError):
    """An environment's answer that is not a step result (not a mapping, no observation mapping, a reward that is not
    a finite number or null, ``done`` not a boolean)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvStep:
    """What ``reset`` and ``step`` return: OpenEnv's ``StepResult`` (``observation``, ``reward``, ``done``)."""

    observation: Mapping[str, Any] = field(default_factory=dict)
    reward: float | None = None
    done: bool = False

    def to_json(self) -> dict[str, Any]:
        """The wire form: ``{"observation": {...}, "reward": float | null, "done": bool}``."""
        return {"observation": dict(self.observation), "reward": self.reward, "done": self.done}


@runtime_checkable
class Environment(Protocol):
    """One episode's state (stability: experimental). The server builds one instance per session.

    ``reset`` gets the keyword arguments its signature names (``seed``, ``episode_id`` and the rollout's
    ``prompt``/``ground_truth``/``extra_info``, as OpenEnv's server filters them); ``step`` gets the action mapping;
    ``state`` is what ``GET /state`` and the ``state`` message return. Each may be ``async def``.
    """

    def reset(self, **kwargs: Any) -> EnvStep: ...

    def step(self, action: Mapping[str, Any]) -> EnvStep: ...

    def state(self) -> Mapping[str, Any]: ...


def parse_step(payload: Any) -> EnvStep:
    """An :class:`EnvStep` from an environment's return value or a wire payload; :class:`EnvResponseError` if junk."""
    if isinstance(payload, EnvStep):
        payload = payload.to_json()
    if not isinstance(payload, Mapping):
        raise EnvResponseError(f"expected a step result mapping {{observation, reward, done}}, got "
                               f"{type(payload).__name__} {payload!r:.80}")
    observation = payload.get("observation", {})
    reward = payload.get("reward")
    done = payload.get("done", False)
    if not isinstance(observation, Mapping):
        raise EnvResponseError(f"observation must be a JSON object, got {type(observation).__name__}")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(float(reward))):
        raise EnvResponseError(f"reward must be a finite number or null, got {reward!r:.80}")
    if not isinstance(done, bool):
        raise EnvResponseError(f"done must be a boolean, got {done!r:.80}")
    return EnvStep(observation=dict(observation), reward=None if reward is None else float(reward), done=done)


def filter_kwargs(function: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``function`` accepts (all of them when it takes ``**kwargs``), as OpenEnv's server does."""
    parameters = inspect.signature(function).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(kwargs)
    return {key: value for key, value in kwargs.items() if key in parameters}


def load_environment_class(spec: str, *, key: str = "rollout.env.entry") -> Callable[..., Any]:
    """The class (or factory) ``spec`` names: ``package.module:Class``; its instances need reset/step/state."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{key} must be 'package.module:Class', got {spec!r}. Fix: name an importable module and "
                          "the environment class in it (e.g. hybridflow.tasks.tool_calc_env:ToolCalcEnv)")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{key} {spec!r} could not be loaded: {type(exc).__name__}: {exc}. Fix: make the module "
                          "importable on the workers or correct the name") from exc
    if not callable(target):
        raise ConfigError(f"{key} {spec!r} names a {type(target).__name__}, not a class or factory")
    if inspect.isclass(target):
        missing = [name for name in ("reset", "step", "state") if not callable(getattr(target, name, None))]
        if missing:
            raise ConfigError(f"{key} {spec!r}: expected a class with reset, step and state (the Environment "
                              f"protocol); got one without {', '.join(missing)}. Fix: add them")
    return target  # type: ignore[no-any-return]
