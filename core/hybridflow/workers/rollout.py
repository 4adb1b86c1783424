"""The workers of a split rollout (``rollout.pool``, docs/guide/async.md): a rollout worker that only generates, on a
pool of its own, and the actor worker that exports its generation weights for it in bounded buckets.

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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.controller import Worker, register
from hybridflow.engines import (
    KVCacheReuseEngine,
    RolloutEngine,
    SamplingParams,
    TokenContinuationEngine,
    rollout_engine_info,
)
from hybridflow.errors import EngineError, VersionMismatchError
from hybridflow.reliability.faults import FaultPlan, maybe_fail
from hybridflow.workers.base import close_engine
from hybridflow.workers.partial_rollout import SEGMENT_SEED_STRIDE, SegmentedRollout, unpadded_prompts
from hybridflow.workers.roles import ActorRolloutWorker, RoleSpec
from hybridflow.workers.weight_sync import (
    BUCKET_BYTES,
    SyncGroupSpec,
    WeightBucket,
    WeightReceiver,
    broadcast_weights,
    close_sync_groups,
    pack_weight_buckets,
    unpack_weight_buckets,
)

#: seconds a rollout worker waits for the weight mailbox's answer or an export it found done (both local calls)
MAILBOX_TIMEOUT_S = 120.0

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

    def close(self) -> None:
        close_sync_groups()
        super().close()

    @register(protocol="one_to_all", idempotent=True)
    def export_generation_weights(self, bucket_bytes: int = BUCKET_BYTES) -> tuple[int, list[WeightBucket]] | None:
        """(policy version, the full generation weights in buckets) from rank 0; None from the other ranks (every
        rank runs: gathering sharded weights is collective)."""
        self._refuse_mid_step("export_generation_weights")
        target = self.rollout_info.weights_target
        weights = self.engine.generation_weights(target=target)
        if self.rank != 0:
            for _ in weights:  # consumed on every rank (a collective), kept on rank 0 only
                pass
            return None
        return self.policy_version, pack_weight_buckets(self._in_generation_dtype(weights), bucket_bytes=bucket_bytes)

    @register(protocol="one_to_all")
    def broadcast_generation_weights(self, group: SyncGroupSpec, bucket_bytes: int = BUCKET_BYTES
                                     ) -> dict[str, float] | None:
        """Rank 0 broadcasts its generation weights, tagged with its policy version, to the rollout ranks of
        ``group`` (it is the root), one bucket at a time as they are gathered; the other ranks take part in the
        gather only. Rank 0 returns bytes, buckets, the largest bucket and the seconds taken."""
        self._refuse_mid_step("broadcast_generation_weights")
        target = self.rollout_info.weights_target
        weights = self.engine.generation_weights(target=target)
        if self.rank != 0:
            for _ in weights:
                pass
            return None
        return broadcast_weights(group, self._in_generation_dtype(weights), version=self.policy_version,
                                 bucket_bytes=bucket_bytes)

    def _in_generation_dtype(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights cast to the rollout pool's generation dtype (``rollout.dtype``; bf16 when the actor computes in
        bf16) before they are bucketed: half the bytes of an fp32 sync, and the rollout engine binds them as they
        come instead of casting a copy."""
        assert self.spec.rollout_config is not None
        dtype = getattr(torch, str(self.spec.rollout_config.model.dtype))
        for name, tensor in weights:
            yield name, tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor


class RolloutWorker(Worker):
    """Generates on a pool of its own with weights another pool sends (:meth:`load_weights`); no training engine.

    ``generate`` refuses prompts tagged with a ``policy_version`` other than the weights it holds, so the version a
    rollout reports is the version it ran at.

    With ``partial_rollout_tokens`` (``rollout.partial_rollout``) ``generate`` samples in segments of at most that
    many new tokens (:class:`~hybridflow.workers.partial_rollout.SegmentedRollout`, through the engine's
    ``generate_from_tokens``) and, between two segments, loads the newest weight export posted to
    ``weight_mailbox`` if it is done: prompts tagged ``policy_version`` v then run under v or newer weights, and each
    token's version is in the output's ``token_versions`` column. A queued :meth:`load_weights` of weights already
    loaded that way (or older than the engine's) loads nothing."""

    def __init__(self, spec: RoleSpec, *, partial_rollout_tokens: int | None = None,
                 weight_mailbox: Any = None) -> None:
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
        self.segment_tokens = partial_rollout_tokens
        self.mailbox = weight_mailbox
        # version → (object ref id, load report) of the exports loaded between two segments of a partial rollout
        self._loaded_in_flight: dict[int, tuple[str, dict[str, float]]] = {}
        self.weights_loaded_in_flight = 0
        if partial_rollout_tokens is not None and (
                "continue_from_tokens" not in self.rollout.capabilities
                or not isinstance(self.rollout, TokenContinuationEngine)):
            raise EngineError(f"rollout.partial_rollout continues each unfinished row from its tokens so far, which "
                              f"needs a rollout engine with capability continue_from_tokens; rollout engine "
                              f"{spec.rollout_engine!r} ({type(self.rollout).__name__}) has "
                              f"{sorted(self.rollout.capabilities)}. Fix: use rollout.engine=hf, or set "
                              "rollout.partial_rollout=false")
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
        if isinstance(exported, WeightsRef) and expected_version is not None and self.segment_tokens is not None:
            ahead = self._loaded_ahead(exported, int(expected_version))
            if ahead is not None:
                return ahead
        waited = 0.0
        payload: tuple[int, list[WeightBucket]] | None
        if isinstance(exported, WeightsRef):
            import ray

            ray.wait([exported.ref], num_returns=1, timeout=None, fetch_local=False)  # the actor's update + export
            waited = time.perf_counter() - started
            payload = ray.get(exported.ref)
        else:
            payload = exported
        return self._load_payload(payload, expected_version, started=started, waited=waited)

    def _load_payload(self, payload: tuple[int, list[WeightBucket]] | None, expected_version: int | None, *,
                      started: float, waited: float) -> dict[str, float]:
        if payload is None:
            raise EngineError("the actor's rank 0 exported no weights (its export_generation_weights returned None)")
        version, buckets = payload
        if expected_version is not None and int(version) != int(expected_version):
            raise VersionMismatchError(f"the actor exported weights of version {version}; the rollout pool expects "
                                       f"version {expected_version} (did the update before the export fail?)")
        self.synced = False  # until every bucket is in: a load failing part way leaves no weights to generate with
        self.rollout.update_weights(self._bucket_stream(buckets, int(version)), version=int(version))
        nbytes = sum(bucket.nbytes for bucket in buckets)
        self.bytes_received += nbytes
        self.synced = True
        return {"version": float(version), "bytes": float(nbytes), "buckets": float(len(buckets)),
                "peak_bucket_bytes": float(max((bucket.nbytes for bucket in buckets), default=0)),
                "wait_s": waited, "load_s": time.perf_counter() - started - waited}

    def _bucket_stream(self, buckets: list[WeightBucket], version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The buckets' named tensors, streamed; the ``rollout.load_weights`` fault point between two buckets."""
        for index, bucket in enumerate(buckets):
            self._before_bucket(index, version)
            yield from unpack_weight_buckets([bucket])

    def _before_bucket(self, index: int, version: int) -> None:
        """Buckets 0..index-1 of the weights of ``version`` are in the engine, bucket ``index`` not yet."""
        if self.faults.active:
            maybe_fail("rollout.load_weights", iteration=version, rank=self.rank, bucket=index, plan=self.faults)

    def _loaded_ahead(self, exported: WeightsRef, expected_version: int) -> dict[str, float] | None:
        """The report of a queued load that a partial rollout made already (this very export, loaded between two
        segments: its report, counted once) or made pointless (the engine holds newer weights: nothing loaded);
        None when it must load."""
        loaded = self._loaded_in_flight.pop(expected_version, None)
        if loaded is not None and loaded[0] == exported.ref.hex():
            return {**loaded[1], "in_flight": 1.0}
        if self.synced and self.rollout.weights_version > expected_version:
            return {"version": float(expected_version), "bytes": 0.0, "buckets": 0.0, "peak_bucket_bytes": 0.0,
                    "wait_s": 0.0, "load_s": 0.0, "superseded": 1.0}
        return None

    def _load_posted_weights(self) -> None:
        """Between two segments of a partial rollout: load the newest export posted to the mailbox if it is newer
        than the engine's weights and done (the actor's update and export finished); else go on unchanged."""
        import ray
        from ray.exceptions import RayError

        posted = ray.get(self.mailbox.newer_than.remote(self.rollout.weights_version), timeout=MAILBOX_TIMEOUT_S)
        if posted is None:
            return
        version, (ref,) = posted
        ready, _ = ray.wait([ref], num_returns=1, timeout=0, fetch_local=False)
        if not ready:
            return
        started = time.perf_counter()
        try:
            payload = ray.get(ref, timeout=MAILBOX_TIMEOUT_S)
        except RayError:  # a failed export: the queued load_weights of this version raises it, with its step
            return
        if payload is None or int(payload[0]) != int(version):  # likewise (a version mismatch)
            return
        report = self._load_payload(payload, int(version), started=started, waited=0.0)
        self._loaded_in_flight[int(version)] = (ref.hex(), report)
        while len(self._loaded_in_flight) > 16:  # reports whose queued load was forgotten (a reset step)
            self._loaded_in_flight.pop(min(self._loaded_in_flight))
        self.weights_loaded_in_flight += 1

    @register(protocol="one_to_all", blocking=False)
    def receive_weights(self, group: SyncGroupSpec, expected_version: int) -> dict[str, float]:
        """Receive the weights the actor's rank 0 broadcasts over ``group`` (this worker at rank 1 + its rank) and
        stream them into the engine bucket by bucket; every bucket's version tag must be ``expected_version``
        (:class:`VersionMismatchError` otherwise, nothing loaded). Returns what :meth:`load_weights` does, plus the
        largest bucket's bytes."""
        receiver = WeightReceiver(group, 1 + self.rank, expected_version=expected_version,
                                  before_bucket=lambda index: self._before_bucket(index, int(expected_version)))
        self.synced = False  # until every bucket is in (a sync failing part way leaves no weights to generate with)
        try:
            self.rollout.update_weights(receiver.named_tensors(), version=int(expected_version))
        finally:
            receiver.drain()  # the engine refused a tensor mid-stream: the root still sends, keep the group in step
        stats = receiver.stats()
        self.bytes_received += receiver.bytes
        self.synced = True
        return stats

    def reusable_process(self) -> bool:
        """The rollout engine declared ``reusable_process`` (its info record)."""
        assert self.spec.rollout_engine is not None
        return rollout_engine_info(self.spec.rollout_engine).reusable_process

    def close(self) -> None:
        close_sync_groups()
        close_engine(self.rollout)

    @register(protocol="one_to_all", idempotent=True)
    def weights_version(self) -> int:
        return int(self.rollout.weights_version)

    @register(protocol="dp_compute", blocking=False, idempotent=True)
    def generate(self, prompts: Batch) -> Batch:
        expected = prompts.meta.get("policy_version")
        held = self.rollout.weights_version
        # a partial rollout may run under weights newer than its tag (loaded between the segments of the last one)
        behind = expected is not None and (int(expected) > held if self.segment_tokens is not None
                                           else int(expected) != held)
        if not self.synced or behind:
            held_text = (f"weights version {held}" if self.synced else
                         "no complete weights (never synced, or its last load failed part way)")
            raise VersionMismatchError(f"rollout worker asked to generate at policy_version {expected} but holds "
                                       f"{held_text}; sync the weights first")
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
        if self.segment_tokens is not None:
            out = self._generate_in_segments(prompts, sampling, self.segment_tokens,
                                             held if expected is None else int(expected))
        else:
            out = self.rollout.generate(prompts, sampling)
        tag = prompts.meta.get("iteration")
        maybe_fail("rollout.generate", iteration=None if tag is None else int(tag), rank=self.rank, plan=self.faults)
        if self.segment_tokens is None and out.meta.get("policy_version") != self.rollout.weights_version:
            raise VersionMismatchError(f"rollout engine tagged its output policy_version "
                                       f"{out.meta.get('policy_version')} but holds weights version "
                                       f"{self.rollout.weights_version}")
        return out

    def _generate_in_segments(self, prompts: Batch, sampling: SamplingParams, segment_tokens: int,
                              version: int) -> Batch:
        """A partial rollout: every unfinished row continued by at most ``segment_tokens`` ids per call, the newest
        posted weights loaded between two calls (their keys/values then rebuilt: the engine drops its kept ones on
        new weights); each token recorded with the version that sampled it."""
        engine = self.rollout
        assert isinstance(engine, TokenContinuationEngine)  # checked in __init__
        config = self.spec.rollout_config
        assert config is not None
        rows = prompts.repeat_interleave(sampling.n) if sampling.n > 1 else prompts
        state = SegmentedRollout(unpadded_prompts(rows), max_new_tokens=sampling.max_new_tokens,
                                 segment_tokens=segment_tokens)
        reuse = engine if "kv_cache_reuse" in engine.capabilities and isinstance(engine, KVCacheReuseEngine) else None
        keys = [("partial_rollout", id(state), row) for row in range(len(rows))]
        try:
            while active := state.unfinished():
                if state.segments and self.mailbox is not None:
                    self._load_posted_weights()
                budget = state.budget(active)
                seed = None if sampling.seed is None else sampling.seed + SEGMENT_SEED_STRIDE * state.segments
                segment = replace(sampling, n=1, max_new_tokens=budget, seed=seed)
                prefixes = state.prefixes(active)
                if reuse is not None:  # keys/values kept between segments under the same weights
                    completions = reuse.generate_from_tokens(prefixes, segment,
                                                             cache_keys=[keys[row] for row in active])
                else:
                    completions = engine.generate_from_tokens(prefixes, segment)
                state.extend(active, completions, version=engine.weights_version, budget=budget)
        finally:
            if reuse is not None:
                reuse.release_cache(keys)
        return state.to_batch(rows, pad_token_id=config.pad_token_id, policy_version=version)

    def counters(self) -> dict[str, float]:
        counters = {"weight_sync_bytes_received": float(self.bytes_received)}
        if self.segment_tokens is not None:
            counters["weights_loaded_in_flight"] = float(self.weights_loaded_in_flight)
        return counters
