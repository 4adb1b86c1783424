"""The :class:`Algorithm` interface: what a registered RL algorithm provides to the trainer. Stability: public.

What the roles and state are is :mod:`hybridflow.algorithms.roles`'; what ``step`` calls is
:mod:`hybridflow.algorithms.runtime`'s :class:`Runtime`.
"""

from __future__ import annotations

from typing import Any, Protocol

from hybridflow.algorithms.roles import RoleDeclaration, Stateful
from hybridflow.algorithms.runtime import Runtime
from hybridflow.batch import Batch

__all__ = ["Algorithm"]


class Algorithm(Protocol):
    """An RL algorithm: the roles and state it declares, and one step of dataflow. Stability: public.

    ``roles(config)`` lists the model roles to build for this config (the actor first; a role left out is not
    built), ``build_state(config)`` the objects it keeps across steps (checkpointed by name), and ``step`` one
    iteration over the handles. Both may raise :class:`~hybridflow.errors.ConfigError` for keys the algorithm
    cannot honour. ``extra_keys`` names the ``algorithm.extra`` options it reads (any other is refused).
    """

    name: str
    extra_keys: tuple[str, ...]

    def roles(self, config: Any) -> list[RoleDeclaration]: ...

    def build_state(self, config: Any) -> dict[str, Stateful]: ...

    def step(self, runtime: Runtime, prompts: Batch) -> dict[str, float]: ...
