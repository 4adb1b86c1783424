"""``ResourcePool``: a named set of device slots backed by Ray placement groups, one per node it spans.

Groups built on the same pool are colocated (they share its bundles); disjoint pools give split placement.
``devices_per_node=[a, b]`` reserves ``a`` slots on one node and ``b`` on another: a ``STRICT_SPREAD`` probe picks
distinct nodes with room, then each entry is its own ``STRICT_PACK`` placement group aimed at its node, whose bundles
may not land on a node another entry was given (a label selector on ``ray.io/node-id``). So a multi-node pool never
collapses onto one machine and, when a node dies, Ray re-reserves its entry only on a node the other entries do not
hold (a replacement). What runs on the slots is the worker group's business.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.controller import park
from hybridflow.errors import ConfigError, PlacementError

__all__ = ["ResourcePool", "SlotOptions"]

#: how long a new pool waits for its bundles beside parked pools before it releases them (reserving free bundles
#: takes milliseconds)
PARKED_ROOM_WAIT_S = 2.0


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotOptions:
    """Ray actor options that pin one actor onto one slot of a pool."""

    rank: int
    local_rank: int
    node_index: int
    options: dict[str, Any] = field(default_factory=dict)


class ResourcePool:
    """Device slots on one or more nodes, reserved as a Ray placement group. Stability: public.

    Args:
        name: the pool's name (shown in errors; the placement group is ``hybridflow-<name>-<8 hex>``, unique per
            pool, so two runs in one Ray session may both have a pool "main").
        devices_per_node: slots per node, e.g. ``[4]`` or ``[8, 8]``; the world size is their sum.
        device: ``"cpu"`` (fractional CPUs, so a 2-core box holds 4+ workers) or ``"cuda"`` (one GPU per slot).
        cpus_per_worker: CPUs reserved per slot.
        max_colocated: how many worker groups may share each slot; each actor asks for 1/max_colocated of it.
        ready_timeout_s: how long to wait for Ray to reserve the bundles.
    """

    def __init__(
        self,
        name: str,
        devices_per_node: Sequence[int] = (1,),
        *,
        device: Literal["cpu", "cuda"] = "cpu",
        cpus_per_worker: float = 1.0,
        max_colocated: int = 4,
        ready_timeout_s: float = 60.0,
    ) -> None:
        if not ray.is_initialized():
            raise ConfigError(f'ResourcePool "{name}" needs Ray; expected init_ray() first, got no Ray. Fix: call '
                              f"hybridflow.controller.init_ray()")
        counts = [int(count) for count in devices_per_node]
        if not counts or any(count <= 0 for count in counts):
            raise ConfigError(f"devices_per_node must list positive slot counts, got {list(devices_per_node)}")
        if device not in ("cpu", "cuda"):
            raise ConfigError(f'device must be "cpu" or "cuda", got {device!r}')
        if cpus_per_worker <= 0 or max_colocated <= 0:
            raise ConfigError(
                f"cpus_per_worker and max_colocated must be positive, got {cpus_per_worker}, {max_colocated}"
            )
        self.name = name
        self.devices_per_node = tuple(counts)
        self.device = device
        self.cpus_per_worker = float(cpus_per_worker)
        self.max_colocated = int(max_colocated)
        bundle: dict[str, float] = {"CPU": self.cpus_per_worker}
        if device == "cuda":
            bundle["GPU"] = 1.0
        self.bundle = bundle
        self.ready_timeout_s = float(ready_timeout_s)
        #: one placement group per ``devices_per_node`` entry (a single one for a one-node pool)
        self.placement_groups: list[PlacementGroup] = []
        self._released = False
        #: hosts of closed groups, parked for the next group on this pool (hybridflow.controller.park)
        self._parked_hosts: list[list[Any]] = []
        need = {key: value * sum(counts) for key, value in bundle.items()} if len(counts) == 1 else None
        adopted = park.take_pool(self.shape, need) if park.enabled() else None
        if adopted is not None:  # a released pool of this shape: its bundles and its groups' parked processes
            self.placement_groups = adopted.placement_groups
            self._parked_hosts = adopted.host_sets
            return
        try:
            if len(counts) == 1:
                self.placement_groups.append(placement_group([dict(bundle) for _ in range(counts[0])], strategy="PACK",
                                                             name=_placement_group_name(name)))
                # parked pools were left beside it because the cluster's free resources said it fits; when its
                # bundles are not reserved at once they hold what it needs after all: release them
                if park.parked_pools() and not self._ready(0, PARKED_ROOM_WAIT_S):
                    park.make_room()
                self._wait_ready(0, self.ready_timeout_s)
            else:
                nodes = self._pick_nodes()
                for index, count in enumerate(counts):
                    # never on a node another entry was given (also when Ray re-reserves it after its node died)
                    others = ",".join(node for other, node in enumerate(nodes) if other != index)
                    self.placement_groups.append(placement_group(
                        [dict(bundle) for _ in range(count)], strategy="STRICT_PACK",
                        name=f"{_placement_group_name(name)}-node{index}", _soft_target_node_id=nodes[index],
                        bundle_label_selector=[{NODE_ID_LABEL_KEY: f"!in({others})"} for _ in range(count)]))
                for index in range(len(counts)):
                    self._wait_ready(index, self.ready_timeout_s)
                if len(set(self.node_ids())) != len(counts):  # another job took a picked node meanwhile
                    raise PlacementError(f'ResourcePool "{name}": its {len(counts)} node entries landed on nodes '
                                         f"{self.node_ids()}, expected distinct ones. Fix: retry, or free the nodes")
        except BaseException:
            self.release()
            raise

    def _pick_nodes(self) -> list[str]:
        """Distinct nodes with room for each entry: a ``STRICT_SPREAD`` probe of one bundle per entry (the entry's
        whole need), removed once Ray has chosen."""
        probe = placement_group([{key: value * count for key, value in self.bundle.items()}
                                 for count in self.devices_per_node], strategy="STRICT_SPREAD",
                                name=f"{_placement_group_name(self.name)}-probe")
        try:
            ready, _ = ray.wait([probe.ready()], timeout=self.ready_timeout_s)
            if not ready:
                alive = [node for node in ray.nodes() if node.get("Alive")]  # type: ignore[no-untyped-call]
                nodes = len(self.devices_per_node)
                raise PlacementError(
                    f'ResourcePool "{self.name}": devices_per_node={list(self.devices_per_node)} names {nodes} nodes, '
                    f"holding {list(self.devices_per_node)} bundles of {self.bundle} respectively; expected {nodes} "
                    f"distinct nodes with that room within {self.ready_timeout_s}s, got none (alive nodes: "
                    f"{len(alive)}). Fix: add nodes to the cluster (`ray start --address=HEAD:PORT` on each of the "
                    f"{nodes} machines), lower cpus_per_worker, or list fewer nodes"
                )
            placed = placement_group_table(probe)["bundles_to_node_id"]
            return [str(placed[index]) for index in range(len(self.devices_per_node))]
        finally:
            remove_placement_group(probe)

    @property
    def placement_group(self) -> PlacementGroup:
        """The first node's placement group (the only one of a one-node pool)."""
        return self.placement_groups[0]

    def _ready(self, index: int, timeout_s: float) -> bool:
        ready, _ = ray.wait([self.placement_groups[index].ready()], timeout=timeout_s)
        return bool(ready)

    def _wait_ready(self, index: int, timeout_s: float) -> None:
        if self._ready(index, timeout_s):
            return
        count, nodes = self.devices_per_node[index], len(self.devices_per_node)
        alive = [node for node in ray.nodes() if node.get("Alive")]  # type: ignore[no-untyped-call]
        state = placement_group_table(self.placement_groups[index]).get("state")
        lost = (f"the node holding entry {index} of devices_per_node left the cluster and its bundles could not be "
                f"reserved again: " if state == "RESCHEDULING" else "")
        available = ray.available_resources()  # type: ignore[no-untyped-call]  # unannotated in ray
        spread = "" if nodes == 1 else (
            f" on a node of its own (devices_per_node={list(self.devices_per_node)} names {nodes} nodes; entry "
            f"{index} may not share a node with the other entries, on {self.node_ids()})")
        raise PlacementError(
            f'ResourcePool "{self.name}": {lost}expected {count} bundles of {self.bundle}{spread} within '
            f"{timeout_s}s, got none (alive nodes: {len(alive)}; available now: {available}). Fix: lower "
            f"cpus_per_worker/world size, free other pools (pool.release()), start Ray with more num_cpus"
            + ("" if nodes == 1 else f", or add nodes to the cluster (`ray start --address=HEAD:PORT` on each of "
                                     f"the {nodes} machines)")
        )

    def node_ids(self) -> list[str]:
        """The Ray node id each ``devices_per_node`` entry is reserved on (of the entries placed so far)."""
        out = []
        for group in self.placement_groups:
            table = placement_group_table(group)
            ids = sorted({node for node in table.get("bundles_to_node_id", {}).values() if node})
            out.extend(ids[:1])
        return out

    def wait_placed(self, timeout_s: float | None = None) -> None:
        """Block until every node's bundles are reserved (again, after a node died and Ray re-reserves them);
        :class:`PlacementError` naming the node entry that found no node otherwise."""
        limit = self.ready_timeout_s if timeout_s is None else timeout_s
        for index in range(len(self.placement_groups)):
            self._wait_ready(index, limit)

    @property
    def world_size(self) -> int:
        return sum(self.devices_per_node)

    @property
    def shape(self) -> tuple[Any, ...]:
        """What a parked pool must match to be adopted: slots per node, device, CPUs per slot, colocation."""
        return (self.devices_per_node, self.device, self.cpus_per_worker, self.max_colocated)

    def park_hosts(self, hosts: list[Any]) -> None:
        """Keep a closed group's parked hosts (one per rank, in rank order) for the next group on this pool."""
        if len(hosts) != self.world_size:
            raise ValueError(f"expected {self.world_size} hosts (one per rank), got {len(hosts)}")
        self._parked_hosts.append(list(hosts))

    def take_hosts(self) -> list[Any] | None:
        """A parked group's hosts (one per rank, in rank order), or None when none is parked here."""
        return self._parked_hosts.pop() if self._parked_hosts else None

    def parked_host_sets(self) -> int:
        """How many closed groups' hosts are parked on this pool."""
        return len(self._parked_hosts)

    def slots(self) -> list[SlotOptions]:
        """Per-rank actor options: the node's placement group and bundle, fractional CPU (and GPU) share."""
        out: list[SlotOptions] = []
        rank = 0
        for node_index, count in enumerate(self.devices_per_node):
            for local_rank in range(count):
                options: dict[str, Any] = {
                    "num_cpus": self.cpus_per_worker / self.max_colocated,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_groups[node_index], placement_group_bundle_index=local_rank
                    ),
                }
                if self.device == "cuda":
                    options["num_gpus"] = 1.0 / self.max_colocated
                out.append(SlotOptions(rank=rank, local_rank=local_rank, node_index=node_index, options=options))
                rank += 1
        return out

    def release(self) -> None:
        """Free the placement groups (close or kill the groups on them first); a pool holding parked hosts is
        parked instead, bundles and hosts, for the next pool of its shape (hybridflow.controller.park)."""
        if not self._released:
            self._released = True
            if self._parked_hosts and park.enabled() and ray.is_initialized():
                park.park_pool(park.ParkedPool(
                    key=self.shape, placement_groups=self.placement_groups, host_sets=self._parked_hosts,
                    session=park.session(),
                    resources={name: amount * self.world_size for name, amount in self.bundle.items()}))
                self._parked_hosts = []
                return
            for group in self.placement_groups:
                remove_placement_group(group)

    def __repr__(self) -> str:
        return f"ResourcePool({self.name!r}, devices_per_node={list(self.devices_per_node)}, device={self.device!r})"


def _placement_group_name(pool: str) -> str:
    """A Ray placement-group name for ``pool``, unique in the session (Ray's named groups are session-wide)."""
    return f"hybridflow-{pool}-{uuid.uuid4().hex[:8]}"
