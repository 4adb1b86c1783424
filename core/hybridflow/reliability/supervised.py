"""What the :class:`~hybridflow.reliability.recovery.Supervisor` needs from the run it supervises, as Protocols.

The trainer implements them; this package never imports the trainer, so the dependency points one way (trainer →
reliability). Stability: developer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Supervised", "SupervisedGroups", "RestartableGroup"]


class RestartableGroup(Protocol):
    """One worker group as recovery sees it (a :class:`~hybridflow.controller.WorkerGroup` is one)."""

    @property
    def name(self) -> str: ...

    def restart(self) -> None:
        """Kill and recreate every worker (fresh processes, same classes and constructor arguments)."""

    def kill_rank(self, rank: int) -> None:
        """Kill one rank's process (driver-side fault points)."""

    def placement(self) -> dict[str, Any]:
        """Where the ranks run now: rendezvous and, per rank, its node (recorded with each recovery)."""


class SupervisedGroups(Protocol):
    """The worker groups of a run: by pool, which pool hosts each role, and each role's handle."""

    @property
    def by_pool(self) -> Mapping[str, RestartableGroup]: ...

    @property
    def role_pool(self) -> Mapping[str, str]: ...

    def role(self, name: str) -> Any:
        """The handle of role ``name`` (its registered methods by attribute), or None if it is not built."""


class Supervised(Protocol):
    """A run whose iterations and checkpoints the Supervisor retries: the trainer is one."""

    def current_step(self) -> int:
        """The iteration the next :meth:`train_step` runs (the number of iterations done)."""

    def train_step(self) -> dict[str, float]:
        """Run one iteration (a failed one raises and leaves the step counter as it was)."""

    def save_checkpoint(self) -> Path:
        """Write a checkpoint of every role and of the driver state; returns its directory."""

    def trainer_state(self) -> dict[str, Any]:
        """The driver-side state a retried iteration starts from (data loader position, algorithm state)."""

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`trainer_state` returned."""

    def abandon_iteration(self) -> None:
        """Forget the iteration in flight (the run stops; its ledger row is not written)."""

    def latest_checkpoint(self, *, verify: bool = False) -> Path | None:
        """The newest published checkpoint, or None; with ``verify``, a corrupted one raises naming the file."""

    def worker_groups(self) -> SupervisedGroups:
        """The run's worker groups (the run must be started)."""
