"""``group.<role>.<method>`` handles and the checks of a group's roles against their ``@register`` declarations.

How a call is dispatched, collected and waited for is the worker group's (:mod:`hybridflow.controller.group`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hybridflow.controller.decorator import Dispatch, dispatch_of
from hybridflow.controller.future import BatchFuture
from hybridflow.errors import ConfigError, UnknownNameError
from hybridflow.transfer import get_protocol

if TYPE_CHECKING:
    from hybridflow.controller.group import WorkerGroup

__all__ = ["BoundMethod", "RoleHandle", "node_method", "registered_methods", "check_protocol_overrides"]


class BoundMethod:
    """``group.<role>.<method>``: calling it dispatches through the method's protocol."""

    def __init__(self, group: WorkerGroup, role: str, name: str, dispatch: Dispatch, deadline_s: float | None = None):
        self._group, self._role, self._name, self._dispatch, self._deadline_s = group, role, name, dispatch, deadline_s

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._group._invoke(self._role, self._name, self._dispatch, args, kwargs, deadline_s=self._deadline_s)

    def submit(self, *args: Any, **kwargs: Any) -> BatchFuture:
        """Dispatch now and return the call's future without waiting, even for a method declared blocking (an
        update): ``future.get()`` later returns what calling it would have. Calls to other pools run meanwhile."""
        future: BatchFuture = self._group._invoke(self._role, self._name, self._dispatch, args, kwargs,
                                                  deadline_s=self._deadline_s, wait=False)
        return future

    def with_deadline(self, seconds: float) -> BoundMethod:
        """The same method with its own deadline for the next calls."""
        return BoundMethod(self._group, self._role, self._name, self._dispatch, seconds)

    @property
    def dispatch(self) -> Dispatch:
        return self._dispatch


def node_method(handle: Any, role: str, name: str, deadlines: Mapping[str, float]) -> BoundMethod:
    """``handle.<name>`` (a :class:`RoleHandle`'s bound method) with the deadline ``deadlines["<role>.<name>"]`` (the
    config's ``reliability.deadlines``, keyed by ledger node) when one is set, else the group's own."""
    bound: BoundMethod = getattr(handle, name)
    deadline = deadlines.get(f"{role}.{name}")
    return bound if deadline is None else bound.with_deadline(deadline)


class RoleHandle:
    """``group.<role>``: the registered methods of one role, reached by attribute."""

    def __init__(self, group: WorkerGroup, role: str, cls: type) -> None:
        self._group, self._role, self._cls = group, role, cls

    def __getattr__(self, name: str) -> BoundMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        dispatch = self._group.dispatch_for(self._role, name)
        if dispatch is None:
            declared = ", ".join(registered_methods(self._cls)) or "(none)"
            raise AttributeError(
                f'role "{self._role}" ({self._cls.__name__}) has no method "{name}" declared with @register; '
                f"declared: {declared}. Fix: decorate the method with @register(protocol=...)"
            )
        return BoundMethod(self._group, self._role, name, dispatch)


def registered_methods(cls: type) -> list[str]:
    return sorted(name for name, value in inspect.getmembers(cls) if dispatch_of(value) is not None)


def check_protocol_overrides(roles: Mapping[str, type],
                        protocols: Mapping[str, Mapping[str, str]]) -> dict[tuple[str, str], Dispatch]:
    """Check ``{role: {method: protocol}}`` against the roles' registered methods and the protocol registry."""
    overrides: dict[tuple[str, str], Dispatch] = {}
    for role, methods in protocols.items():
        if role not in roles:
            raise ConfigError(f"protocols name role {role!r}, which is not in this group; expected one of "
                              f"{sorted(roles)}")
        declared = registered_methods(roles[role])
        for method, name in methods.items():
            if method not in declared:
                raise ConfigError(
                    f'protocols.{method} of role "{role}": {roles[role].__name__} has no method "{method}" declared '
                    f"with @register; expected one of {', '.join(declared) or '(none)'}"
                )
            try:
                get_protocol(name)
            except UnknownNameError as exc:
                raise ConfigError(f'protocols.{method} of role "{role}": {exc}') from exc
            dispatch = dispatch_of(getattr(roles[role], method))
            assert dispatch is not None  # declared above
            overrides[(role, method)] = replace(dispatch, protocol=name)
    return overrides
