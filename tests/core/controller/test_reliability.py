"""Watchdog, killed workers, restart, and protocols added from user code and from a plugin hook (real local Ray)."""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import ray.cloudpickle
import torch

from hybridflow.batch import Batch
from hybridflow.controller import ResourcePool, Worker, WorkerGroup, register
from hybridflow.errors import DeadlineExceededError, WorkerError
from hybridflow.hookspecs import hookimpl
from hybridflow.plugins import register_plugin
from hybridflow.registries import transfer_protocols
from hybridflow.transfer import RankInput, TransferContext, concat_or_list
from hybridflow.transfer import register as register_protocol

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ReversedDataParallel:
    """User-code protocol: rank r gets chunk (W-1-r); outputs are collected in reverse rank order."""

    concatenates = True

    def distribute(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], context: TransferContext
    ) -> list[RankInput | None]:
        chunks = args[0].chunk(context.world_size)
        return [RankInput(args=(chunks[context.world_size - 1 - rank],)) for rank in range(context.world_size)]

    def collect_ranks(self, context: TransferContext) -> list[int]:
        return list(reversed(range(context.world_size)))

    def collect(self, outputs: list[Any], context: TransferContext) -> Any:
        return concat_or_list(outputs)


class LastRankOnly:
    """Plugin protocol: only the last rank runs, with every argument; its output is the result."""

    concatenates = True

    def distribute(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], context: TransferContext
    ) -> list[RankInput | None]:
        return [None] * (context.world_size - 1) + [RankInput(args=args, kwargs=dict(kwargs))]

    def collect_ranks(self, context: TransferContext) -> list[int]:
        return [context.world_size - 1]

    def collect(self, outputs: list[Any], context: TransferContext) -> Any:
        return outputs[0]


def build_plugin_module() -> types.ModuleType:
    module = types.ModuleType("hybridflow_test_last_rank_plugin")

    @hookimpl
    def hybridflow_register_transfer_protocols(*, registry: Any) -> None:
        registry.register("test_last_rank_only", LastRankOnly())

    module.hybridflow_register_transfer_protocols = hybridflow_register_transfer_protocols  # type: ignore[attr-defined]
    return module


class Stubborn(Worker):
    @register(protocol="one_to_all")
    def ping(self) -> int:
        return self.rank

    @register(protocol="one_to_all", deadline_s=3)
    def never_returns_on_rank_one(self) -> int:
        while self.rank == 1:
            time.sleep(0.05)
        return self.rank

    @register(protocol="test_reversed_dp")
    def tag_reversed(self, batch: Batch) -> Batch:
        return Batch({"ids": batch["ids"], "seen_by": torch.full((len(batch),), self.rank)}, meta=batch.meta)

    @register(protocol="test_last_rank_only")
    def tag_last(self, batch: Batch) -> Batch:
        return Batch({"ids": batch["ids"], "seen_by": torch.full((len(batch),), self.rank)}, meta=batch.meta)


@pytest.fixture(scope="module")
def group(ray_session: None) -> Iterator[WorkerGroup]:
    register_protocol("test_reversed_dp", ReversedDataParallel())
    info = register_plugin(build_plugin_module(), name="test-last-rank-plugin")
    assert info.registered == {"transfer protocol": ["test_last_rank_only"]}
    pool = ResourcePool("reliability", [2], cpus_per_worker=0.25)
    worker_group = WorkerGroup(pool, Stubborn, name="stubborn", deadline_s=30, setup_deadline_s=120)
    yield worker_group
    worker_group.shutdown()
    pool.release()
    for name in ("test_reversed_dp", "test_last_rank_only"):
        transfer_protocols.unregister(name)


def test_user_and_plugin_protocols_drive_calls(group: WorkerGroup) -> None:
    assert transfer_protocols.owner("test_reversed_dp") == "user code"
    assert transfer_protocols.owner("test_last_rank_only") == "test-last-rank-plugin"
    batch = Batch({"ids": torch.arange(4)}, meta={"policy_version": 0})
    reversed_out = group.tag_reversed(batch)
    assert reversed_out["ids"].tolist() == [0, 1, 2, 3] and reversed_out["seen_by"].tolist() == [1, 1, 0, 0]
    last = group.tag_last(batch)
    assert last["ids"].tolist() == [0, 1, 2, 3] and last["seen_by"].tolist() == [1, 1, 1, 1]


def test_watchdog_dumps_stacks_and_fails_within_deadline(group: WorkerGroup, tmp_path: Path) -> None:
    group.stack_dump_dir = str(tmp_path)
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError) as caught:
        group.never_returns_on_rank_one()
    elapsed = time.monotonic() - started
    assert 3 <= elapsed < 3 + 12
    message = str(caught.value)
    assert "stubborn.worker.never_returns_on_rank_one" in message and "ranks [1]" in message
    assert "in never_returns_on_rank_one" in message and "time.sleep" in message  # the stuck worker's stack
    dumps = list(tmp_path.glob("stubborn.worker.never_returns_on_rank_one.rank1.*.txt"))
    assert len(dumps) == 1 and "never_returns_on_rank_one" in dumps[0].read_text()
    # rank 1 is still spinning: killing and restarting it is the caller's policy (next test)


def test_killed_rank_raises_worker_error_and_restart_recovers(group: WorkerGroup) -> None:
    old_pids = group.process_ids
    group.kill_rank(1)  # also ends the rank the watchdog test left spinning
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        group.ping()
    assert caught.value.rank == 1 and "died" in str(caught.value)
    assert time.monotonic() - started < 30
    group.restart()
    assert group.ping() == [0, 1]
    assert set(group.process_ids.values()).isdisjoint(old_pids.values())
