"""``devices_per_node`` with several entries asks for that many distinct nodes: on a one-node Ray the second entry
finds no node of its own and the pool says so (``tests/e2e/test_multinode.py`` runs the two-node case for real)."""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group_table

from hybridflow.config_sections import PoolConfig
from hybridflow.controller import ResourcePool
from hybridflow.errors import PlacementError
from hybridflow.trainer.build import build_resource_pool


@pytest.mark.usefixtures("ray_session")
def test_two_node_pool_on_one_node_is_a_placement_error_naming_the_fix() -> None:
    before = len(placement_group_table())
    started = time.time()
    with pytest.raises(PlacementError) as info:  # the pool the trainer builds from resource_pools.spread
        build_resource_pool("spread", PoolConfig(devices_per_node=[1, 1], cpus_per_worker=0.25, ready_timeout_s=2.0))
    assert time.time() - started < 30
    message = str(info.value)
    assert "devices_per_node=[1, 1] names 2 nodes" in message and "ray start --address" in message, message
    assert "within 2.0s" in message, message  # the config's ready_timeout_s (60 s by default), also used on restart
    assert "alive nodes: 1" in message, message
    # nothing stays reserved: the probe placement group was removed
    states = [entry["state"] for entry in list(placement_group_table().values())[before:]]
    assert states and all(state == "REMOVED" for state in states), states


@pytest.mark.usefixtures("ray_session")
def test_one_node_pool_reports_where_its_ranks_are_reserved() -> None:
    pool = ResourcePool("single", [2], cpus_per_worker=0.25)
    try:
        assert pool.node_ids() == [ray.get_runtime_context().get_node_id()]
        assert [(slot.rank, slot.node_index, slot.local_rank) for slot in pool.slots()] == [(0, 0, 0), (1, 0, 1)]
        pool.wait_placed(timeout_s=5.0)  # already placed: returns at once
    finally:
        pool.release()
