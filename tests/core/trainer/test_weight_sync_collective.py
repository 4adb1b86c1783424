"""The collective weight sync (``rollout.weight_sync: collective``, hybridflow.workers.weight_sync): a real gloo group
of a sender and two rollout engines (threads of this process, each its own group member) — the engines' weights
after a sync are bit-identical to the sender's, every byte moves once per receiver in buckets of at most
``bucket_bytes``, and a version tag other than the expected one raises without loading anything and leaves the
group in step for the next sync; the same through RolloutWorker.receive_weights. A load failing between two
buckets leaves the worker refusing to generate; a sender whose receiver stops answering fails and still reads its
whole weight stream."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.engines import ModelSpec, RolloutEngineConfig
from hybridflow.errors import EngineError, VersionMismatchError
from hybridflow.presets import preset_model_config
from hybridflow.workers.weight_sync import SyncRendezvous, WeightReceiver, broadcast_weights

BUCKET_BYTES = 64 << 10  # several buckets for the ~300 KB model, each larger than its largest tensor (32 KB)


def _engine(seed: int) -> Any:
    from hybridflow_fsdp.rollout import HFRolloutEngine

    spec = ModelSpec(config=preset_model_config("tiny-qwen2"), seed=seed)
    return HFRolloutEngine(config=RolloutEngineConfig(model=spec))


def _run(*members: Callable[[], Any]) -> list[Any]:
    """Run every member in a thread of its own (each blocks in the collectives until all join); their results, or
    the exception a member raised."""
    results: list[Any] = [None] * len(members)

    def run(index: int) -> None:
        try:
            results[index] = members[index]()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            results[index] = exc

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(len(members))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a sync member hung"
    return results


def _receive(spec: Any, rank: int, engine: Any, version: int) -> dict[str, float]:
    receiver = WeightReceiver(spec, rank, expected_version=version)
    try:
        engine.update_weights(receiver.named_tensors(), version=version)
    finally:
        receiver.drain()
    return receiver.stats()


@pytest.fixture(scope="module")
def engines() -> tuple[Any, list[Any]]:
    return _engine(seed=1), [_engine(seed=2), _engine(seed=3)]


def test_a_collective_sync_makes_the_rollout_weights_bit_identical_in_bounded_buckets(engines: Any) -> None:
    actor, rollouts = engines
    sent = {name: p.detach().clone() for name, p in actor.model.named_parameters()}
    total = sum(t.numel() * t.element_size() for t in sent.values())
    assert any(not torch.equal(p, sent[name]) for name, p in rollouts[0].model.named_parameters())
    rendezvous = SyncRendezvous(world_size=3, backend="gloo", timeout_s=30)  # its store lives as long as it does
    spec = rendezvous.spec()
    sender, *received = _run(
        lambda: broadcast_weights(spec, actor.model.named_parameters(), version=5, bucket_bytes=BUCKET_BYTES),
        *(lambda rank=rank: _receive(spec, rank + 1, rollouts[rank], 5) for rank in range(2)))
    for engine in rollouts:
        got = dict(engine.model.named_parameters())
        assert got.keys() == sent.keys() and engine.weights_version == 5
        for name, tensor in sent.items():
            assert torch.equal(got[name], tensor), name
    # every byte once per sync (M), in several buckets none above the bound
    assert sender["bytes"] == total and sender["buckets"] >= total // BUCKET_BYTES
    assert 0 < sender["peak_bucket_bytes"] <= BUCKET_BYTES
    for stats in received:
        assert (stats["bytes"], stats["buckets"], stats["peak_bucket_bytes"]) == (
            sender["bytes"], sender["buckets"], sender["peak_bucket_bytes"])


def test_a_version_mismatch_raises_loads_nothing_and_keeps_the_group_in_step(engines: Any) -> None:
    actor, rollouts = engines
    engine = rollouts[0]
    before = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    with torch.no_grad():  # so a load would show
        for parameter in actor.model.parameters():
            parameter.add_(1.0)
    rendezvous = SyncRendezvous(world_size=2, backend="gloo", timeout_s=30)
    spec = rendezvous.spec()
    _, error = _run(lambda: broadcast_weights(spec, actor.model.named_parameters(), version=7, bucket_bytes=4096),
                    lambda: _receive(spec, 1, engine, 8))
    assert isinstance(error, VersionMismatchError) and "version 7" in str(error) and "version 8" in str(error)
    for name, parameter in engine.model.named_parameters():
        assert torch.equal(parameter, before[name]), name
    # the receiver drained the rest of the sync: the same group carries the next one
    _, stats = _run(lambda: broadcast_weights(spec, actor.model.named_parameters(), version=8, bucket_bytes=4096),
                    lambda: _receive(spec, 1, engine, 8))
    assert stats["buckets"] > 1 and engine.weights_version == 8
    for name, parameter in actor.model.named_parameters():
        assert torch.equal(dict(engine.model.named_parameters())[name], parameter), name


def test_the_rollout_worker_receives_over_the_group_and_refuses_another_version(engines: Any) -> None:
    """RolloutWorker.receive_weights (the rollout pool's side, called in this process instead of through Ray)."""
    from hybridflow.engines import SamplingParams, TrainingEngineConfig
    from hybridflow.workers.roles import RoleSpec
    from hybridflow.workers.rollout import RolloutWorker

    actor, _ = engines
    model = ModelSpec(config=preset_model_config("tiny-qwen2"))
    worker = RolloutWorker(RoleSpec(role="actor", name="rollout", engine="fsdp",
                                    engine_config=TrainingEngineConfig(model=model), rollout_engine="hf",
                                    rollout_config=RolloutEngineConfig(model=model), sampling=SamplingParams()))
    receive = getattr(RolloutWorker.receive_weights, "__wrapped__", RolloutWorker.receive_weights)
    rendezvous = SyncRendezvous(world_size=2, backend="gloo", timeout_s=30)
    spec = rendezvous.spec()
    weights = actor.model.named_parameters
    _, error = _run(lambda: broadcast_weights(spec, weights(), version=2, bucket_bytes=BUCKET_BYTES),
                    lambda: receive(worker, spec, 3))
    assert isinstance(error, VersionMismatchError) and not worker.synced
    _, stats = _run(lambda: broadcast_weights(spec, weights(), version=3, bucket_bytes=BUCKET_BYTES),
                    lambda: receive(worker, spec, 3))
    total = sum(p.numel() * p.element_size() for p in actor.model.parameters())
    assert stats["bytes"] == total == worker.bytes_received and worker.synced
    assert worker.rollout.weights_version == 3
    for (name, sent), (_, got) in zip(actor.model.named_parameters(), worker.rollout.model.named_parameters()):
        assert torch.equal(got, sent), name


def _rollout_worker(extra: dict[str, Any] | None = None) -> Any:
    from hybridflow.engines import SamplingParams, TrainingEngineConfig
    from hybridflow.workers.roles import RoleSpec
    from hybridflow.workers.rollout import RolloutWorker

    model = ModelSpec(config=preset_model_config("tiny-qwen2"))
    return RolloutWorker(RoleSpec(role="actor", name="rollout", engine="fsdp",
                                  engine_config=TrainingEngineConfig(model=model), rollout_engine="hf",
                                  rollout_config=RolloutEngineConfig(model=model), sampling=SamplingParams(),
                                  extra=dict(extra or {})))


def test_a_load_failing_between_buckets_leaves_no_weights_to_generate_with(engines: Any, tmp_path: Path) -> None:
    """The ``rollout.load_weights@V:raise:bucket=B`` fault point: buckets 0..B-1 of version V are in the engine,
    the rest still the old version's (the engine's weights are a mix and its version tag the old one); the worker
    then refuses to generate, even prompts tagged with the version its engine still reports."""
    from hybridflow.batch import Batch
    from hybridflow.reliability.faults import FaultPlan, InjectedFault
    from hybridflow.workers.rollout import RolloutWorker, pack_weight_buckets

    actor, _ = engines
    plan = FaultPlan.from_sources(["rollout.load_weights@4:raise:bucket=2"], tmp_path, environ={})
    worker = _rollout_worker({"faults": plan.to_json()})
    load = getattr(RolloutWorker.load_weights, "__wrapped__", RolloutWorker.load_weights)
    generate = getattr(RolloutWorker.generate, "__wrapped__", RolloutWorker.generate)
    old = pack_weight_buckets(actor.model.named_parameters(), bucket_bytes=BUCKET_BYTES)
    assert len(old) > 3
    load(worker, (3, old), 3)  # complete: the fault is for version 4
    assert worker.synced and worker.rollout.weights_version == 3
    with torch.no_grad():
        for parameter in actor.model.parameters():
            parameter.add_(1.0)
    new = pack_weight_buckets(actor.model.named_parameters(), bucket_bytes=BUCKET_BYTES)
    with pytest.raises(InjectedFault, match=r"rollout\.load_weights@4:raise:rank=0:bucket=2"):
        load(worker, (4, new), 4)
    held = dict(worker.rollout.model.named_parameters())
    loaded = [name for bucket in new[:2] for name, *_ in bucket.entries]
    kept = [name for bucket in new[2:] for name, *_ in bucket.entries]
    sent = dict(actor.model.named_parameters())
    assert all(torch.equal(held[name], sent[name]) for name in loaded)  # version 4's first two buckets
    assert not any(torch.equal(held[name], sent[name]) for name in kept)  # the rest still version 3's
    assert worker.rollout.weights_version == 3 and not worker.synced
    prompts = Batch({"input_ids": torch.ones(1, 2, dtype=torch.long)}, meta={"policy_version": 3, "iteration": 5})
    with pytest.raises(VersionMismatchError, match="failed part way"):
        generate(worker, prompts)
    load(worker, (4, new), 4)  # the fault fired once: a complete load makes the worker usable again
    assert worker.synced and worker.rollout.weights_version == 4
    assert all(torch.equal(held[name], sent[name]) for name in held)


def test_a_receiver_that_stops_answering_fails_the_sender_which_still_reads_its_whole_weight_stream(
        engines: Any) -> None:
    """The root of a collective sync whose receiver never takes part (a rollout rank hung or dead mid-sync) fails at
    the group's timeout, and reads the rest of its weight stream first: producing it is a collective of the actor's
    own ranks (the FSDP gather), which must not be left blocked in it. The failed epoch is refused from then on."""
    actor, _ = engines
    names = [name for name, _ in actor.model.named_parameters()]
    read: list[str] = []

    def stream() -> Any:
        for name, tensor in actor.model.named_parameters():
            read.append(name)
            yield name, tensor

    rendezvous = SyncRendezvous(world_size=2, backend="gloo", timeout_s=3)
    spec = rendezvous.spec()

    def receive_first_bucket_only() -> None:
        receiver = WeightReceiver(spec, 1, expected_version=1)
        next(iter(receiver.named_tensors()))  # then it stops answering, its group member alive

    error, _ = _run(lambda: broadcast_weights(spec, stream(), version=1, bucket_bytes=4096), receive_first_bucket_only)
    assert isinstance(error, RuntimeError), error
    assert read == names
    # the next sync on that epoch (queued behind the failed one on the actor) fails at once instead of waiting the
    # whole timeout for members that will never join it, and reads its stream too; a fresh epoch is the way on
    read.clear()
    started = time.perf_counter()
    with pytest.raises(EngineError, match="epoch 0 failed"):
        broadcast_weights(spec, stream(), version=2, bucket_bytes=4096)
    assert time.perf_counter() - started < 1.0 and read == names
