"""The generic :class:`Registry` (names of one kind → items, with the owner who registered each) and the concrete
registries that plugin hooks and user code fill, one per kind.

The registries are process-wide by nature: plugins are discovered once per process (:mod:`hybridflow.plugins` fills
them from entry points when asked) and every trainer or worker group in the process sees the same engines,
protocols, layouts, rewards, algorithms and tools. Nothing run-specific lives here: which names a run uses is its
config's.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from hybridflow.errors import DuplicateNameError, UnknownNameError

__all__ = [
    "Registry",
    "RegistryEntry",
    "training_engines",
    "rollout_engines",
    "transfer_protocols",
    "layouts",
    "cost_models",
    "rewards",
    "algorithms",
    "checkpoint_exporters",
    "tools",
    "verdict_parsers",
    "ALL",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RegistryEntry(Generic[T]):
    name: str
    item: T
    owner: str
    #: what the item declares about itself at registration (engines: hybridflow.engines' info records), or None
    info: object | None = None


class Registry(Generic[T]):
    """Names of one kind (``kind`` reads like "rollout engine") mapped to items and the owner who registered them."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, RegistryEntry[T]] = {}
        self._lock = threading.Lock()

    def register(self, name: str, item: T, *, owner: str = "user code", replace: bool = False,
                 info: object | None = None) -> T:
        """Add ``item`` under ``name`` (with its declared ``info`` record, where its kind has one); a duplicate
        raises naming both owners unless ``replace=True``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        with self._lock:
            existing = self._entries.get(name)
            if existing is not None and not replace:
                raise DuplicateNameError(
                    f'{self.kind.capitalize()} "{name}" registered twice: by {existing.owner} and {owner}. '
                    f"Disable one plugin (HYBRIDFLOW_DISABLE_PLUGINS=...) or rename one {self.kind}."
                )
            self._entries[name] = RegistryEntry(name=name, item=item, owner=owner, info=info)
        return item

    def unregister(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)

    def get(self, name: str) -> T:
        """Return the item registered under ``name``; unknown names raise listing the known ones."""
        entry = self._entries.get(name)
        if entry is None:
            raise UnknownNameError(self._unknown_message(name))
        return entry.item

    def entry(self, name: str) -> RegistryEntry[T]:
        self.get(name)
        return self._entries[name]

    def owner(self, name: str) -> str:
        return self.entry(name).owner

    def names(self) -> list[str]:
        return sorted(self._entries)

    def by_owner(self, owner: str) -> list[str]:
        return sorted(n for n, e in self._entries.items() if e.owner == owner)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def _unknown_message(self, name: str) -> str:
        known = self.names()
        message = f'Unknown {self.kind} "{name}". Known: {", ".join(known) if known else "(none registered)"}.'
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        if close:
            message += f' Did you mean "{close[0]}"?'
        elif not known:
            message += " Install a plugin that provides one (see `hybridflow plugins`)."
        return message

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


training_engines: Registry[Any] = Registry("training engine")
rollout_engines: Registry[Any] = Registry("rollout engine")
transfer_protocols: Registry[Any] = Registry("transfer protocol")
layouts: Registry[Any] = Registry("layout")
cost_models: Registry[Any] = Registry("cost model")
rewards: Registry[Any] = Registry("reward function")
algorithms: Registry[Any] = Registry("algorithm")
checkpoint_exporters: Registry[Any] = Registry("checkpoint exporter")
tools: Registry[Any] = Registry("tool")
verdict_parsers: Registry[Any] = Registry("verdict parser")

#: hook name → registry it fills
ALL: dict[str, Registry[Any]] = {
    "hybridflow_register_training_engines": training_engines,
    "hybridflow_register_rollout_engines": rollout_engines,
    "hybridflow_register_transfer_protocols": transfer_protocols,
    "hybridflow_register_layouts": layouts,
    "hybridflow_register_cost_models": cost_models,
    "hybridflow_register_rewards": rewards,
    "hybridflow_register_algorithms": algorithms,
    "hybridflow_register_checkpoint_exporters": checkpoint_exporters,
    "hybridflow_register_tools": tools,
    "hybridflow_register_verdict_parsers": verdict_parsers,
}
