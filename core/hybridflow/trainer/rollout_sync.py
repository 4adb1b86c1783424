"""The driver's side of an asynchronous run's weight syncs (docs/guide/async.md): a sync sends the actor's weights of a
version to the rollout pool behind what both have queued — the rollout worker fetches the actor's export from the
object store by reference, or the actor's rank 0 broadcasts to the rollout ranks (``rollout.weight_sync:
collective``) — and, with ``rollout.partial_rollout``, posts the export to the mailbox the rollout workers read
between the segments of a generation. A sync is checked (its load's report read, a failure raised) before a rollout
generated behind it is used (:meth:`WeightSyncs.check_through`). Stability: experimental."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hybridflow.config import Config
from hybridflow.workers.rollout import WeightsRef

__all__ = ["WeightSyncs"]


class WeightSyncs:
    """The syncs of one run's rollout pool (``pool_name``): the version the rollout pool was last sent
    (``synced_version``), the syncs dispatched and not yet checked, the collective group's rendezvous and the
    partial-rollout mailbox. Every sync and check adds to the step's ``async/weight_sync_*`` counters (``stats``)."""

    def __init__(self, config: Config, pool_name: str, *, timeout_s: float) -> None:
        self.config = config
        self.pool_name = pool_name
        self.timeout_s = timeout_s
        self.bucket_bytes = config.rollout.weight_sync_bucket_bytes
        self.weight_sync = config.rollout.weight_sync
        self.partial = config.rollout.partial_rollout
        self.synced_version: int | None = None
        #: a sync was forgotten (a failed step's): the rollout pool may hold other weights than ``synced_version``
        self.force = False
        self.retry_actor: Any = None  # the actor handle of the last sync (a regeneration syncs from it again)
        self.mailbox: Any = None  # rollout.partial_rollout: the Ray actor every export is posted to
        self._rendezvous: Any = None  # the collective sync group's store (built at the first collective sync)
        self._pending: list[tuple[int, Any, Any]] = []  # (version, export future, load future) not yet checked

    def start_mailbox(self) -> Any:
        """The partial-rollout mailbox (started on first use), handed to the rollout workers."""
        if self.mailbox is None:
            from hybridflow.workers.partial_rollout import start_weight_mailbox

            self.mailbox = start_weight_mailbox()
        return self.mailbox

    def send(self, actor: Any, version: int, rollout_call: Callable[[str], Any], stats: dict[str, float]) -> None:
        """Send the actor's weights (which must be ``version`` once its queued calls end) to the rollout pool,
        behind what each has queued (``rollout_call(method)``: the rollout pool's method); nothing when the rollout
        pool was already sent ``version`` and no sync was forgotten since."""
        self.retry_actor = actor
        if self.synced_version == version and not self.force:
            return
        self.force = False
        started = time.perf_counter()
        if self.weight_sync == "collective":  # the actor's rank 0 broadcasts, the rollout ranks receive
            group = self._group()
            export = actor.broadcast_generation_weights.submit(group, self.bucket_bytes)
            load = rollout_call("receive_weights")(group, version)
        else:  # the rollout worker fetches the export from the actor's output in the object store
            export = actor.export_generation_weights.submit(self.bucket_bytes)
            if self.mailbox is not None:  # a generation in flight may load it between two segments
                self.mailbox.post.remote(version, [export.output_ref(0)])
            load = rollout_call("load_weights")(WeightsRef(export.output_ref(0)), version)
        self._pending.append((version, export, load))
        stats["async/weight_sync_driver_s"] += time.perf_counter() - started
        self.synced_version = version

    def check_through(self, version: int, stats: dict[str, float]) -> None:
        """Wait for every sync of a version up to ``version`` (a failed one raises here) and count what it moved."""
        behind = [sync for sync in self._pending if sync[0] <= version]
        self._pending = [sync for sync in self._pending if sync[0] > version]
        for _, export, load in behind:
            loaded = load.get(timeout=self.timeout_s)[0]  # one_to_all: one report per rank, alike
            export.wait(timeout=self.timeout_s)  # its record reaches the ledger
            for key in ("bytes", "buckets", "wait_s", "load_s"):
                stats[f"async/weight_sync_{key}"] += loaded[key]
            if self.partial:  # loaded between two segments of a generation (else by the queued load)
                stats["async/weight_sync_in_flight"] += loaded.get("in_flight", 0.0)
            peak = "async/weight_sync_peak_bucket_bytes"
            stats[peak] = max(stats[peak], loaded["peak_bucket_bytes"])

    def keep_through(self, version: int) -> None:
        """Forget the unchecked syncs of versions after ``version`` (a failed step's, dispatched behind its update)."""
        self._pending = [sync for sync in self._pending if sync[0] <= version]

    def clear(self) -> None:
        """Forget every sync: the next one sends whatever version is asked (a run starting over from the actor)."""
        self._pending.clear()
        self.synced_version = None
        self.forget_posted()
        if self._rendezvous is not None:  # a sync may be half done on the old group: the next one builds a new one
            self._rendezvous.renew()

    def forget_posted(self) -> None:
        """Empty the mailbox (the exports of a failed attempt; the retry posts its own)."""
        if self.mailbox is not None:
            self.mailbox.clear.remote()

    def close(self) -> None:
        self._rendezvous = None  # the sync group's store (its members are gone)
        self.mailbox = None  # its last handle: Ray ends the actor

    def _group(self) -> Any:
        """The collective sync group's spec (its rendezvous store built on first use): the actor's rank 0 and every
        rollout rank; NCCL when both pools are on CUDA, else gloo; every collective bounded by the step deadline."""
        if self._rendezvous is None:
            from hybridflow.workers.weight_sync import SyncRendezvous

            pools = self.config.resource_pools
            cuda = pools[self.config.actor.pool].device == pools[self.pool_name].device == "cuda"
            self._rendezvous = SyncRendezvous(world_size=1 + pools[self.pool_name].world_size,
                                              backend="nccl" if cuda else "gloo", timeout_s=self.timeout_s)
        return self._rendezvous.spec()
