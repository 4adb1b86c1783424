"""The interaction hook: a simulated user that answers the model's turns (verl's ``Interaction``), so a rollout can
be a multi-turn dialogue (e.g. "try again" after a wrong answer) and not only tool calls.

An interaction is built from ``rollout.multi_turn.interaction`` (``"package.module:factory"``); each row's
``extra_info.interaction_kwargs`` starts its own state. Running turns is :mod:`hybridflow.agent.loop`'s.
Stability: experimental.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hybridflow.errors import ConfigError

__all__ = ["Interaction", "InteractionTurn", "load_interaction"]


@dataclass(frozen=True, kw_only=True, slots=True)
class InteractionTurn:
    """The user's reply to the model's last turn (``text``), or ``done`` when the dialogue ends there."""

    text: str = ""
    done: bool = False


@runtime_checkable
class Interaction(Protocol):
    """A simulated user (stability: experimental).

    ``start(**interaction_kwargs)`` runs when a conversation begins (the row's kwargs) and returns its state;
    ``respond(state, response)`` gets the text of each model turn that called no tool and says what the user
    answers (or that the dialogue is done); ``finish(state)`` runs when the conversation ends.
    """

    async def start(self, **interaction_kwargs: Any) -> Any: ...

    async def respond(self, state: Any, response: str) -> InteractionTurn: ...

    async def finish(self, state: Any) -> None: ...


def load_interaction(spec: str) -> Interaction:
    """Build the interaction named by ``"package.module:factory"`` (``factory()`` returns an :class:`Interaction`)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"rollout.multi_turn.interaction must be 'package.module:factory', got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"rollout.multi_turn.interaction {spec!r} could not be loaded: {type(exc).__name__}: "
                          f"{exc}. Fix: make the module importable on the workers or correct the name") from exc
    interaction = factory()
    if not isinstance(interaction, Interaction):
        raise ConfigError(f"rollout.multi_turn.interaction {spec!r} returned {type(interaction).__name__}, which "
                          "lacks start/respond/finish (the Interaction protocol)")
    return interaction
