"""Which worker groups recovery restarts (``hybridflow.reliability.Supervisor``): the trainer's groups whose calls
failed, and a group attached from outside (an async run's rollout pool, ``Supervisor.attach_group``) when its own
call failed, when a pool it is linked to restarts (the collective weight sync) or when the failure cannot be placed;
the attached group's owner hears of each restart. The worker groups and the run are doubles that record what
recovery did to them (real restarts: tests/core/controller/test_reliability.py; the rollout pool's through the
trainer: tests/e2e/test_async_train.py::test_killed_rollout_and_actor_workers_recover_within_the_staleness_bound)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hybridflow.errors import WorkerError
from hybridflow.reliability import FaultPlan, RecoveryPolicy, Supervisor


class RecordingGroup:
    """Double of a WorkerGroup: its restarts are appended to the shared log."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self._log = name, log

    def restart(self) -> None:
        self._log.append(self.name)

    def kill_rank(self, rank: int) -> None:
        raise AssertionError("no fault point kills a rank here")

    def placement(self) -> dict[str, Any]:
        return {"ranks": []}


class FailingRun:
    """Double of the trainer (``Supervised``): iteration 0 fails once with a failed call in ``failing`` (a group
    name, or None: an error no call record places), then succeeds."""

    def __init__(self, failing: str | None, log: list[str]) -> None:
        self.failing, self.step = failing, 0
        groups = {"main": RecordingGroup("main", log), "critic": RecordingGroup("critic", log)}
        self.groups = SimpleNamespace(by_pool=groups, role_pool={"actor": "main", "critic": "critic"},
                                      role=lambda name: None)
        self.supervisor: Supervisor | None = None

    def current_step(self) -> int:
        return self.step

    def train_step(self) -> dict[str, float]:
        if self.failing is not False:
            failing, self.failing = self.failing, False
            assert self.supervisor is not None
            if failing is not None:
                self.supervisor.observe(SimpleNamespace(ok=False, group=failing))
            raise WorkerError(f"{failing}: rank 0 died")
        self.step += 1
        return {}

    def save_checkpoint(self) -> Path:
        raise AssertionError("not checkpointed here")

    def trainer_state(self) -> dict[str, Any]:
        return {}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        pass

    def abandon_iteration(self) -> None:
        pass

    def latest_checkpoint(self, *, verify: bool = False) -> Path | None:
        return None

    def worker_groups(self) -> Any:
        return self.groups


@pytest.mark.parametrize(("failing", "linked", "restarted"), [
    ("gen", (), ["gen"]),  # the rollout pool's worker died: it alone restarts, the trainer's groups keep their state
    ("main", (), ["main"]),  # the actor's: the rollout pool is synced again by its owner, not restarted
    ("main", ("main",), ["main", "gen"]),  # linked (collective sync): its ranks may wait on the dead actor rank
    ("critic", ("main",), ["critic"]),
    (None, (), ["critic", "main", "gen"]),  # nothing places the failure: every group
])
def test_attached_group_restarts_when_its_call_failed_or_a_linked_pool_restarts(
        tmp_path: Path, failing: str | None, linked: tuple[str, ...], restarted: list[str]) -> None:
    log: list[str] = []
    run = FailingRun(failing, log)
    supervisor = Supervisor(run, policy=RecoveryPolicy(), faults=FaultPlan(), run_dir=tmp_path)
    run.supervisor = supervisor
    resets: list[int] = []
    supervisor.attach_group("gen", RecordingGroup("gen", log), restart_with=linked,
                            on_restart=lambda: resets.append(run.step))
    supervisor.run_iteration()
    assert run.step == 1 and log == restarted
    assert resets == ([0] if "gen" in restarted else [])  # the owner heard of the restart before the retry
    (event,) = supervisor.events
    assert event["pools_restarted"] == sorted(restarted) and sorted(event["placement"]) == sorted(restarted)
    assert supervisor.journal.generation == {pool: 1 for pool in restarted}
