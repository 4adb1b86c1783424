"""Rule-based reward functions: the built-in ones, lookup by registry name or ``module:function``, and checks.

A reward function maps decoded responses to one float each. Model-based rewards run in a reward-model worker
(:mod:`hybridflow.workers`), not here. ``module:function`` imports and runs user code: only use trusted modules.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

from hybridflow import registries
from hybridflow.errors import ConfigError, RewardError
from hybridflow.hookspecs import hookimpl
from hybridflow.tasks.arithmetic import arithmetic_reward

__all__ = ["RewardFunction", "resolve_reward_function", "compute_rule_rewards", "response_length_cost"]

RewardFunction = Callable[..., Sequence[float]]


def response_length_cost(*, responses: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
                         extra: Sequence[dict[str, Any]] | None = None) -> list[float]:
    """A cost for Safe-RLHF demos: the response length in characters divided by 10."""
    return [len(text) / 10.0 for text in responses]


def resolve_reward_function(spec: str, *, key: str = "reward.function") -> RewardFunction:
    """A registered name (``"arithmetic"``) or an importable ``"package.module:function"``."""
    if ":" in spec:
        module_name, _, attribute = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(
                f'{key}: could not import module "{module_name}" of "{spec}" ({exc}). Expected "package.module:'
                f'function" importable from the driver and workers (on PYTHONPATH), or a registered name: '
                f'{", ".join(registries.rewards.names())}.'
            ) from exc
        function = getattr(module, attribute, None)
        if not callable(function):
            raise ConfigError(f'{key}: "{module_name}" has no callable "{attribute}"; check the name after ":".')
        imported: RewardFunction = function
        return imported
    from hybridflow.plugins import get_plugin_manager

    get_plugin_manager()  # the core's own rewards are registered with the manager (no entry points loaded)
    try:
        registered: RewardFunction = registries.rewards.get(spec)
        return registered
    except KeyError as exc:
        raise ConfigError(f"{key}: {exc}") from exc


def compute_rule_rewards(function: RewardFunction, *, responses: Sequence[str], ground_truths: Sequence[Any],
                         data_sources: Sequence[str], extra: Sequence[dict[str, Any]] | None = None,
                         name: str = "reward") -> list[float]:
    """Call ``function`` and check it returned one finite float per response."""
    try:
        scores = function(responses=list(responses), ground_truths=list(ground_truths),
                          data_sources=list(data_sources), extra=list(extra) if extra is not None else None)
    except Exception as exc:  # a user function's failure becomes a typed error naming it
        raise RewardError(f'{name} function {_describe(function)} raised {type(exc).__name__}: {exc}') from exc
    try:
        values = [float(s) for s in scores]
    except (TypeError, ValueError) as exc:
        raise RewardError(
            f"{name} function {_describe(function)} must return one number per response; got {type(scores).__name__}"
        ) from exc
    if len(values) != len(responses):
        raise RewardError(
            f"{name} function {_describe(function)} returned {len(values)} scores for {len(responses)} responses; "
            "expected exactly one float per response"
        )
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RewardError(
            f"{name} function {_describe(function)} returned non-finite scores (NaN/inf) at rows {bad[:5]}; "
            "return finite floats (e.g. 0.0 for an unparsable response)"
        )
    return values


def _describe(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


@hookimpl
def hybridflow_register_rewards(registry: Any) -> None:
    registry.register("arithmetic", arithmetic_reward)
    registry.register("response_length_cost", response_length_cost)
