"""The workers of a split rollout (``rollout.pool``, docs/async.md): a rollout worker that only generates, on a pool
of its own, and the actor worker that exports its generation weights for it in bounded buckets.

Weights travel between the pools in buckets of at most ``bucket_bytes``, never through the driver
(:mod:`hybridflow.workers.weight_sync`, ``rollout.weight_sync``): through Ray's object store (the actor's rank 0
stores its export as its call's output and the rollout worker fetches it from there by its object ref,
:class:`WeightsRef`), or broadcast over a torch.distributed group of the actor's rank 0 and the rollout ranks
(:meth:`WeightExportingActor.broadcast_generation_weights` / :meth:`RolloutWorker.receive_weights`). When to sync
and how far generation may run ahead is :mod:`hybridflow.trainer.async_loop`'s business.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.controller import Worker, register
from hybridflow.engines import RolloutEngine, SamplingParams
from hybridflow.errors import EngineError, VersionMismatchError
from hybridflow.reliability.faults import FaultPlan, maybe_fail
from hybridflow.workers.roles import ActorRolloutWorker, RoleSpec
from hybridflow.workers.weight_sync import (
    BUCKET_BYTES,
    SyncGroupSpec,
    WeightBucket,
    WeightReceiver,
    broadcast_weights,
    pack_weight_buckets,
    unpack_weight_buckets,
)

__all__ = ["BUCKET_BYTES", "WeightBucket", "WeightsRef", "pack_weight_buckets", "unpack_weight_buckets",
           "RolloutWorker", "WeightExportingActor"]


@dataclass(frozen=True, slots=True)
class WeightsRef:
    """The object ref of the output of :meth:`WeightExportingActor.export_generation_weights` on the actor's rank 0
    (``BatchFuture.output_ref``): the rollout worker fetches the buckets itself, so the export can be dispatched
    behind the actor's update and the load behind the rollout's generation without the driver waiting for either."""

    ref: Any


class WeightExportingActor(ActorRolloutWorker):
    """The actor worker of a run with ``rollout.pool``: the hybrid engine plus :meth:`export_generation_weights`
    (``rollout.weight_sync: object_store``) and :meth:`broadcast_generation_weights` (``collective``)."""

    @register(protocol="one_to_all", idempotent=True)
    def export_generation_weights(self, bucket_bytes: int = BUCKET_BYTES) -> tuple[int, list[WeightBucket]] | None:
        """(policy version, the full generation weights in buckets) from rank 0; None from the other ranks (every
        rank runs: gathering sharded weights is collective)."""
        self._refuse_mid_step("export_generation_weights")
        target = getattr(self.rollout, "weights_target", "hf")
        weights = self.engine.generation_weights(target=target)
        if self.rank != 0:
            for _ in weights:  # consumed on every rank (a collective), kept on rank 0 only
                pass
            return None
        return self.policy_version, pack_weight_buckets(weights, bucket_bytes=bucket_bytes)

    @register(protocol="one_to_all")
    def broadcast_generation_weights(self, group: SyncGroupSpec, bucket_bytes: int = BUCKET_BYTES
                                     ) -> dict[str, float] | None:
        """Rank 0 broadcasts its generation weights, tagged with its policy version, to the rollout ranks of
        ``group`` (it is the root), one bucket at a time as they are gathered; the other ranks take part in the
        gather only. Rank 0 returns bytes, buckets, the largest bucket and the seconds taken."""
        self._refuse_mid_step("broadcast_generation_weights")
        target = getattr(self.rollout, "weights_target", "hf")
        weights = self.engine.generation_weights(target=target)
        if self.rank != 0:
            for _ in weights:
                pass
            return None
        return broadcast_weights(group, weights, version=self.policy_version, bucket_bytes=bucket_bytes)


class RolloutWorker(Worker):
    """Generates on a pool of its own with weights another pool sends (:meth:`load_weights`); no training engine.

    ``generate`` refuses prompts tagged with a ``policy_version`` other than the weights it holds, so the version a
    rollout reports is the version it ran at."""

    def __init__(self, spec: RoleSpec) -> None:
        super().__init__()
        if spec.rollout_engine is None or spec.rollout_config is None or spec.sampling is None:
            raise EngineError("the rollout worker needs rollout_engine, rollout_config and sampling in its RoleSpec")
        from hybridflow import registries
        from hybridflow.plugins import load_plugins

        torch.set_num_threads(spec.threads)
        load_plugins()
        self.spec = spec
        # fault injection (tests, bench/faults.py), off unless configured: the plan the actor's spec carries
        self.faults = FaultPlan.from_json(spec.extra["faults"]) if spec.extra.get("faults") else FaultPlan()
        factory = registries.rollout_engines.get(spec.rollout_engine)
        self.rollout: RolloutEngine = factory(config=spec.rollout_config, device=spec.device)
        self.synced = False
        self.bytes_received = 0
        self._seeded = spec.sampling.seed is not None and "seed" in self.rollout.capabilities
        if spec.sampling.seed is not None and not self._seeded and self.rank == 0:
            warnings.warn(f'rollout engine "{spec.rollout_engine}" cannot seed its sampling (no "seed" capability)',
                          stacklevel=1)

    @register(protocol="one_to_all", blocking=False, idempotent=True)
    def load_weights(self, exported: tuple[int, list[WeightBucket]] | WeightsRef,
                     expected_version: int | None = None) -> dict[str, float]:
        """Load the actor's exported weights (or fetch them first by their :class:`WeightsRef`, waiting for the
        export), tagged with its policy version, which must be ``expected_version`` when given. Returns the
        version, bytes and buckets loaded, the seconds spent waiting for the export and fetching + loading."""
        started = time.perf_counter()
        waited = 0.0
        payload: tuple[int, list[WeightBucket]] | None
        if isinstance(exported, WeightsRef):
            import ray

            ray.wait([exported.ref], num_returns=1, timeout=None, fetch_local=False)  # the actor's update + export
            waited = time.perf_counter() - started
            payload = ray.get(exported.ref)
        else:
            payload = exported
        if payload is None:
            raise EngineError("the actor's rank 0 exported no weights (its export_generation_weights returned None)")
        version, buckets = payload
        if expected_version is not None and int(version) != int(expected_version):
            raise VersionMismatchError(f"the actor exported weights of version {version}; the rollout pool expects "
                                       f"version {expected_version} (did the update before the export fail?)")
        self.rollout.update_weights(unpack_weight_buckets(buckets), version=int(version))
        nbytes = sum(bucket.nbytes for bucket in buckets)
        self.bytes_received += nbytes
        self.synced = True
        return {"version": float(version), "bytes": float(nbytes), "buckets": float(len(buckets)),
                "peak_bucket_bytes": float(max((bucket.nbytes for bucket in buckets), default=0)),
                "wait_s": waited, "load_s": time.perf_counter() - started - waited}

    @register(protocol="one_to_all", blocking=False)
    def receive_weights(self, group: SyncGroupSpec, expected_version: int) -> dict[str, float]:
        """Receive the weights the actor's rank 0 broadcasts over ``group`` (this worker at rank 1 + its rank) and
        stream them into the engine bucket by bucket; every bucket's version tag must be ``expected_version``
        (:class:`VersionMismatchError` otherwise, nothing loaded). Returns what :meth:`load_weights` does, plus the
        largest bucket's bytes."""
        receiver = WeightReceiver(group, 1 + self.rank, expected_version=expected_version)
        try:
            self.rollout.update_weights(receiver.named_tensors(), version=int(expected_version))
        finally:
            receiver.drain()  # the engine refused a tensor mid-stream: the root still sends, keep the group in step
        stats = receiver.stats()
        self.bytes_received += receiver.bytes
        self.synced = True
        return stats

    @register(protocol="one_to_all", idempotent=True)
    def weights_version(self) -> int:
        return int(self.rollout.weights_version)

    @register(protocol="dp_compute", blocking=False, idempotent=True)
    def generate(self, prompts: Batch) -> Batch:
        expected = prompts.meta.get("policy_version")
        if not self.synced or (expected is not None and int(expected) != self.rollout.weights_version):
            raise VersionMismatchError(
                f"rollout worker asked to generate at policy_version {expected} but holds weights version "
                f"{self.rollout.weights_version if self.synced else 'none (never synced)'}; sync the weights first")
        sampling = self.spec.sampling
        assert sampling is not None
        if not self._seeded:
            sampling = replace(sampling, seed=None)
        elif sampling.seed is not None:  # the actor worker's stream: per iteration and generation replica
            iteration = int(prompts.meta.get("iteration") or 0)
            replica = int(prompts.meta.get("chunk") or 0) * self.world_size + self.rank  # a streamed step's chunk
            sampling = SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                      top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens,
                                      seed=sampling.seed + 1000 * iteration + replica)
        out = self.rollout.generate(prompts, sampling)
        tag = prompts.meta.get("iteration")
        maybe_fail("rollout.generate", iteration=None if tag is None else int(tag), rank=self.rank, plan=self.faults)
        if out.meta.get("policy_version") != self.rollout.weights_version:
            raise VersionMismatchError(f"rollout engine tagged its output policy_version "
                                       f"{out.meta.get('policy_version')} but holds weights version "
                                       f"{self.rollout.weights_version}")
        return out

    def counters(self) -> dict[str, float]:
        return {"weight_sync_bytes_received": float(self.bytes_received)}
