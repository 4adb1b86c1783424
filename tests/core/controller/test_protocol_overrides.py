"""``WorkerGroup(protocols={role: {method: name}})``: a method runs with another registered protocol than the one it
declares, over a real local Ray; bad overrides fail at construction, naming what is known."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import ray.cloudpickle
import torch

from hybridflow import registries
from hybridflow.batch import Batch
from hybridflow.controller import ResourcePool, Worker, WorkerGroup, register
from hybridflow.errors import ConfigError
from hybridflow.transfer import RankInput, TransferContext

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers unpickle these classes by value


class Rows(Worker):
    @register(protocol="dp_compute")
    def tag_rows(self, batch: Batch) -> Batch:
        return Batch({"rank": torch.full((len(batch),), self.rank)})

    @register(protocol="one_to_all")
    def ping(self) -> int:
        return self.rank


class LastRankOnly:
    """A user protocol: every row goes to the last rank; counts the calls it dispatched."""

    concatenates = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []

    def distribute(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                   context: TransferContext) -> list[RankInput | None]:
        self.calls.append((context.role, context.method, len(args[0])))
        return [None] * (context.world_size - 1) + [RankInput(args=args, kwargs=dict(kwargs))]

    def collect_ranks(self, context: TransferContext) -> list[int]:
        return [context.world_size - 1]

    def collect(self, outputs: list[Any], context: TransferContext) -> Any:
        return outputs[0]


@pytest.fixture(scope="module")
def protocol(ray_session: None) -> Iterator[LastRankOnly]:
    instance = LastRankOnly()
    registries.transfer_protocols.register("test_last_rank_only", instance, owner="test")
    yield instance
    registries.transfer_protocols.unregister("test_last_rank_only")


@pytest.fixture(scope="module")
def pool(ray_session: None) -> Iterator[ResourcePool]:
    pool = ResourcePool("overrides", [2], cpus_per_worker=0.25)
    yield pool
    pool.release()


@pytest.mark.slow  # 45-70 s in the full run of 2026-12-07 (tests/durations.json)
def test_override_replaces_the_declared_protocol_and_keeps_the_rest(pool: ResourcePool,
                                                                      protocol: LastRankOnly) -> None:
    batch = Batch({"x": torch.arange(6)})
    with WorkerGroup(pool, {"rows": Rows}, name="declared", deadline_s=60, setup_deadline_s=300) as declared:
        assert declared.rows.tag_rows(batch)["rank"].tolist() == [0, 0, 0, 1, 1, 1]  # dp_compute as declared
    with WorkerGroup(pool, {"rows": Rows}, name="overridden", deadline_s=60, setup_deadline_s=300,
                     protocols={"rows": {"tag_rows": "test_last_rank_only"}}) as group:
        assert group.rows.tag_rows(batch)["rank"].tolist() == [1] * 6  # every row ran on the last rank
        assert group.call(Rows.tag_rows, batch)["rank"].tolist() == [1] * 6  # the typed call path too
        assert group.rows.ping() == [0, 1]  # methods not overridden keep theirs
        assert group.protocols() == {"rows.tag_rows": "test_last_rank_only", "rows.ping": "one_to_all"}
        assert group.rows.tag_rows.dispatch.blocking  # only the protocol changed
    assert protocol.calls == [("rows", "tag_rows", 6), ("rows", "tag_rows", 6)]


@pytest.mark.parametrize(("protocols", "match"), [
    ({"rows": {"tag_rows": "no_such_protocol"}}, r'Unknown transfer protocol "no_such_protocol"\. Known: .*dp_compute'),
    ({"rows": {"tag_row": "one_to_all"}}, r'no method "tag_row".*expected one of ping, tag_rows'),
    ({"critic": {"ping": "one_to_all"}}, r"role 'critic'.*expected one of \['rows'\]"),
])
def test_bad_override_is_a_config_error_before_any_worker_starts(ray_session: None, protocols: Any,
                                                                  match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        WorkerGroup(object.__new__(ResourcePool), {"rows": Rows}, protocols=protocols)  # type: ignore[arg-type]
