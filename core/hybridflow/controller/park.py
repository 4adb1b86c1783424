"""Parked worker processes: a finished run's worker hosts, kept alive for the next run in this driver.

Starting a worker process costs seconds of imports (Ray's core worker, torch, transformers) before a role is built;
a driver that runs one trainer after another (a notebook, a sweep, a test suite) paid it for every rank of every
run. A group that closes cleanly instead parks its hosts (:meth:`WorkerGroup.close`): each host closes and drops
its roles and puts its process back as a fresh one (hybridflow.controller.process_state); the group leaves the hosts
in its pool, and the pool's release hands its placement groups and hosts here (:func:`park_pool`) instead of
removing them. The next :class:`ResourcePool` of the same shape (slots per node, device, CPUs per slot, colocation)
adopts them (:func:`take_pool`) and its groups start on the parked hosts, rank for rank on the same bundles, with no
new process. A pool of another shape leaves the parked pools parked while the cluster (one node) has room for it
beside them, so a driver that alternates shapes (a two-rank run, a one-rank run, a two-rank run) reuses both;
otherwise it releases them, oldest first, until it fits (on a cluster of several nodes: all of them), and a pool
whose bundles still cannot be reserved releases the rest before it waits again (:func:`make_room`), so parked
processes never hold resources a new pool needs. At most :data:`MAX_PARKED` pools stay parked (each holds its
processes' memory, and an idle Ray worker uses ~0.6 CPU-seconds a minute): parking one more releases the oldest,
and a pool parked over :data:`MAX_PARKED_S` is released at the next park or take.

Never parked: a group one of whose calls failed or whose rank was killed, a host whose roles or engines do not
declare ``reusable_process`` (hybridflow.engines), and any host that fails to park or rebind (it is killed and a
fresh process takes its slot). ``HYBRIDFLOW_REUSE_WORKERS=0`` turns parking off: every group kills its processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, remove_placement_group

__all__ = ["MAX_PARKED", "MAX_PARKED_S", "ParkedPool", "enabled", "forget_parked", "make_room", "park_pool",
           "parked_pools", "parked_resources", "release_parked", "take_pool"]

_LOG = logging.getLogger(__name__)

#: the environment variable that turns parking off (``0``)
ENV = "HYBRIDFLOW_REUSE_WORKERS"
#: the most released pools kept parked at once
MAX_PARKED = 3
#: a pool parked longer is released at the next park or take: an idle worker process costs ~0.6 CPU-seconds a minute,
#: a fresh one ~8, so one not reused within minutes costs more than it saves
MAX_PARKED_S = 300.0


@dataclass(slots=True)
class ParkedPool:
    """A released pool's placement groups and the parked hosts on them (one list of per-rank handles per group)."""

    key: tuple[Any, ...]
    placement_groups: list[PlacementGroup]
    host_sets: list[list[Any]]
    session: str
    #: what its placement groups reserve, e.g. ``{"CPU": 1.0}``
    resources: dict[str, float]
    #: when it was parked (time.monotonic())
    parked_at: float = field(default_factory=time.monotonic)


_PARKED: list[ParkedPool] = []


def enabled() -> bool:
    """Parking is on unless ``HYBRIDFLOW_REUSE_WORKERS=0``."""
    return os.environ.get(ENV, "1") != "0"


def session() -> str:
    """The Ray cluster this driver is connected to now (a parked pool of another one is gone with it)."""
    context = ray.get_runtime_context()
    return f"{context.get_node_id()}/{context.get_job_id()}"


def parked_pools() -> int:
    """How many released pools are parked (for tests and the run summary)."""
    return len(_PARKED)


def parked_resources() -> dict[str, float]:
    """What the parked pools of this Ray session reserve, e.g. ``{"CPU": 1.0}`` (free for any pool: a pool of
    another shape releases them)."""
    if not _PARKED or not ray.is_initialized():
        return {}
    here = session()
    total: dict[str, float] = {}
    for parked in _PARKED:
        if parked.session == here:
            for name, amount in parked.resources.items():
                total[name] = total.get(name, 0.0) + amount
    return total


def park_pool(parked: ParkedPool) -> None:
    """Keep a released pool's placement groups and hosts for :func:`take_pool` (the oldest parked pool is released
    when more than :data:`MAX_PARKED` would be parked)."""
    _release_expired()
    _PARKED.append(parked)
    while len(_PARKED) > MAX_PARKED:
        oldest = _PARKED.pop(0)
        if oldest.session == parked.session:
            _release(oldest)


def _release_expired() -> None:
    """Release the parked pools of this session parked for over :data:`MAX_PARKED_S`."""
    if not _PARKED or not ray.is_initialized():
        return
    here, now = session(), time.monotonic()
    for parked in [parked for parked in _PARKED if now - parked.parked_at > MAX_PARKED_S]:
        _PARKED.remove(parked)
        if parked.session == here:
            _release(parked)


def take_pool(key: tuple[Any, ...], need: dict[str, float] | None = None) -> ParkedPool | None:
    """The parked pool of shape ``key`` (removed from the park), or None. On a miss, parked pools of this Ray
    session are released, oldest first, until the cluster has ``need`` free (what the new pool reserves); all of
    them when ``need`` is None or the cluster has several nodes (where a total says nothing of one node's room)."""
    if not _PARKED:
        return None
    here = session()
    stale = [parked for parked in _PARKED if parked.session != here]
    for parked in stale:  # its cluster is gone (ray.shutdown): the handles point nowhere
        _PARKED.remove(parked)
    _release_expired()
    for parked in _PARKED:
        if parked.key == key:
            _PARKED.remove(parked)
            return parked
    if need is not None and _one_node():
        # a released pool's bundles show as free with a lag: what is released here is counted as freed at once
        available = dict(ray.available_resources())  # type: ignore[no-untyped-call]  # unannotated in ray
        while _PARKED and not all(available.get(name, 0.0) >= amount - 1e-9 for name, amount in need.items()):
            oldest = _PARKED.pop(0)
            _release(oldest)
            for name, amount in oldest.resources.items():
                available[name] = available.get(name, 0.0) + amount
        return None
    release_parked()
    return None


def _release(parked: ParkedPool) -> None:
    for hosts in parked.host_sets:
        for host in hosts:
            with contextlib.suppress(RayError):
                ray.kill(host, no_restart=True)
    for group in parked.placement_groups:
        with contextlib.suppress(Exception):  # already removed, or its cluster is going
            remove_placement_group(group)


def _one_node() -> bool:
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]  # unannotated in ray
    return sum(1 for node in nodes if node.get("Alive")) == 1


def make_room() -> bool:
    """Release every parked pool of this session (a new pool's bundles could not be reserved beside them);
    whether there were any."""
    return release_parked() > 0


def release_parked() -> int:
    """Kill every parked host and free its placement groups; returns how many pools were released."""
    count = len(_PARKED)
    here = session() if ray.is_initialized() else None
    while _PARKED:
        parked = _PARKED.pop()
        if parked.session == here:
            _release(parked)
    if count:
        _LOG.debug("released %d parked pools", count)
    return count


def forget_parked() -> None:
    """Drop the park without touching Ray (its cluster is shutting down and takes the processes with it)."""
    _PARKED.clear()
