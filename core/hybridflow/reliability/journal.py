"""The call journal: every worker call of an iteration with its result, which pool produced it and whether the
method is idempotent, so a retried iteration reuses the outputs that are still valid and redoes only the rest.

It also keeps the non-idempotent calls (updates) of iterations since the last checkpoint, to bring a restarted
group back to the state of the iteration start. Deciding when to retry is :mod:`hybridflow.reliability.recovery`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridflow.batch import Batch
from hybridflow.controller.handles import node_method

__all__ = ["CallEntry", "Journal", "JournaledMethod", "JournaledRole"]


@dataclass(slots=True)
class CallEntry:
    """One call as the driver saw it: ``node`` is ``role.method``; ``generation`` the producing pool's restart count."""

    node: str
    role: str
    method: str
    pool: str
    generation: int
    idempotent: bool
    attempt: int
    result: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LoggedUpdate:
    """A non-idempotent call of a committed iteration, with its inputs fetched to the driver (for replay)."""

    iteration: int
    role: str
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _materialize(value: Any) -> Any:
    """Futures are fetched (a replay after a restart cannot trust object refs of dead producers)."""
    if hasattr(value, "get") and not isinstance(value, (Batch, dict)):
        return value.get()
    return value


def _still_valid(result: Any) -> bool:
    """A future that already failed is not reusable (one still running, or done fine, is)."""
    if hasattr(result, "done") and hasattr(result, "wait") and not isinstance(result, Batch) and result.done():
        try:
            result.wait(timeout=0)
        except Exception:  # noqa: BLE001 - any failure of the producing call means: redo it
            return False
    return True


class _Resolved:
    """A reused blocking call's result handed to a driver that submitted the call: ``get()``/``wait()`` as a future."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> _Resolved:
        return self

    def get(self, timeout: float | None = None) -> Any:
        return self._value


def _as_called(result: Any, *, submit: bool, blocking: bool) -> Any:
    """A reused result in the form this call returns: the value when called, a future when submitted."""
    future = hasattr(result, "done") and hasattr(result, "get") and not isinstance(result, (Batch, dict, list))
    if submit and not future:
        return _Resolved(result)
    if not submit and future and blocking:
        return result.get()
    return result


class Journal:
    """Per iteration: ``begin_attempt`` → calls through :class:`JournaledRole` → ``commit``. Stability: developer."""

    def __init__(self, *, pool_of_role: Callable[[str], str | None]) -> None:
        self._pool_of_role = pool_of_role
        self.generation: dict[str, int] = {}
        self.iteration = -1
        self.attempt = 0
        self.entries: dict[tuple[str, str, int], CallEntry] = {}
        self.used: dict[tuple[str, str, int], CallEntry] = {}
        self.reused: list[str] = []
        self.redone: list[str] = []
        self.update_log: list[LoggedUpdate] = []
        self._counts: dict[tuple[str, str], int] = {}
        self.after_call: Callable[[CallEntry], None] | None = None

    # --- iteration lifecycle ----------------------------------------------------------------------------
    def begin_attempt(self, iteration: int) -> None:
        if iteration != self.iteration:
            self.iteration, self.attempt, self.entries = iteration, 0, {}
        else:
            self.attempt += 1
        self.used, self.reused, self.redone, self._counts = {}, [], [], {}

    def commit(self) -> list[CallEntry]:
        """The effective calls of the finished iteration; its updates join the replay log."""
        effective = list(self.used.values())
        for entry in effective:
            if not entry.idempotent:
                self.update_log.append(LoggedUpdate(
                    iteration=self.iteration, role=entry.role, method=entry.method,
                    args=tuple(_materialize(a) for a in entry.args),
                    kwargs={k: _materialize(v) for k, v in entry.kwargs.items()}))
        self.entries = {}
        return effective

    def checkpointed(self) -> None:
        """A checkpoint now holds every logged update: the log restarts empty."""
        self.update_log.clear()

    def restarted(self, pool: str) -> None:
        """``pool``'s workers are fresh processes: none of its earlier outputs or updates survive."""
        self.generation[pool] = self.generation.get(pool, 0) + 1

    def updates_for(self, pools: set[str]) -> list[LoggedUpdate]:
        return [u for u in self.update_log if self._pool_of_role(u.role) in pools]

    # --- calls ----------------------------------------------------------------------------------------------
    def call(self, role: str, method: str, bound: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             *, submit: bool = False) -> Any:
        """Run (or reuse) the call; ``submit``: dispatch it without waiting (``bound.submit``), keeping its future."""
        index = self._counts.get((role, method), 0)
        self._counts[(role, method)] = index + 1
        key = (role, method, index)
        node = f"{role}.{method}"
        pool = self._pool_of_role(role) or role
        previous = self.entries.get(key)
        if (previous is not None and previous.generation == self.generation.get(pool, 0)
                and _still_valid(previous.result)):
            self.used[key] = previous
            self.reused.append(node)
            return _as_called(previous.result, submit=submit, blocking=bool(bound.dispatch.blocking))
        if previous is not None:
            self.redone.append(node)
        entry = CallEntry(node=node, role=role, method=method, pool=pool, generation=self.generation.get(pool, 0),
                          idempotent=bool(bound.dispatch.idempotent), attempt=self.attempt, result=None,
                          args=args, kwargs=dict(kwargs))
        entry.result = bound.submit(*args, **kwargs) if submit else bound(*args, **kwargs)
        self.entries[key] = entry
        self.used[key] = entry
        if self.after_call is not None:
            self.after_call(entry)
        return entry.result

    def wrap(self, role: str, handle: Any, deadlines: dict[str, float] | None = None) -> JournaledRole | None:
        return None if handle is None else JournaledRole(self, role, handle, dict(deadlines or {}))


class JournaledRole:
    """Stands in for ``group.<role>`` in a driver: same methods, every call goes through the journal."""

    def __init__(self, journal: Journal, role: str, handle: Any, deadlines: dict[str, float]) -> None:
        self._journal, self._role, self._handle, self._deadlines = journal, role, handle, deadlines

    def __getattr__(self, name: str) -> JournaledMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return JournaledMethod(self._journal, self._role, name,
                               node_method(self._handle, self._role, name, self._deadlines))


class JournaledMethod:
    """``role.method`` through the journal: call it (as the group would), or ``submit`` it for a future."""

    def __init__(self, journal: Journal, role: str, name: str, bound: Any) -> None:
        self._journal, self._role, self.__name__, self._bound = journal, role, name, bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._journal.call(self._role, self.__name__, self._bound, args, kwargs)

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        """Dispatch without waiting, even a blocking method: returns the call's future (``.get()`` for the result)."""
        return self._journal.call(self._role, self.__name__, self._bound, args, kwargs, submit=True)
