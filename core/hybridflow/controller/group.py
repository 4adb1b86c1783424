"""``WorkerGroup``: one Ray actor per pool slot hosting every colocated role, and typed calls into them.

A call runs the method's transfer protocol in the driver, stores only what each rank needs, and returns the
collected value or a ``BatchFuture``; what the roles compute, and when to restart after a failure, is the caller's.
The ``group.<role>.<method>`` handles live in :mod:`hybridflow.controller.handles` (re-exported here).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import ray
from ray.exceptions import GetTimeoutError, RayError

from hybridflow.batch import Batch, check_versions
from hybridflow.controller import park
from hybridflow.controller.decorator import Dispatch, dispatch_of
from hybridflow.controller.future import FAILURE_GRACE_S, BatchFuture, CallHandle
from hybridflow.controller.handles import BoundMethod, RoleHandle, check_protocol_overrides, registered_methods
from hybridflow.controller.host import RankPayload, WorkerHost
from hybridflow.controller.pool import ResourcePool
from hybridflow.controller.records import CallObserver
from hybridflow.controller.runtime import is_local_ray
from hybridflow.controller.staging import settle_argument, stage_argument
from hybridflow.controller.watchdog import raise_deadline_exceeded
from hybridflow.engines import MeshInfo
from hybridflow.errors import ConfigError, WorkerError
from hybridflow.transfer import get_protocol
from hybridflow.transfer.protocol import TransferContext

if TYPE_CHECKING:
    from ray.actor import ActorClass

__all__ = ["WorkerGroup", "RoleHandle", "BoundMethod"]

_group_ids = itertools.count()
_LOG = logging.getLogger(__name__)
#: how long :meth:`WorkerGroup.close` waits for its hosts to park before it kills them
PARK_TIMEOUT_S = 30.0


class WorkerGroup:
    """SPMD ranks of one or more colocated roles on a :class:`ResourcePool`. Stability: public.

    Args:
        pool: where the ranks run (one actor per slot; groups on the same pool share its slots).
        workers: a worker class, or ``{role: class}`` for roles colocated in one process per slot.
        init_kwargs: keyword arguments of each role's constructor, ``{role: {...}}`` (or ``{...}`` for one class).
        name: shown in errors and call records.
        deadline_s: default deadline of every call (``@register(deadline_s=...)`` and ``with_deadline`` override).
        observers: called with a :class:`CallRecord` when each call's result is collected. The group keeps this very
            list (not a copy): its owner adds and removes observers later, and a trainer shares one list among its
            groups. Only these observers hear the group's calls; there is no process-wide list.
        stack_dump_dir: where the watchdog writes stuck workers' stacks (also in the error message).
        protocols: ``{role: {method: protocol name}}`` replacing the protocol a method declares with ``@register``
            (its other dispatch settings stay); the trainer fills it from ``<role section>.protocols`` in the config.
    """

    def __init__(
        self,
        pool: ResourcePool,
        workers: type | Mapping[str, type],
        *,
        init_kwargs: Mapping[str, Any] | None = None,
        name: str | None = None,
        deadline_s: float = 600.0,
        setup_deadline_s: float | None = None,
        observers: list[CallObserver] | None = None,
        stack_dump_dir: str | None = None,
        protocols: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        if isinstance(workers, type):
            roles: dict[str, type] = {"worker": workers}
            kwargs = {"worker": dict(init_kwargs or {})}
        else:
            roles = dict(workers)
            kwargs = {role: dict(value) for role, value in (init_kwargs or {}).items()}
            unknown = sorted(set(kwargs) - set(roles))
            if unknown:
                raise ConfigError(f"init_kwargs names roles {unknown} that are not in workers {sorted(roles)}")
        for role, cls in roles.items():
            if not role.isidentifier() or hasattr(WorkerGroup, role):
                raise ConfigError(f"role name {role!r} must be an identifier not shadowing a WorkerGroup attribute")
            if not isinstance(cls, type):
                raise ConfigError(f'role "{role}" must be a class, got {type(cls).__name__}')
            for method in registered_methods(cls):
                dispatch = dispatch_of(getattr(cls, method))
                if dispatch is not None:  # always: registered_methods lists the registered methods
                    get_protocol(dispatch.protocol)  # unknown protocol fails here, listing known
        if deadline_s <= 0:
            raise ConfigError(f"deadline_s must be positive seconds, got {deadline_s}")
        self._overrides = check_protocol_overrides(roles, protocols or {})
        self.pool = pool
        self.name = name or f"group{next(_group_ids)}"
        self.roles = roles
        self.init_kwargs = kwargs
        self.deadline_s = float(deadline_s)
        self.setup_deadline_s = float(setup_deadline_s or deadline_s)
        self.observers: list[CallObserver] = [] if observers is None else observers
        self.stack_dump_dir = stack_dump_dir
        self._hosts: list[Any] = []
        self._pids: dict[int, int] = {}
        self._nodes: dict[int, str] = {}
        self._rendezvous: tuple[str, int, bool] | None = None  # (MASTER_ADDR, MASTER_PORT, local Ray?)
        self._ahead: dict[tuple[str, str], tuple[tuple[Any, ...], BatchFuture]] = {}
        #: called with (role, method) after a call of a blocking method is dispatched (also by ``submit``), before
        #: the driver waits for it
        self.before_block: Callable[[str, str], None] | None = None
        self._mesh: dict[str, list[MeshInfo]] = {}
        self._failed = False  # a call failed or a rank was killed since the start: close() does not park
        self._ranks_lost = False  # ... and a rank died, hung or was left running: restart() starts fresh processes
        #: why the last :meth:`close` did not park the processes (empty when it did or has not run)
        self.park_refusal = ""
        self._start()

    # --- lifecycle ------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pool.world_size

    def _start(self) -> None:
        self.pool.wait_placed()  # after a node died: its bundles re-reserved elsewhere, or PlacementError saying so
        slots = self.pool.slots()
        self._failed = self._ranks_lost = False
        self._hosts = self._parked_hosts(slots)
        if not self._hosts:
            actor_class = cast("ActorClass[WorkerHost]", WorkerHost)  # @ray.remote made it one; mypy keeps the class
            self._hosts = [actor_class.options(**slot.options).remote(self.name, slot.rank, len(slots),
                                                                      slot.local_rank) for slot in slots]
        self._mesh = {}
        started = time.time()
        hosts = dict(enumerate(self._hosts))
        try:
            local = is_local_ray()  # joined cluster: rank 0's node IP, reachable from the other nodes
            master_addr, master_port = ray.get(self._hosts[0].reserve_master_address.remote(local),
                                               timeout=self.setup_deadline_s)
            self._rendezvous = (str(master_addr), int(master_port), local)
            setups = {rank: host.setup.remote(master_addr, master_port, self.roles, self.init_kwargs)
                      for rank, host in hosts.items()}
            reports = self._wait_for_setups(setups, until=started + self.setup_deadline_s)
        except (GetTimeoutError, RayError) as exc:
            self.shutdown()
            raise WorkerError(f"{self.name}: worker processes failed to start ({type(exc).__name__}: {exc}). Fix: "
                              f"check that the worker classes import in a fresh process", method="setup") from exc
        failures = {rank: report for rank, report in reports.items() if report[0]}
        stuck = [rank for rank in setups if rank not in reports]
        if failures:  # reported before the deadline: the ranks still constructing may be waiting on the failed one
            self.shutdown()
            rank = min(failures)
            error, remote = failures[rank]
            waiting = (f" (ranks {stuck} had not finished theirs, e.g. waiting for rank {rank} in the rendezvous)"
                       if stuck else "")
            raise WorkerError(f"{self.name}: constructing the roles failed on rank {rank}: {error}{waiting}. Fix the "
                              f"worker constructor; the remote traceback follows.\n{remote}", rank=rank,
                              method="__init__", remote_traceback=remote)
        if stuck:
            try:
                raise_deadline_exceeded(node=self.name, method="__init__", stuck_ranks=stuck,
                                        deadline_s=self.setup_deadline_s, hosts=hosts, pids={},
                                        stack_dump_dir=self.stack_dump_dir)
            finally:
                self.shutdown()
        locations = ray.get([host.process_location.remote() for host in self._hosts], timeout=30.0)
        self._pids = {rank: pid for rank, (pid, _node) in zip(hosts, locations)}
        self._nodes = {rank: node for rank, (_pid, node) in zip(hosts, locations)}
        # every role's mesh now, while the ranks are idle: asked at the first call instead, the question would queue
        # behind calls already running there and hold up the driver dispatching calls to other pools meanwhile
        meshes = {role: [host.mesh_info.remote(role) for host in self._hosts] for role in self.roles}
        for role, refs in meshes.items():
            with contextlib.suppress(RayError):  # asked again (and its error raised) when a call needs it
                self._mesh[role] = list(ray.get(refs, timeout=self.setup_deadline_s))

    def _parked_hosts(self, slots: list[Any]) -> list[Any]:
        """A closed group's parked hosts on this pool, rebound to this group's slots (rank for rank, the same
        bundles); [] when none is parked or one fails to rebind (all of them are then killed)."""
        hosts = self.pool.take_hosts()
        if hosts is None:
            return []
        try:
            ray.get([host.rebind.remote(self.name, slot.rank, len(slots), slot.local_rank)
                     for host, slot in zip(hosts, slots)], timeout=min(60.0, self.setup_deadline_s))
        except (GetTimeoutError, RayError):
            for host in hosts:
                with contextlib.suppress(RayError):
                    ray.kill(host, no_restart=True)
            return []
        return list(hosts)

    @staticmethod
    def _wait_for_setups(setups: dict[int, Any], *, until: float) -> dict[int, tuple[str, str]]:
        """Wait for the ranks' ``setup`` reports until ``until``, or until one reports a failure (then a short grace
        for the others): a rank that failed, e.g. rank 0 before starting its rendezvous store, leaves its peers
        waiting on it until the deadline, and its own error is the one to report.

        Returns every rank whose report is in, mapped to ``("", "")`` if it succeeded, else (error, traceback);
        the ranks missing from it had not finished by then."""
        reports: dict[int, tuple[str, str]] = {}
        rank_of = {ref: rank for rank, ref in setups.items()}
        pending = list(setups.values())
        limit = until
        while pending and time.time() < limit:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, min(1.0, limit - time.time())))
            for ref in done:
                try:
                    result = ray.get(ref, timeout=10.0)
                    report = ("", "") if result.ok else (str(result.error), str(result.remote_traceback))
                except RayError as exc:
                    report = (f"worker process died: {exc}", "")
                reports[rank_of[ref]] = report
                if report[0] and limit == until:
                    limit = min(until, time.time() + FAILURE_GRACE_S)
        return reports

    def shutdown(self) -> None:
        """Kill every worker of this group (the pool stays reserved for other or recreated groups)."""
        self._ahead.clear()
        for host in self._hosts:
            with contextlib.suppress(RayError):
                ray.kill(host, no_restart=True)
        self._hosts = []

    def close(self) -> bool:
        """End this group, parking its worker processes in its pool for the next group of the same shape
        (hybridflow.controller.park) when every call succeeded and every host parks (closes its roles and restores
        its process within :data:`PARK_TIMEOUT_S`); otherwise as :meth:`shutdown`. Returns whether it parked."""
        hosts, self._hosts = self._hosts, []
        self._ahead.clear()
        if not hosts:
            return False
        refused: list[str] = []
        if self._failed:
            refused.append("a call failed or a rank was killed")
        elif not park.enabled():
            refused.append(f"{park.ENV}=0")
        else:
            refused = self._park_each(hosts)
        if refused:
            self.park_refusal = "; ".join(refused)
            _LOG.debug("%s: worker processes not parked: %s", self.name, self.park_refusal)
            self._hosts = hosts
            self.shutdown()
            return False
        self.park_refusal = ""
        self.pool.park_hosts(hosts)
        return True

    @staticmethod
    def _park_each(hosts: list[Any]) -> list[str]:
        """Ask every host to park (:meth:`WorkerHost.park`); why those that did not, did not ([]: all parked).
        The request queues behind any call still running there: a rank stuck in one is not waited for past
        :data:`PARK_TIMEOUT_S`."""
        try:
            reports = ray.get([host.park.remote() for host in hosts], timeout=PARK_TIMEOUT_S)
        except (GetTimeoutError, RayError) as exc:
            return [f"parking failed or took over {PARK_TIMEOUT_S:.0f} s ({type(exc).__name__})"]
        return [f"rank {rank}: {why}" for rank, (ok, why) in enumerate(reports) if not ok]

    def _call_failed(self, idle: bool) -> None:
        """A call of this group failed: its processes are not parked for another group (their roles' state is
        unknown); ``idle``: every rank reported and lives, so :meth:`restart` may rebuild the roles in them."""
        self._failed = True
        self._ranks_lost = self._ranks_lost or not idle

    def restart(self) -> None:
        """Recreate every rank's roles with the same classes and constructor arguments. When every failure since
        the start was a raised error with every rank alive and idle (none died, hung or was left running), the roles
        are rebuilt in the same processes, each parked first (closed, dropped, the process restored as a fresh one:
        :meth:`WorkerHost.park`); otherwise, or when a host does not park, in fresh processes."""
        hosts = self._hosts
        if hosts and not self._ranks_lost and park.enabled():
            self.park_refusal = "; ".join(self._park_each(hosts))
            if not self.park_refusal:
                self._ahead.clear()
                self._hosts = []
                self.pool.park_hosts(hosts)  # on top: the next start takes these very hosts
                self._start()
                return
        self.shutdown()
        self._start()

    def kill_rank(self, rank: int) -> None:
        """Kill one rank's process (fault injection); later calls touching it raise WorkerError."""
        self._failed = self._ranks_lost = True
        ray.kill(self._hosts[rank], no_restart=True)

    @property
    def process_ids(self) -> dict[int, int]:
        return dict(self._pids)

    @property
    def node_ids(self) -> dict[int, str]:
        """Rank → the Ray node id its worker process reported from inside (``get_runtime_context().get_node_id()``)."""
        return dict(self._nodes)

    def placement(self) -> dict[str, Any]:
        """Where the ranks run (the manifest's ``placement`` section): ``{"rendezvous": "MASTER_ADDR:PORT",
        "local_ray": bool, "ranks": [{"rank", "node_index", "local_rank", "node_id", "pid"}]}``; ``node_index`` is
        the rank's ``devices_per_node`` entry, ``node_id`` the Ray node its process reported from inside."""
        addr, port, local = self._rendezvous or ("", 0, False)
        return {"rendezvous": f"{addr}:{port}" if addr else None, "local_ray": local,
                "ranks": [{"rank": slot.rank, "node_index": slot.node_index, "local_rank": slot.local_rank,
                           "node_id": self._nodes.get(slot.rank), "pid": self._pids.get(slot.rank)}
                          for slot in self.pool.slots()]}

    def local_process_ids(self) -> dict[int, int] | None:
        """Rank → pid when every rank runs on the driver's Ray node (their /proc is readable here), else None."""
        here = ray.get_runtime_context().get_node_id()
        if not self._pids or any(self._nodes.get(rank) != here for rank in self._pids):
            return None
        return dict(self._pids)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- calls ----------------------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        roles = self.__dict__.get("roles")
        if roles is None or name.startswith("_"):
            raise AttributeError(name)
        if name in roles:
            return RoleHandle(self, name, roles[name])
        if len(roles) == 1:
            role = next(iter(roles))
            return getattr(RoleHandle(self, role, roles[role]), name)
        raise AttributeError(f'WorkerGroup "{self.name}" has no role "{name}"; roles: {sorted(roles)}')

    def dispatch_for(self, role: str, method: str) -> Dispatch | None:
        """The dispatch ``role.method`` runs with: its ``@register`` declaration with any protocol override applied."""
        override = self._overrides.get((role, method))
        if override is not None:
            return override
        return dispatch_of(getattr(self.roles[role], method, None))

    def protocols(self) -> dict[str, str]:
        """``"role.method"`` → the protocol each registered method of this group runs with (overrides applied)."""
        out = {}
        for role, cls in self.roles.items():
            for method in registered_methods(cls):
                dispatch = self.dispatch_for(role, method)
                assert dispatch is not None  # registered methods have one
                out[f"{role}.{method}"] = dispatch.protocol
        return out

    def role(self, name: str) -> RoleHandle:
        if name not in self.roles:
            raise ConfigError(f'WorkerGroup "{self.name}" has no role "{name}"; expected one of {sorted(self.roles)}')
        return RoleHandle(self, name, self.roles[name])

    def call(self, method: Callable[..., Any], *args: Any, role: str | None = None, deadline_s: float | None = None,
             **kwargs: Any) -> Any:
        """Typed call: ``group.call(ActorWorker.generate, batch)``; ``role`` is needed only if ambiguous."""
        dispatch = dispatch_of(method)
        name = getattr(method, "__name__", "")
        if dispatch is None:
            raise ConfigError(f"{getattr(method, '__qualname__', method)} is not declared with @register; expected a "
                              f"registered worker method. Fix: decorate it with @register(protocol=...)")
        matches = [r for r, cls in self.roles.items() if getattr(getattr(cls, name, None), "__func__",
                                                                  getattr(cls, name, None)) is method]
        if role is None:
            if len(matches) != 1:
                raise ConfigError(f"{method.__qualname__} belongs to roles {matches} of group {self.name}; expected "
                                  f"exactly one. Fix: pass role=...")
            role = matches[0]
        elif role not in self.roles:
            raise ConfigError(f'WorkerGroup "{self.name}" has no role "{role}"; expected one of {sorted(self.roles)}')
        dispatch = self._overrides.get((role, name), dispatch)
        return self._invoke(role, name, dispatch, args, kwargs, deadline_s=deadline_s)

    def engine_options(self) -> dict[str, dict[str, Any]]:
        """Rank 0's :meth:`WorkerHost.engine_options` of every role (the manifest's ``engine_options``)."""
        refs = {role: self._hosts[0].engine_options.remote(role) for role in self.roles}
        return {role: dict(ray.get(ref, timeout=self.deadline_s)) for role, ref in refs.items()}

    def mesh(self, role: str) -> list[MeshInfo]:
        """Each rank's :class:`MeshInfo` for ``role`` (asked once from the workers, then cached)."""
        if role not in self._mesh:
            refs = [host.mesh_info.remote(role) for host in self._hosts]
            self._mesh[role] = list(ray.get(refs, timeout=self.deadline_s))
        return self._mesh[role]

    # --- calls submitted ahead -------------------------------------------------------------------------------
    def submit_ahead(self, role: str, method: str, *args: Any, deadline_s: float | None = None) -> None:
        """Dispatch ``role.method(*args)`` now, non-blocking, and keep its future for the first later call of that
        method with the very same argument objects (and no keyword arguments), which then gets it instead of
        dispatching again. The ranks run calls in the order they were dispatched, so a call submitted while
        another is running starts the moment that one ends, with no driver round trip in between. ``deadline_s``
        (else the method's or the group's) counts from now: the time queued behind the running call included."""
        dispatch = self.dispatch_for(role, method)
        if dispatch is None:
            raise ConfigError(f'"{role}.{method}" is not a registered method of group "{self.name}"')
        future = self._invoke(role, method, replace(dispatch, blocking=False), args, {}, deadline_s=deadline_s)
        self._ahead[(role, method)] = (args, future)

    def drop_ahead(self) -> int:
        """Forget calls submitted ahead that no one claimed (they still run); returns how many there were."""
        dropped = len(self._ahead)
        self._ahead.clear()
        return dropped

    def _claim_ahead(self, role: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ahead = self._ahead.get((role, method))
        if ahead is None or kwargs or len(ahead[0]) != len(args) or any(a is not b for a, b in zip(ahead[0], args)):
            return None
        del self._ahead[(role, method)]
        return ahead[1]

    def _invoke(self, role: str, method: str, dispatch: Dispatch, args: tuple[Any, ...], kwargs: dict[str, Any],
                *, deadline_s: float | None, wait: bool = True) -> Any:
        """Dispatch one call; a blocking method's result is waited for unless ``wait=False`` (then its future)."""
        claimed = self._claim_ahead(role, method, args, kwargs) if self._ahead else None
        if claimed is not None:
            return claimed.get() if dispatch.blocking and wait else claimed
        if not self._hosts:
            raise ConfigError(f'WorkerGroup "{self.name}" is shut down; expected a running group. Fix: restart()')
        protocol = get_protocol(dispatch.protocol)
        context = TransferContext(world_size=self.world_size, role=role, method=method,
                                  mesh_provider=lambda: self.mesh(role))
        args = tuple(settle_argument(value) for value in args)
        kwargs = {key: settle_argument(value) for key, value in kwargs.items()}
        metas = [value.meta for value in [*args, *kwargs.values()] if isinstance(value, (Batch, BatchFuture))]
        check_versions(metas, what=f"inputs of {self.name}.{role}.{method}")
        inputs = protocol.distribute(args, kwargs, context)
        if len(inputs) != self.world_size:
            raise ConfigError(f"protocol {dispatch.protocol} returned {len(inputs)} rank inputs for {self.name}.{role}."
                              f"{method}; expected {self.world_size} (one per rank, None for idle ranks)")
        if dispatch.execute == "rank_zero":
            inputs = [inputs[0]] + [None] * (self.world_size - 1)
        collect_ranks = [0] if dispatch.execute == "rank_zero" else list(protocol.collect_ranks(context))
        idle = [rank for rank in collect_ranks if inputs[rank] is None]
        if idle:
            raise ConfigError(f"protocol {dispatch.protocol} collects ranks {idle} of {self.name}.{role}.{method} "
                              f"that it gave no input; expected collect ranks to run")
        limit = float(deadline_s or dispatch.deadline_s or self.deadline_s)
        started = time.time()
        puts: dict[int, tuple[Any, Any]] = {}
        slices: dict[tuple[Any, int, int], Any] = {}
        data_refs, info_refs = {}, {}
        for rank, rank_input in enumerate(inputs):
            if rank_input is None:
                continue
            payload = RankPayload(
                args=tuple(stage_argument(value, puts, slices) for value in rank_input.args),
                kwargs={key: stage_argument(value, puts, slices) for key, value in rank_input.kwargs.items()},
                padding_rows=rank_input.padding_rows, deadline_at=started + limit,
            )
            data_refs[rank], info_refs[rank] = self._hosts[rank].execute.remote(role, method, payload)
        handle = CallHandle(
            group=self.name, role=role, method=method, protocol_name=dispatch.protocol, protocol=protocol,
            context=context, hosts=dict(enumerate(self._hosts)), pids=dict(self._pids), data_refs=data_refs,
            info_refs=info_refs, collect_ranks=collect_ranks, started_at=started, deadline_s=limit,
            world_size=self.world_size, stack_dump_dir=self.stack_dump_dir, observers=self.observers,
            rank_zero_only=dispatch.execute == "rank_zero", on_failure=self._call_failed,
        )
        future = BatchFuture(handle)
        if dispatch.blocking and self.before_block is not None:
            self.before_block(role, method)  # e.g. the trainer submitting the next iteration's first call ahead
        return future.get() if dispatch.blocking and wait else future

    def __repr__(self) -> str:
        return (f"WorkerGroup({self.name!r}, roles={sorted(self.roles)}, pool={self.pool.name!r}, "
                f"alive={bool(self._hosts)})")
