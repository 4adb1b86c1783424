"""``@register``: the per-method dispatch declaration (protocol, who executes, blocking, idempotent, deadline).

It only stores a frozen :class:`Dispatch` on the function; :class:`~hybridflow.controller.WorkerGroup` validates
it (the protocol must be registered) when the group is built and executes it on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from hybridflow.errors import ConfigError

__all__ = ["Dispatch", "register", "dispatch_of", "DISPATCH_ATTRIBUTE"]

#: the attribute under which ``@register`` stores its :class:`Dispatch`
DISPATCH_ATTRIBUTE = "__hybridflow_dispatch__"

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, kw_only=True, slots=True)
class Dispatch:
    """How a worker method is called through a group. Stability: public.

    ``protocol`` names a registered transfer protocol; ``execute="rank_zero"`` runs only rank 0;
    ``blocking=False`` makes the call return a ``BatchFuture``; ``idempotent`` tells a recovering caller it may
    replay the call; ``deadline_s`` overrides the group's deadline for this method.
    """

    protocol: str = "one_to_all"
    execute: Literal["all", "rank_zero"] = "all"
    blocking: bool = True
    idempotent: bool = False
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.protocol, str) or not self.protocol:
            raise ConfigError(f"@register(protocol=...) expects a protocol name, got {self.protocol!r}")
        if self.execute not in ("all", "rank_zero"):
            raise ConfigError(f'@register(execute=...) expects "all" or "rank_zero", got {self.execute!r}')
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ConfigError(f"@register(deadline_s=...) expects a positive number of seconds, got {self.deadline_s}")


def register(
    protocol: str = "one_to_all",
    *,
    execute: Literal["all", "rank_zero"] = "all",
    blocking: bool = True,
    idempotent: bool = False,
    deadline_s: float | None = None,
) -> Callable[[F], F]:
    """Declare how a worker method is dispatched; the function itself is returned unchanged. Stability: public."""
    dispatch = Dispatch(protocol=protocol, execute=execute, blocking=blocking, idempotent=idempotent,
                        deadline_s=deadline_s)

    def decorate(function: F) -> F:
        setattr(function, DISPATCH_ATTRIBUTE, dispatch)
        return function

    return decorate


def dispatch_of(function: Any) -> Dispatch | None:
    """The :class:`Dispatch` stored by ``@register`` on ``function`` (or a bound method of it), else ``None``."""
    function = getattr(function, "__func__", function)
    value = getattr(function, DISPATCH_ATTRIBUTE, None)
    return value if isinstance(value, Dispatch) else None
