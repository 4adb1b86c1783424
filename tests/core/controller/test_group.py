"""Worker groups over a real local Ray: ranks and env, colocated roles, protocols, futures, bytes per rank, errors."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import ray
import ray.cloudpickle
import torch

from hybridflow.batch import Batch
from hybridflow.controller import (
    BatchFuture,
    CallRecord,
    ResourcePool,
    Worker,
    WorkerGroup,
    register,
)
from hybridflow.controller.staging import INLINE_BATCH_BYTES
from hybridflow.engines import MeshInfo
from hybridflow.errors import ConfigError, UnknownNameError, VersionMismatchError, WorkerError

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers unpickle these classes by value

CPUS = 0.25  # fractional slots: 6 workers hold 1.5 of the Ray's 4 logical CPUs


class Actor(Worker):
    def __init__(self, offset: int = 0) -> None:
        self.offset = offset
        self.calls = 0

    @register(protocol="one_to_all")
    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "world": self.world_size, "pid": os.getpid(), "port": os.environ["MASTER_PORT"],
                "addr": os.environ["MASTER_ADDR"], "env_rank": int(os.environ["RANK"]), "offset": self.offset}

    @register(protocol="one_to_all", deadline_s=120)
    def all_reduce(self, value: float) -> float:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        tensor = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(tensor)
        return float(tensor.item())

    @register(protocol="dp_compute", blocking=False, idempotent=True)
    def tag(self, batch: Batch) -> Batch:
        """Echo with the processing rank and the offset added to ids."""
        out = Batch({"ids": batch["ids"] + self.offset, "seen_by": torch.full((len(batch),), self.rank)},
                    meta=batch.meta)
        return out

    @register(protocol="dp_compute")
    def row_sums(self, batch: Batch) -> Batch:
        return Batch({"sum": batch["ids"].sum(dim=1)}, meta=batch.meta)

    @register(protocol="dp_compute_padded")
    def padded_echo(self, batch: Batch) -> Batch:
        return Batch({"ids": batch["ids"].clone(), "rows_here": torch.full((len(batch),), len(batch))},
                     meta=batch.meta)

    @register(protocol="one_to_all", execute="rank_zero")
    def count_call(self) -> int:
        self.calls += 1
        return self.calls

    @register(protocol="one_to_all")
    def calls_so_far(self) -> int:
        return self.calls

    @register(protocol="all_to_all")
    def scaled(self, value: int) -> int:
        return value * 10 + self.rank

    @register(protocol="mesh")
    def mesh_tag(self, batch: Batch) -> Batch:
        return Batch({"ids": batch["ids"], "seen_by": torch.full((len(batch),), self.rank)}, meta=batch.meta)

    @register(protocol="dp_compute")
    def fail_on_rank_one(self, batch: Batch) -> Batch:
        if self.rank == 1:
            raise RuntimeError("deliberate failure in fail_on_rank_one")
        return batch

    def mesh_info(self) -> MeshInfo:
        # 4 ranks = 2 data-parallel groups × 2 (a TP pair); the second of each pair is collected
        return MeshInfo(dp_rank=self.rank // 2, dp_size=max(1, self.world_size // 2), is_collect=self.rank % 2 == 1)


class Reference(Worker):
    @register(protocol="one_to_all")
    def describe(self) -> dict[str, Any]:  # same name as Actor.describe: colocated roles keep their names
        return {"rank": self.rank, "pid": os.getpid(), "role": "reference"}

    @register(protocol="dp_compute")
    def row_sums(self, batch: Batch) -> Batch:
        return Batch({"sum": batch["ids"].sum(dim=1) * 0}, meta=batch.meta)


class BadProtocolWorker(Worker):
    @register(protocol="no_such_protocol")
    def run(self) -> None: ...


def make(rows: int, columns: int = 16, version: int = 1, iteration: int = 0) -> Batch:
    return Batch({"ids": torch.arange(rows * columns, dtype=torch.int64).view(rows, columns)},
                 meta={"policy_version": version, "iteration": iteration})


@pytest.fixture(scope="module")
def records() -> list[CallRecord]:
    return []


@pytest.fixture(scope="module")
def groups(ray_session: None, records: list[CallRecord]) -> Iterator[dict[str, WorkerGroup]]:
    wide_pool = ResourcePool("wide", [4], cpus_per_worker=CPUS)
    narrow_pool = ResourcePool("narrow", [2], cpus_per_worker=CPUS)
    wide = WorkerGroup(wide_pool, {"actor": Actor, "reference": Reference}, init_kwargs={"actor": {"offset": 0}},
                       name="wide", deadline_s=60, setup_deadline_s=300, observers=[records.append])
    narrow = WorkerGroup(narrow_pool, {"actor": Actor}, init_kwargs={"actor": {"offset": 0}}, name="narrow",
                         deadline_s=60, setup_deadline_s=300, observers=[records.append])
    yield {"wide": wide, "narrow": narrow}
    wide.shutdown()
    narrow.shutdown()
    wide_pool.release()
    narrow_pool.release()


@pytest.mark.slow  # 45-70 s in the full run of 2026-12-07 (tests/durations.json)
def test_ranks_env_and_colocated_roles_share_one_process(groups: dict[str, WorkerGroup]) -> None:
    wide = groups["wide"]
    described = wide.actor.describe()
    assert [d["rank"] for d in described] == [0, 1, 2, 3] == [d["env_rank"] for d in described]
    assert {d["world"] for d in described} == {4} and {d["addr"] for d in described} == {"127.0.0.1"}
    assert len({d["port"] for d in described}) == 1 and len({d["pid"] for d in described}) == 4
    reference = wide.reference.describe()
    assert [d["pid"] for d in reference] == [d["pid"] for d in described]  # colocated: same processes
    assert {d["role"] for d in reference} == {"reference"}
    assert wide.call(Reference.row_sums, make(4))["sum"].tolist() == [0, 0, 0, 0]
    assert wide.call(Actor.row_sums, make(4), role="actor")["sum"].tolist() == make(4)["ids"].sum(1).tolist()
    assert [d["offset"] for d in wide.call(Actor.describe)] == [0, 0, 0, 0]  # role inferred from the class
    with pytest.raises(ConfigError, match="belongs to roles \\[\\]"):
        wide.call(BadProtocolWorker.run)


def test_workers_can_form_a_gloo_group(groups: dict[str, WorkerGroup]) -> None:
    assert groups["narrow"].actor.all_reduce(1.0) == [3.0, 3.0]  # 1·1 + 1·2 on both ranks


def test_dp_compute_future_roundtrip_and_padding(groups: dict[str, WorkerGroup]) -> None:
    wide = groups["wide"]
    batch = make(8)
    future = wide.actor.tag(batch)
    assert isinstance(future, BatchFuture)
    assert len(future) == 8 and future.meta == batch.meta
    out = future.get(timeout=30)
    assert torch.equal(out["ids"], batch["ids"]) and out["seen_by"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    padded = wide.actor.padded_echo(make(5))
    assert torch.equal(padded["ids"], make(5)["ids"]) and set(padded["rows_here"].tolist()) == {2}
    with pytest.raises(ConfigError, match="dp_compute_padded"):
        wide.actor.row_sums(make(6))


def test_rank_zero_all_to_all_and_mesh(groups: dict[str, WorkerGroup], records: list[CallRecord]) -> None:
    wide = groups["wide"]
    before = wide.actor.calls_so_far()
    assert wide.actor.count_call() == before[0] + 1
    assert wide.actor.calls_so_far() == [before[0] + 1] + before[1:]  # only rank 0 ran
    assert wide.actor.scaled([1, 2, 3, 4]) == [10, 21, 32, 43]
    batch = make(4)
    out = wide.actor.mesh_tag(batch)
    assert torch.equal(out["ids"], batch["ids"]) and out["seen_by"].tolist() == [1, 1, 3, 3]
    shard = batch.nbytes() // 2
    assert records[-1].method == "mesh_tag" and records[-1].bytes_in_per_rank == (shard, shard, shard, shard)


@pytest.mark.parametrize(("producer", "consumer"), [("wide", "wide"), ("narrow", "narrow"), ("narrow", "wide"),
                                                    ("wide", "narrow")])
def test_future_edges_fetch_exactly_each_ranks_shard(groups: dict[str, WorkerGroup], records: list[CallRecord],
                                                     producer: str, consumer: str) -> None:
    batch = make(8, columns=256)
    future = groups[producer].actor.tag(batch)
    out = groups[consumer].actor.row_sums(future)
    assert out["sum"].tolist() == batch["ids"].sum(dim=1).tolist()
    record = records[-1]
    assert (record.group, record.method) == (consumer, "row_sums")
    world = groups[consumer].world_size
    tagged_bytes = batch.nbytes() + 8 * 8  # ids + the int64 seen_by column
    assert record.bytes_in_per_rank == tuple([tagged_bytes // world] * world)
    assert record.bytes_out == 8 * 8 and record.seconds > 0


def test_version_mismatch_aborts_before_dispatch(groups: dict[str, WorkerGroup], records: list[CallRecord]) -> None:
    wide = groups["wide"]
    old = wide.actor.tag(make(4, version=1))
    new = make(4, version=2)
    count = len(records)
    with pytest.raises(VersionMismatchError, match="policy_version: 1 vs 2"):
        wide.actor.row_sums(old, other=new)
    with pytest.raises(VersionMismatchError, match="iteration"):
        wide.actor.row_sums(make(4, iteration=1), other=make(4, iteration=2))
    assert len(records) == count + 1  # only the producer's record: nothing was dispatched


def test_worker_error_carries_rank_method_and_remote_traceback(groups: dict[str, WorkerGroup]) -> None:
    with pytest.raises(WorkerError) as caught:
        groups["narrow"].actor.fail_on_rank_one(make(4))
    assert caught.value.rank == 1 and caught.value.method == "actor.fail_on_rank_one"
    assert "deliberate failure" in str(caught.value) and "in fail_on_rank_one" in caught.value.remote_traceback


def test_unknown_protocol_fails_at_construction(ray_session: None) -> None:
    with pytest.raises(UnknownNameError, match="no_such_protocol"):
        WorkerGroup(object.__new__(ResourcePool), BadProtocolWorker)  # type: ignore[arg-type]


def test_a_group_observer_sees_its_group_calls_only(groups: dict[str, WorkerGroup]) -> None:
    """Observers are scoped to the group (its owner's list), not the process: the other group's calls stay unheard."""
    seen_narrow: list[CallRecord] = []
    seen_wide: list[CallRecord] = []
    groups["narrow"].observers.append(seen_narrow.append)
    groups["wide"].observers.append(seen_wide.append)
    try:
        started = time.time()
        groups["narrow"].actor.row_sums(make(2))
        groups["wide"].reference.row_sums(make(4))
    finally:
        groups["narrow"].observers.remove(seen_narrow.append)
        groups["wide"].observers.remove(seen_wide.append)
    assert [(r.group, r.role, r.method, r.protocol) for r in seen_narrow] == [("narrow", "actor", "row_sums",
                                                                               "dp_compute")]
    assert [(r.group, r.role, r.method) for r in seen_wide] == [("wide", "reference", "row_sums")]
    assert seen_narrow[0].started_at >= started - 1 and seen_narrow[0].finished_at >= seen_narrow[0].started_at
    groups["narrow"].actor.row_sums(make(2))  # removed: no longer called
    assert len(seen_narrow) == 1


def test_padded_future_edge_spans_producers_and_pads_lazily(groups: dict[str, WorkerGroup],
                                                            records: list[CallRecord]) -> None:
    batch = make(6)  # 2 producer ranks × 3 rows → 4 consumer ranks × 2 rows: spans, partial slices, pure padding
    future = groups["narrow"].actor.tag(batch)
    out = groups["wide"].actor.padded_echo(future)
    assert torch.equal(out["ids"], batch["ids"]) and set(out["rows_here"].tolist()) == {2}
    row = 16 * 8 + 8  # ids + seen_by bytes per row
    assert records[-1].bytes_in_per_rank == (2 * row, 2 * row, 2 * row, row)  # rank 3 fetched one row to pad from
    halves = future.chunk(2)
    assert [len(part) for part in halves] == [3, 3] and torch.equal(halves[1].get(timeout=30)["ids"], batch["ids"][3:])


def test_small_batches_travel_inline_large_ones_through_the_object_store(
        groups: dict[str, WorkerGroup], records: list[CallRecord], monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's shard under INLINE_BATCH_BYTES rides in the call (no ray.put); a larger one is stored (once per
    shard); both count exactly their shard bytes on every rank."""
    from hybridflow.controller import group as group_module

    puts: list[int] = []
    real_put = ray.put
    monkeypatch.setattr(group_module.ray, "put", lambda value, **kw: (puts.append(id(value)), real_put(value, **kw))[1])
    wide = groups["wide"]
    small = make(8, columns=16)  # 1 KiB
    large = make(8, columns=INLINE_BATCH_BYTES // 8 // 2 + 64)  # shards of 2 rows
    assert small.nbytes() <= INLINE_BATCH_BYTES < large.nbytes() // 4
    for batch, stored in ((small, False), (large, True)):
        puts.clear()
        out = wide.actor.row_sums(batch)
        assert out["sum"].tolist() == batch["ids"].sum(dim=1).tolist()
        assert len(puts) == (4 if stored else 0), f"{batch.nbytes()} bytes: {len(puts)} object-store puts"
        assert records[-1].bytes_in_per_rank == tuple([batch.nbytes() // 4] * 4)


def test_call_reports_carry_role_counters_and_local_pids(groups: dict[str, WorkerGroup],
                                                         records: list[CallRecord]) -> None:
    wide = groups["wide"]
    wide.actor.count_call()
    assert records[-1].counters_per_rank == ({},) * 4  # Actor defines no counters()
    local = wide.local_process_ids()
    assert local == wide.process_ids and sorted(local) == [0, 1, 2, 3]


def test_submit_ahead_is_claimed_only_by_the_same_arguments(groups: dict[str, WorkerGroup],
                                                            records: list[CallRecord]) -> None:
    """A call submitted ahead is handed to the first later call with the very same argument objects (one dispatch
    in all); a call with other arguments dispatches anew and leaves it; drop_ahead forgets it."""
    wide = groups["wide"]
    batch, other = make(8), make(8)
    wide.submit_ahead("actor", "tag", batch)
    dispatched = len(records)  # records are emitted when collected: nothing yet
    fresh = wide.actor.tag(other)  # equal values, another object: not claimed
    assert torch.equal(fresh.get()["ids"], other["ids"]) and len(records) == dispatched + 1
    claimed = wide.actor.tag(batch)
    assert torch.equal(claimed.get()["ids"], batch["ids"]) and len(records) == dispatched + 2
    assert wide.drop_ahead() == 0  # claimed: nothing left
    wide.submit_ahead("actor", "tag", batch)
    assert wide.drop_ahead() == 1
    again = wide.actor.tag(batch)  # dropped: a new dispatch
    assert torch.equal(again.get()["ids"], batch["ids"]) and len(records) == dispatched + 3
    with pytest.raises(ConfigError, match="not a registered method"):
        wide.submit_ahead("actor", "mesh_info", batch)


def test_a_blocking_dp_call_costs_one_put_per_shard_one_get_and_one_copy(
        groups: dict[str, WorkerGroup], records: list[CallRecord], monkeypatch: pytest.MonkeyPatch) -> None:
    """The hot path, counted (not timed): a blocking dp_compute call of a stored batch serialises each input byte
    once (one ray.put per rank: its shard; the call itself carries only refs), makes one actor call per rank and one
    ray.get for every report and output, no ray.wait, copies the collected bytes once, checks the version tags on
    the way in and out, bounds every ray.get by a timeout and tells the observers."""
    from hybridflow.controller import future as future_module
    from hybridflow.controller import group as group_module
    from hybridflow.controller.host import RankPayload
    from hybridflow.transfer import concat as concat_module

    monkeypatch.setattr(future_module, "FAST_PATH_S", 60.0)  # a slow CI box must not turn counts into timings
    calls: dict[str, int] = {"put": 0, "get": 0, "wait": 0, "versions": 0}
    put_bytes: list[int] = []
    payloads: list[RankPayload] = []
    real_put, real_get, real_wait = ray.put, ray.get, ray.wait

    def put(value: Any, **kwargs: Any) -> Any:
        calls["put"] += 1
        put_bytes.append(value.nbytes() if isinstance(value, Batch) else -1)
        return real_put(value, **kwargs)

    def get(refs: Any, **kwargs: Any) -> Any:
        calls["get"] += 1
        assert kwargs.get("timeout") is not None, "every ray.get of the controller is bounded by a deadline"
        return real_get(refs, **kwargs)

    def wait(refs: Any, **kwargs: Any) -> Any:
        calls["wait"] += 1
        return real_wait(refs, **kwargs)

    def counted(function: Any) -> Any:
        def check(*args: Any, **kwargs: Any) -> Any:
            calls["versions"] += 1
            return function(*args, **kwargs)
        return check

    def payload(**kwargs: Any) -> RankPayload:
        payloads.append(RankPayload(**kwargs))
        return payloads[-1]

    for name, replacement in (("put", put), ("get", get), ("wait", wait)):
        monkeypatch.setattr(ray, name, replacement)
    monkeypatch.setattr(group_module, "check_versions", counted(group_module.check_versions))
    monkeypatch.setattr(concat_module, "check_versions", counted(concat_module.check_versions))
    monkeypatch.setattr(group_module, "RankPayload", payload)
    wide = groups["wide"]
    batch = make(64, columns=1024)  # 512 KiB: 128 KiB shards, above the inline limit
    assert batch.nbytes() // 4 > INLINE_BATCH_BYTES
    copied = dict(concat_module.COPY_STATS)
    out = wide.actor.row_sums(batch)
    assert out["sum"].tolist() == batch["ids"].sum(dim=1).tolist() and out.meta == batch.meta
    assert calls == {"put": 4, "get": 1, "wait": 0, "versions": 2}, calls
    assert put_bytes == [batch.nbytes() // 4] * 4  # each shard once; never the whole batch, never twice
    assert len(payloads) == 4 and all(len(ray.cloudpickle.dumps(p)) < 2048 for p in payloads)  # refs, not rows
    assert concat_module.COPY_STATS["bytes"] - copied["bytes"] == out.nbytes()  # the result, copied once
    assert concat_module.COPY_STATS["columns"] - copied["columns"] == 1
    assert records[-1].method == "row_sums" and records[-1].bytes_in_per_rank == (batch.nbytes() // 4,) * 4
