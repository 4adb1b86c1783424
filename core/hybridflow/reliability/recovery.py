"""The recovery policy and the supervisor that applies it: a failed iteration (a worker died, raised or hung past
its deadline) restarts the groups that failed, restores the last checkpoint into them, replays the updates since,
and retries the iteration reusing every output that stayed valid — or stops the run, per ``reliability``.

Detecting failures is the controller's (WorkerError, DeadlineExceededError, the watchdog's stack dumps); what an
iteration computes is the algorithm driver's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from hybridflow.errors import DeadlineExceededError, HybridflowError, WorkerError
from hybridflow.ledger import IterationRecord
from hybridflow.reliability.audit import uids_of, versions_of
from hybridflow.reliability.faults import FaultPlan, InjectedFault, maybe_fail
from hybridflow.reliability.journal import CallEntry, Journal
from hybridflow.reliability.supervised import RestartableGroup, Supervised, SupervisedGroups

__all__ = ["RecoveryPolicy", "RunStoppedError", "Supervisor", "attach_fault_plan", "RECOVERY_LOG"]

RECOVERY_LOG = "recovery.jsonl"


class RunStoppedError(HybridflowError):
    """The recovery policy gave up on an iteration (retries exhausted); the last checkpoint is intact."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RecoveryPolicy:
    """What to do when an iteration fails. Stability: public.

    ``max_retries`` per iteration (0: stop at the first failure); ``on_hang``/``on_worker_failure`` pick retrying
    or stopping for deadline expiries and for worker deaths/errors; ``deadlines`` overrides the deadline of single
    nodes (``{"actor.update_policy": 60}``).
    """

    max_retries: int = 2
    on_hang: Literal["retry", "stop"] = "retry"
    on_worker_failure: Literal["retry", "stop"] = "retry"
    deadlines: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, section: Any) -> RecoveryPolicy:
        if section is None:
            return cls()
        return cls(max_retries=section.max_retries, on_hang=section.on_hang,
                   on_worker_failure=section.on_worker_failure, deadlines=dict(section.deadlines))


def attach_fault_plan(plans: list[Any], plan: FaultPlan) -> list[Any]:
    """Role plans whose specs carry the fault plan to the workers (unchanged when no fault is configured)."""
    if not plan.active:
        return plans
    return [replace(p, spec=replace(p.spec, extra={**p.spec.extra, "faults": plan.to_json()})) for p in plans]


def _is_failure(exc: BaseException) -> bool:
    """Errors recovery handles: worker deaths/errors, deadlines, injected faults, Ray errors escaping a fetch. A
    worker error that would repeat on any retry (a config or plugin-contract error in a worker) is not one: it
    stops the run at once, naming itself, instead of restarting groups to meet it again."""
    if isinstance(exc, WorkerError):
        return not exc.deterministic
    if isinstance(exc, (DeadlineExceededError, InjectedFault)):
        return True
    return type(exc).__module__.startswith("ray.")


class Supervisor:
    """Runs a run's iterations and checkpoints under the recovery policy. Stability: developer.

    ``trainer`` is anything :class:`~hybridflow.reliability.supervised.Supervised` (the Trainer is); recovery logs
    go to ``run_dir/recovery.jsonl``.
    """

    def __init__(self, trainer: Supervised, *, policy: RecoveryPolicy, faults: FaultPlan, run_dir: str | Path) -> None:
        self.trainer = trainer
        self.policy = policy
        self.faults = faults
        self.journal = Journal(pool_of_role=lambda role: self._groups().role_pool.get(role))
        self.journal.after_call = self._after_call
        self.events: list[dict[str, Any]] = []
        #: groups outside the trainer's (an async run's rollout pool): pool → (group, the pools whose restart also
        #: restarts it, what to call after it restarted)
        self.stateless: dict[str, tuple[RestartableGroup, frozenset[str], Callable[[], None]]] = {}
        self._failed_groups: set[str] = set()
        self._iteration_events: list[dict[str, Any]] = []
        self.log_path = Path(run_dir) / RECOVERY_LOG

    def _groups(self) -> SupervisedGroups:
        return self.trainer.worker_groups()

    # --- hooks the trainer calls --------------------------------------------------------------------------
    def attach_group(self, pool: str, group: RestartableGroup, *, restart_with: Iterable[str] = (),
                     on_restart: Callable[[], None] = lambda: None) -> None:
        """Recover ``group`` too: a worker group outside the trainer's groups whose workers hold no trained state
        (an async run's rollout pool: weights it is sent, generations in flight). Recovery restarts it when one of
        its calls failed in the attempt, when the failure cannot be placed, or when a pool of ``restart_with``
        restarts (its ranks may be blocked in a collective with that pool's dead ones); no checkpoint is restored
        into it and nothing replayed: ``on_restart`` tells its owner, who brings it back to the current weights.
        Give the group :meth:`observe` as a call observer."""
        self.stateless[pool] = (group, frozenset(restart_with), on_restart)

    def observe(self, record: Any) -> None:
        """Call observer: remember which groups had a failed call in this attempt."""
        if not record.ok:
            self._failed_groups.add(record.group)

    def wrap_runtime(self, runtime: Any) -> Any:
        """The runtime with every role handle going through the journal."""
        self.journal.begin_attempt(self.trainer.current_step())
        deadlines = self.policy.deadlines
        runtime.roles = {role: self.journal.wrap(role, handle, deadlines) for role, handle in runtime.roles.items()}
        return runtime

    def annotate(self, record: IterationRecord, prompts: Any) -> None:
        """Add the versions each effective call ran at, the consumed uids and this iteration's recoveries."""
        effective = self.journal.commit()
        now = time.time()
        consumed: dict[str, list[str]] = {}
        for entry in effective:
            for version in versions_of(entry):
                record.add_node(entry.node, pool=entry.pool, start=now, end=now, policy_version=version)
            if not entry.idempotent:
                consumed.setdefault(entry.node, []).extend(uids_of(entry))
        record.notes.append({"prompt_uids": [str(u) for u in prompts.non_tensors.get("uid", [])],
                             "consumed_uids": consumed, "reused_nodes": list(self.journal.reused),
                             "redone_nodes": list(self.journal.redone)})
        record.notes.extend({"recovery": event} for event in self._iteration_events)
        self._iteration_events = []

    def before_publish(self, step: int) -> Any:
        """The hook CheckpointManager.save calls before its rename (the ``checkpoint.publish`` fault point)."""
        return lambda _tmp: maybe_fail("checkpoint.publish", iteration=step, plan=self.faults)

    # --- supervised operations ----------------------------------------------------------------------------
    def run_iteration(self) -> dict[str, float]:
        """``trainer.train_step()`` until it succeeds or the policy stops the run."""
        trainer = self.trainer
        iteration = trainer.current_step()
        snapshot = trainer.trainer_state()
        attempt = 0
        while True:
            self._failed_groups = set()
            started = time.time()
            try:
                metrics = trainer.train_step()
                break
            except Exception as exc:
                if not _is_failure(exc):
                    trainer.abandon_iteration()
                    raise
                attempt += 1
                self._decide(exc, attempt, what=f"iteration {iteration}")
                event = self._recover(exc, what=f"iteration {iteration}", failed_at=started)
                trainer.load_trainer_state(snapshot)
                self._iteration_events.append(event)
        self._between_nodes(iteration)
        return metrics

    def save_checkpoint(self) -> Path:
        """``trainer.save_checkpoint()`` with the same policy; on success the replay log empties."""
        attempt = 0
        while True:
            self._failed_groups = set()
            started = time.time()
            try:
                path = self.trainer.save_checkpoint()
                break
            except Exception as exc:
                if not _is_failure(exc):
                    raise
                attempt += 1
                what = f"checkpoint of step {self.trainer.current_step()}"
                self._decide(exc, attempt, what=what)
                self._recover(exc, what=what, failed_at=started)
        self.journal.checkpointed()
        return path

    # --- policy -------------------------------------------------------------------------------------------
    def _decide(self, exc: Exception, attempt: int, *, what: str) -> None:
        hang = isinstance(exc, DeadlineExceededError)
        choice = self.policy.on_hang if hang else self.policy.on_worker_failure
        if choice == "stop":
            self.trainer.abandon_iteration()
            raise exc
        if attempt > self.policy.max_retries:
            self.trainer.abandon_iteration()
            raise RunStoppedError(
                f"{what} failed {attempt} times (reliability.max_retries={self.policy.max_retries}); stopping. The "
                f"last checkpoint ({self.trainer.latest_checkpoint() or 'none yet'}) is intact: rerun with "
                f"trainer.resume=auto after fixing the cause. Last error: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc

    def _recover(self, exc: Exception, *, what: str, failed_at: float) -> dict[str, Any]:
        """Restart the failed groups, restore the latest checkpoint into them, replay the updates since."""
        detected = time.time()
        groups = self._groups()
        names = {group.name: pool for pool, group in groups.by_pool.items()}
        pools = {names[g] for g in self._failed_groups if g in names}
        stateless = {pool for pool, (group, _, _) in self.stateless.items() if group.name in self._failed_groups}
        if not pools and not stateless:  # the failure cannot be placed: every group
            pools, stateless = set(groups.by_pool), set(self.stateless)
        stateless |= {pool for pool, (_, linked, _) in self.stateless.items() if linked & pools}
        for pool in sorted(pools):
            groups.by_pool[pool].restart()
            self.journal.restarted(pool)
        for pool in sorted(stateless):
            group, _, on_restart = self.stateless[pool]
            group.restart()
            self.journal.restarted(pool)
            on_restart()
        restarted = time.time()
        latest = self.trainer.latest_checkpoint(verify=True)  # a corrupted checkpoint is refused, naming the file
        if latest is not None:
            for role, pool in groups.role_pool.items():
                if pool in pools:
                    groups.role(role).load_checkpoint(str(latest))
        replayed = self.journal.updates_for(pools)
        for update in replayed:
            getattr(groups.role(update.role), update.method)(*update.args, **update.kwargs)
        event = {
            "what": what, "error": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else "",
            "pools_restarted": sorted(pools | stateless), "checkpoint": str(latest) if latest else None,
            "updates_replayed": [f"{u.role}.{u.method}@{u.iteration}" for u in replayed],
            "iterations_replayed": len({u.iteration for u in replayed}),
            "seconds_failed_attempt": detected - failed_at, "seconds_restart": restarted - detected,
            "seconds_restore": time.time() - restarted, "seconds_lost": time.time() - failed_at,
            "faults_fired": self.faults.fired(),
            "placement": {pool: (groups.by_pool[pool] if pool in pools else self.stateless[pool][0]).placement()
                          for pool in sorted(pools | stateless)},  # ranks' nodes now
        }
        self.events.append(event)
        with self.log_path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(event) + "\n")
        return event

    # --- driver-side fault points -------------------------------------------------------------------------
    def _after_call(self, entry: CallEntry) -> None:
        if entry.node == "actor.generate" and self.faults.active:
            spec = maybe_fail("generate.before_consume", iteration=self.journal.iteration, plan=self.faults)
            if spec is not None:
                entry.result.wait()
                self._groups().by_pool[entry.pool].kill_rank(spec.rank)

    def _between_nodes(self, iteration: int) -> None:
        if not self.faults.active:
            return
        spec = maybe_fail("controller.between_nodes", iteration=iteration, plan=self.faults)
        if spec is not None:
            groups = self._groups()
            groups.by_pool[groups.role_pool["actor"]].kill_rank(spec.rank)
