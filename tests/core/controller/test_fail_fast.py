"""A rank that raises ends its call at once, even while its peers wait for it in a collective (real local Ray, gloo)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import ray.cloudpickle
import torch

from hybridflow.controller import ResourcePool, Worker, WorkerGroup, register
from hybridflow.errors import EngineContractError, WorkerError

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Collective(Worker):
    def __init__(self) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{self.master_addr}:{self.master_port}", rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=120))

    @register(protocol="one_to_all")
    def all_reduce(self, fail_on_rank_zero: bool, seconds: float = 0.0) -> float:
        import torch.distributed as dist

        time.sleep(seconds)  # longer than the one-round-trip fast path: the per-rank wait answers
        if fail_on_rank_zero and self.rank == 0:
            raise RuntimeError("rank 0 failed before the collective")
        value = torch.ones(1)
        dist.all_reduce(value)  # rank 1 blocks here until rank 0 joins, which it never does
        return float(value)

    @register(protocol="one_to_all")
    def break_contract(self) -> None:
        raise EngineContractError("a plugin engine lacks a capability it declared")


@pytest.fixture
def group(ray_session: None) -> Iterator[WorkerGroup]:
    pool = ResourcePool("fail-fast", [2], cpus_per_worker=0.25)
    worker_group = WorkerGroup(pool, Collective, name="collective", deadline_s=90, setup_deadline_s=300)
    yield worker_group
    worker_group.shutdown()
    pool.release()


def test_a_rank_raising_before_a_collective_fails_the_call_at_once(group: WorkerGroup) -> None:
    assert group.all_reduce(False, 0.5) == [2.0, 2.0]  # a healthy call longer than the fast path still collects
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        group.all_reduce(True, 0.5)
    elapsed = time.monotonic() - started
    assert elapsed < 15, f"the call waited {elapsed:.0f} s for rank 1, blocked in the collective (deadline 90 s)"
    assert caught.value.rank == 0 and caught.value.method == "worker.all_reduce"
    message = str(caught.value)
    assert "rank 0 failed before the collective" in message and "ranks [1] were still running" in message
    assert "in all_reduce" in caught.value.remote_traceback
    assert not caught.value.deterministic  # a RuntimeError may not repeat: recovery retries it
    with pytest.raises(WorkerError, match="EngineContractError: a plugin engine lacks") as contract:
        group.break_contract()
    assert contract.value.deterministic  # it would repeat on every retry: recovery stops instead (test_engine_contract)


class FailsBeforeTheRendezvous(Worker):
    """Rank 0 raises before starting the rendezvous store (as when its port was taken); rank 1 waits on it."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if self.rank == 0:
            raise OSError("rank 0 could not bind its rendezvous port")
        dist.init_process_group("gloo", init_method=f"tcp://{self.master_addr}:{self.master_port}", rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=120))


def test_a_rank_failing_its_constructor_fails_the_group_at_once_with_its_error(ray_session: None) -> None:
    pool = ResourcePool("fail-fast-init", [2], cpus_per_worker=0.25)
    started = time.monotonic()
    try:
        with pytest.raises(WorkerError) as caught:
            WorkerGroup(pool, FailsBeforeTheRendezvous, name="init", deadline_s=240)
    finally:
        pool.release()
    elapsed = time.monotonic() - started
    # well under the 120 s rank 1 would wait in its rendezvous (31 s once at load ~15: no tighter wall-clock bound)
    assert elapsed < 100, f"the group waited {elapsed:.0f} s for rank 1, blocked in the rendezvous (deadline 240 s)"
    message = str(caught.value)
    assert caught.value.rank == 0 and caught.value.method == "__init__", message
    assert "could not bind its rendezvous port" in message and "ranks [1] had not finished" in message, message
