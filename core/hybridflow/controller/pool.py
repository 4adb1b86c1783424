"""``ResourcePool``: a named set of device slots backed by one Ray placement group.

Groups built on the same pool are colocated (they share its bundles); disjoint pools give split placement.
What runs on the slots is the worker group's business.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.errors import ConfigError, PlacementError

__all__ = ["ResourcePool", "SlotOptions"]


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
        strategy = "PACK" if len(counts) == 1 else "SPREAD"
        self.placement_group: PlacementGroup = placement_group([dict(bundle) for _ in range(self.world_size)],
                                                               strategy=strategy, name=_placement_group_name(name))
        ready, _ = ray.wait([self.placement_group.ready()], timeout=ready_timeout_s)
        if not ready:
            available = ray.available_resources()  # type: ignore[no-untyped-call]  # unannotated in ray
            remove_placement_group(self.placement_group)
            raise PlacementError(
                f'ResourcePool "{name}": expected {self.world_size} bundles of {bundle} within {ready_timeout_s}s, got '
                f"none (available now: {available}). Fix: lower cpus_per_worker/world size, free other pools "
                f"(pool.release()) or start Ray with more num_cpus"
            )
        self._released = False

    @property
    def world_size(self) -> int:
        return sum(self.devices_per_node)

    def slots(self) -> list[SlotOptions]:
        """Per-rank actor options: bundle index, fractional CPU (and GPU) share, node-local rank."""
        out: list[SlotOptions] = []
        rank = 0
        for node_index, count in enumerate(self.devices_per_node):
            for local_rank in range(count):
                options: dict[str, Any] = {
                    "num_cpus": self.cpus_per_worker / self.max_colocated,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_group, placement_group_bundle_index=rank
                    ),
                }
                if self.device == "cuda":
                    options["num_gpus"] = 1.0 / self.max_colocated
                out.append(SlotOptions(rank=rank, local_rank=local_rank, node_index=node_index, options=options))
                rank += 1
        return out

    def release(self) -> None:
        """Free the placement group (kill the groups on it first)."""
        if not self._released:
            self._released = True
            remove_placement_group(self.placement_group)

    def __repr__(self) -> str:
        return f"ResourcePool({self.name!r}, devices_per_node={list(self.devices_per_node)}, device={self.device!r})"


def _placement_group_name(pool: str) -> str:
    """A Ray placement-group name for ``pool``, unique in the session (Ray's named groups are session-wide)."""
    return f"hybridflow-{pool}-{uuid.uuid4().hex[:8]}"
