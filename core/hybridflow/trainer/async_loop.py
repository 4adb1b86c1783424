"""Asynchronous RL on a split rollout (``rollout.pool``, docs/guide/async.md): a rollout pool generates iterations up to
``trainer.max_staleness`` = k ahead of the actor, and every rollout is checked against that bound with its policy
version tag when it reaches the trainer: groups generated more than k versions behind the weights they would update
are dropped and counted, never trained on.

Schedule: iteration j is generated under the weights the actor had after step j − k (version max(0, j − k)). The
moment a step's ``actor.update_policy`` is dispatched, the weight export is dispatched behind it on the actor, the
load behind the rollout pool's queued generation (it fetches the buckets from the actor's output by object ref, or
receives them over a torch.distributed broadcast: ``rollout.weight_sync``) and
iteration step + 1 + k behind that: the hand-over from update to generation needs no driver round trip, and the
rollout pool (:class:`~hybridflow.workers.rollout.RolloutWorker`) generates while the actor trains. k = 0 is
synchronous generation on the rollout pool. The algorithm's dataflow is untouched: its ``actor.generate`` call of a
step is answered with that step's rollout. Recovery: the trainer attaches the rollout pool to its supervisor, which
restarts it when one of its calls failed (a rollout worker died), and the retried step syncs the actor's current
weights again, version-checked; a failed step that leaves the rollout pool alive keeps the generations that stay
valid (:meth:`AsyncRollout.abort_step`). Streaming (``trainer.stream_mini_batches``): an iteration is generated
as one call per chunk of ``actor.mini_batch_size`` rows, and the step claims each chunk as it finishes
(:meth:`AsyncRollout.claim` of a chunk's prompts). Partial rollout (``rollout.partial_rollout``): every weight
export is also posted to a mailbox the rollout workers read between the segments of their generation, so an update
that ends while a generation is in flight is loaded before its next segment; a row's staleness is its oldest
token's (:func:`~hybridflow.trainer.staleness.oldest_token_versions`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.algorithms.helpers import split_prompt_chunks, stream_chunk_count
from hybridflow.batch import Batch
from hybridflow.config import Config
from hybridflow.controller.handles import node_method
from hybridflow.data import PromptLoader
from hybridflow.errors import ConfigError, VersionMismatchError
from hybridflow.trainer.build import RolePlan, build_resource_pool, release_worker_group
from hybridflow.trainer.rollout_source import StepStart
from hybridflow.trainer.rollout_sync import WeightSyncs
from hybridflow.trainer.staleness import (
    STALENESS_COLUMN,
    TOKEN_VERSIONS,
    enforce_staleness,
    oldest_token_versions,
    partial_rollout_metrics,
    use_weight_exporting_actor,
)

if TYPE_CHECKING:
    from hybridflow.reliability import Supervisor
    from hybridflow.trainer.build import Groups

__all__ = ["STALENESS_COLUMN", "AsyncRollout", "enforce_staleness", "use_weight_exporting_actor"]


@dataclass(slots=True)
class PendingRollout:
    """A generation dispatched to the rollout pool: its iteration, prompts, weights version and result (a future,
    or a Batch once fetched; a list of them, one per chunk, in a streamed run)."""

    iteration: int
    prompts: Batch
    version: int
    source: Any


class AsyncRollout:
    """The rollout pool of a run, the generations in flight on it and the staleness bound. Stability: experimental.

    One of the trainer's rollout sources (:class:`~hybridflow.trainer.rollout_source.RolloutSource`): the trainer
    calls :meth:`start` once, :meth:`begin_step` / :meth:`end_step` around each algorithm step (:meth:`abort_step`
    when a step fails; recovery calls :meth:`reset` when it restarts the pool) and :meth:`close` at the end."""

    def __init__(self, config: Config, loader: PromptLoader, plans: list[RolePlan]) -> None:
        if config.rollout.pool is None:
            raise ConfigError("AsyncRollout needs rollout.pool (the pool the rollout generates on)")
        self.config = config
        self.pool_name = config.rollout.pool
        self.max_staleness = config.trainer.max_staleness
        self.total_steps = config.trainer.total_steps
        self.timeout_s = config.trainer.deadline_s
        #: per-node deadlines (reliability.deadlines["rollout.generate"], ...) of the rollout pool's calls, counted
        #: from dispatch: a generation queued ahead waits inside its deadline
        self.deadlines = dict(config.reliability.deadlines)
        self.weight_sync = config.rollout.weight_sync
        #: the weight syncs from the actor: the version last sent, the ones not yet checked, the mailbox (partial)
        self.syncs = WeightSyncs(config, self.pool_name, timeout_s=self.timeout_s)
        #: dispatch the sync and the next generation right behind the step's update (else once the step returned:
        #: a driver round trip later, the schedule before; bench/async.py's ablation)
        self.sync_behind_update = True
        #: chunks per iteration (trainer.stream_mini_batches; else 1) and whether the step claims them one by one
        #: (False: the chunks' rollouts concatenated, claimed at once: the barrier the streaming test compares with)
        self.chunks = stream_chunk_count(config)
        self.stream = self.chunks > 1
        #: rollout.partial_rollout: the weight mailbox (a Ray actor, built at start) every export is posted to
        self.partial = config.rollout.partial_rollout
        self._partial_claimed: dict[int, dict[str, float]] = {}  # iteration → its partial-rollout metrics
        self.loader = loader
        from hybridflow.workers import RoleSpec

        actor = next(plan for plan in plans if plan.role == "actor")
        assert isinstance(actor.spec, RoleSpec)  # the actor is planned with a training engine
        device = config.resource_pools[self.pool_name].device
        self.spec = replace(actor.spec, name="rollout", device=device, loss=None)
        self.pool: Any = None
        self.group: Any = None
        self.pending: deque[PendingRollout] = deque()
        self.dropped_total = 0
        self._step: int | None = None  # the step between begin_step and end_step
        self._sent_after_update: int | None = None  # the step whose update the sync was dispatched behind
        self._last_dispatched: int | None = None  # the last iteration queued on the rollout pool
        self._before_update: tuple[Any, int | None, int | None] | None = None  # (shadow loader, synced, last)
        self._claimed_batch: tuple[int, list[str], Batch] | None = None  # the current step's rollout, once claimed
        self._streamed: PendingRollout | None = None  # a streamed step's generation, once its first chunk is claimed
        self._claimed_chunks: dict[int, Batch] = {}  # its chunks claimed so far (a retry gets the same rows)
        self._shadow: PromptLoader | None = None
        self._current: Batch | None = None
        self._stats: dict[str, float] = {}
        # iteration → (staleness of each row handed to the step, rows dropped): a retried step whose journal reuses
        # the rollout it was handed (claim not called again) reports the same numbers
        self._claimed: dict[int, tuple[list[int], int, bool]] = {}

    # --- lifecycle ----------------------------------------------------------------------------------------
    def start(self, groups: Groups, supervisor: Supervisor, *, observers: list[Any], deadline_s: float,
              stack_dump_dir: str | None) -> None:
        """Create the rollout pool's worker group (its engine gets weights at the first :meth:`begin_step`) and
        attach it to the run's supervisor: recovery restarts the rollout pool too (its failed calls name it)."""
        from hybridflow.controller import WorkerGroup
        from hybridflow.workers.rollout import RolloutWorker

        init: dict[str, Any] = {"spec": self.spec}
        if self.partial:
            init.update(partial_rollout_tokens=self.config.rollout.partial_rollout_tokens,
                        weight_mailbox=self.syncs.start_mailbox())
        self.pool = build_resource_pool(self.pool_name, self.config.resource_pools[self.pool_name])
        self.group = WorkerGroup(self.pool, {"rollout": RolloutWorker}, init_kwargs={"rollout": init},
                                 name=self.pool_name, deadline_s=deadline_s, stack_dump_dir=stack_dump_dir,
                                 observers=[*observers, self._observe])
        supervisor.attach_group(self.pool_name, self.group, restart_with=self.linked_pools(), on_restart=self.reset)

    def linked_pools(self) -> set[str]:
        """The pools whose restart must restart the rollout pool too: the actor's with ``weight_sync: collective``
        (the rollout ranks may be blocked in a broadcast from its dead rank 0), else none (a sync from a dead actor
        fails on its own, and the retried step syncs again)."""
        return {self.config.actor.pool} if self.weight_sync == "collective" else set()

    def _observe(self, record: Any) -> None:
        """Time the rollout pool spent generating, summed per step (a load's time is mostly waiting for the
        actor's export: ``async/weight_sync_wait_s`` / ``_load_s``)."""
        if record.method == "generate" and record.compute_seconds_per_rank:
            self._stats["async/rollout_busy_s"] = self._stats.get("async/rollout_busy_s", 0.0) + max(
                record.compute_seconds_per_rank)

    def close(self) -> None:
        self.reset()
        release_worker_group(self.group, self.pool)
        self.group = self.pool = None
        self.syncs.close()

    def reset(self) -> None:
        """Forget the generations in flight (the next step starts over from the actor's weights)."""
        self.pending.clear()
        self.syncs.clear()
        self._shadow = self._current = self._claimed_batch = self._before_update = self._streamed = None
        self._step = self._sent_after_update = self._last_dispatched = None
        self._claimed_chunks = {}

    def abort_step(self) -> None:
        """A failed step, to be retried: keep the generations queued before it and the rollout it claimed (their
        weights were exported before the step's own calls, and recovery brings the actor back to the step's version,
        so they stay valid and the retry trains on what the clean run would); forget the sync and generation
        dispatched behind its update (the retry dispatches them again). A restarted rollout pool forgets everything
        (:meth:`reset`, called by recovery), as does the collective sync (a broadcast may be half done)."""
        step = self._step
        self.syncs.forget_posted()  # the exports of the failed attempt (the retry posts its own)
        if step is None or self.weight_sync == "collective" or (not self.pending and self._claimed_batch is None
                                                                 and self._streamed is None):
            self.reset()
            return
        if self._sent_after_update == step and self._before_update is not None:
            self.syncs.keep_through(step)
            self.pending = deque(entry for entry in self.pending if entry.version <= step)
            shadow, self.syncs.synced_version, self._last_dispatched = self._before_update
            if self._shadow is not None:
                self._shadow.load_state_dict(shadow)
            self.syncs.force = True  # its load may still run on the rollout pool: sync before the next dispatch
        self._current = self._step = self._sent_after_update = self._before_update = None

    def wrap_actor(self, actor: Any) -> Any:
        """The actor handle the algorithm's step gets: its ``generate`` of the step's prompts comes from here."""
        from hybridflow.trainer.async_actor import ActorWithRolloutPool

        return ActorWithRolloutPool(self, actor)

    def stream_chunks(self) -> int:
        """Chunks a step streams in (trainer.stream_mini_batches: claimed from the rollout pool one by one)."""
        return self.chunks if self.stream else 1

    # --- per step -----------------------------------------------------------------------------------------
    def begin_step(self, step: int, prompts: Batch, actor: Any) -> StepStart:
        """Before step ``step`` (actor weights at version ``step``): its rollout in flight, and the next ones up to
        ``step + k`` (under the latest weights sent)."""
        self._begin_step(step, prompts, actor)
        return StepStart(prompts, False)

    def _begin_step(self, step: int, prompts: Batch, actor: Any) -> None:
        self._current, self._step = prompts, step
        self._stats = {key: 0.0 for key in _STEP_STATS}
        if self.partial:
            self._stats["async/weight_sync_in_flight"] = 0.0  # syncs checked this step that loaded mid-generation
        if not self._queued_for(step, prompts):
            self.reset()
            self._current, self._step = prompts, step
            self._shadow = PromptLoader(self.loader.dataset, batch_size=self.loader.batch_size,
                                        seed=self.loader.seed, shuffle=self.loader.shuffle)
            self._shadow.load_state_dict(self.loader.state_dict())  # positioned after this step's prompts
            self._sync(actor, step)
            self._dispatch(step, prompts)
        last = min(step + self.max_staleness, self.total_steps - 1)
        while self._last_dispatched is not None and self._last_dispatched < last:
            assert self._shadow is not None
            self._dispatch(self._last_dispatched + 1, self._shadow.next_batch())

    def _queued_for(self, step: int, prompts: Batch) -> bool:
        """Whether the rollout pool's queue starts at ``step``'s prompts (or holds the next ones, the step's own
        rollout claimed by a failed attempt of it)."""
        head = self.pending[0] if self.pending else None
        if self._streamed is not None:
            return self._streamed.iteration == step and _uids(self._streamed.prompts) == _uids(prompts) and (
                head is None or head.iteration == step + 1)
        if self._claimed_batch is not None:
            claimed, uids, _ = self._claimed_batch
            return claimed == step and uids == _uids(prompts) and (head is None or head.iteration == step + 1)
        return head is not None and head.iteration == step and _uids(head.prompts) == _uids(prompts)

    def after_update_dispatched(self, actor: Any) -> None:
        """Right after the current step's update is dispatched (actor at ``step + 1`` once it ends): the weight
        export behind it, the load and iteration step + 1 + k behind the rollout pool's queue; once per step."""
        if self._step is None or self._sent_after_update == self._step:
            return
        step, self._sent_after_update = self._step, self._step
        following = step + 1 + self.max_staleness
        if following < self.total_steps:
            assert self._shadow is not None
            self._before_update = (self._shadow.state_dict(), self.syncs.synced_version, self._last_dispatched)
            self._sync(actor, step + 1)
            self._dispatch(following, self._shadow.next_batch())

    def end_step(self, step: int, actor: Any) -> dict[str, float]:
        """After step ``step``'s update (actor at ``step + 1``): the sync and iteration step + 1 + k if the update
        did not dispatch them (a retried step reusing its update); returns the step's ``async/*`` metrics."""
        self.after_update_dispatched(actor)
        self._current = self._step = self._claimed_batch = self._before_update = self._streamed = None
        self._claimed_chunks = {}
        staleness, dropped, regenerated = self._claimed.get(step, ([0], 0, False))
        self._claimed = {iteration: value for iteration, value in self._claimed.items() if iteration > step}
        metrics = dict(self._stats)
        metrics.update({
            "async/dropped_stale_samples": float(dropped),
            "async/regenerated": float(regenerated),
            "async/max_staleness": float(self.max_staleness),
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/staleness_max": float(max(staleness)),
            "async/dropped_stale_samples_total": float(self.dropped_total),
            "async/in_flight": float(len(self.pending)),
        })
        for age in range(self.max_staleness + 1):  # the staleness histogram, as fractions of the rows trained on
            metrics[f"async/staleness_frac_{age}"] = staleness.count(age) / len(staleness)
        if self.partial:
            metrics.update(self._partial_claimed.get(step, {}))
            self._partial_claimed = {i: value for i, value in self._partial_claimed.items() if i > step}
        return metrics

    def owns(self, prompts: Any) -> bool:
        """Whether ``prompts`` is the current step's batch, or a chunk of it (answered from the rollout pool)."""
        if self._current is None or not isinstance(prompts, Batch):
            return False
        if prompts is self._current:
            return True
        return (self.stream and prompts.meta.get("chunks") == self.chunks
                and prompts.meta.get("iteration") == self._current.meta.get("iteration"))

    def claim(self, prompts: Batch) -> Batch:
        """The current step's rollout, fetched, version-checked and tagged with the actor's version: groups beyond
        the staleness bound are dropped and counted; none left, it is generated again under the current weights."""
        step = int(prompts.meta["iteration"])
        if "chunk" in prompts.meta:
            return self._claim_chunk(step, int(prompts.meta["chunk"]))
        if self._claimed_batch is not None and self._claimed_batch[0] == step:  # a retry: the rollout it had
            claimed = self._claimed_batch[2]
            return Batch(claimed.tensors.copy(), dict(claimed.non_tensors), dict(claimed.meta))
        entry = self.pending.popleft()
        if entry.iteration != step:
            raise VersionMismatchError(f"the rollout pool's next generation is iteration {entry.iteration}, the step "
                                       f"asks for iteration {step}; the trainer must call begin_step first")
        started = time.perf_counter()
        batch = self._fetch(entry)
        kept, dropped = enforce_staleness(batch, version=step, max_staleness=self.max_staleness)
        self.dropped_total += dropped
        all_stale = kept is None
        if kept is None:  # everything stale: generate this step again under the actor's current weights
            if self.syncs.retry_actor is None:
                raise VersionMismatchError(f"every sample of iteration {step} was beyond the staleness bound")
            self._sync(self.syncs.retry_actor, step)
            regenerated = self._dispatch(step, entry.prompts, queue=False)
            kept, _ = enforce_staleness(self._fetch(regenerated), version=step, max_staleness=self.max_staleness)
            assert kept is not None  # generated at the current version: staleness 0
        self._stats["async/wait_s"] = time.perf_counter() - started
        self._claimed[step] = ([step - int(v) for v in kept[STALENESS_COLUMN].tolist()], dropped, all_stale)
        if TOKEN_VERSIONS in kept:
            self._partial_claimed[step] = partial_rollout_metrics(kept, step)
        kept = kept.with_meta(iteration=step, policy_version=step)
        self._claimed_batch = (step, _uids(entry.prompts), kept)
        return Batch(kept.tensors.copy(), dict(kept.non_tensors), dict(kept.meta))

    def _claim_chunk(self, step: int, chunk: int) -> Batch:
        """Chunk ``chunk`` of the current step's rollout (a streamed step), fetched the moment it is generated,
        checked row by row against the bound and tagged with the actor's version. The whole iteration's version is
        checked at its first chunk, before anything of it trains: a generation beyond the bound is dropped and
        generated again (every chunk) under the actor's current weights; rows beyond it inside a chunk (rows of one
        generation share its version, so only re-tagged rows) are dropped with their groups."""
        if chunk in self._claimed_chunks:  # a retry: the rows it had
            claimed = self._claimed_chunks[chunk]
            return Batch(claimed.tensors.copy(), dict(claimed.non_tensors), dict(claimed.meta))
        started = time.perf_counter()
        if self._streamed is None:
            entry = self.pending.popleft()
            if entry.iteration != step:
                raise VersionMismatchError(f"the rollout pool's next generation is iteration {entry.iteration}, the "
                                           f"step asks for iteration {step}; the trainer must call begin_step first")
            stale_rows = 0
            if step - entry.version > self.max_staleness:
                if self.syncs.retry_actor is None:
                    raise VersionMismatchError(f"iteration {step} was generated beyond the staleness bound")
                stale_rows = len(entry.prompts) * self.config.rollout.n
                self.dropped_total += stale_rows
                self._sync(self.syncs.retry_actor, step)
                entry = self._dispatch(step, entry.prompts, queue=False)
            self._streamed = entry
            self._claimed[step] = ([], stale_rows, stale_rows > 0)
        batch = self._fetch(self._streamed, chunk)
        kept, dropped = enforce_staleness(batch, version=step, max_staleness=self.max_staleness)
        if kept is None:
            raise VersionMismatchError(f"every row of chunk {chunk} of iteration {step} is beyond the staleness "
                                       "bound while its generation was within it: its rows were re-tagged")
        self.dropped_total += dropped
        staleness, before, regenerated = self._claimed[step]
        staleness = staleness + [step - int(v) for v in kept[STALENESS_COLUMN].tolist()]
        self._claimed[step] = (staleness, before + dropped, regenerated)
        self._stats["async/wait_s"] += time.perf_counter() - started
        kept = kept.with_meta(iteration=step, policy_version=step, chunk=chunk, chunks=self.chunks)
        self._claimed_chunks[chunk] = kept
        return Batch(kept.tensors.copy(), dict(kept.non_tensors), dict(kept.meta))

    # --- internals ----------------------------------------------------------------------------------------
    def _fetch(self, entry: PendingRollout, chunk: int | None = None) -> Batch:
        """The rollout of ``entry`` with each row tagged with the version it was generated at (a tag already on a
        row is kept; ``chunk``: that chunk's only, else every chunk's concatenated); the weight syncs it queued
        behind are checked too (a failed one raises here)."""
        self.syncs.check_through(entry.version, self._stats)
        sources = entry.source if isinstance(entry.source, list) else [entry.source]
        if chunk is not None:
            sources = [sources[chunk]]
        parts = [source if isinstance(source, Batch) else source.get(timeout=self.timeout_s) for source in sources]
        batch = parts[0]
        if len(parts) > 1:  # the chunks at once (a barrier): one batch, as the unchunked rollout
            batch = Batch.concat(parts)
            batch.meta.pop("chunk", None)
            batch.meta.pop("chunks", None)
        if STALENESS_COLUMN not in batch:
            version = batch.meta.get("policy_version")
            if version is None:
                raise VersionMismatchError(f"the rollout of iteration {entry.iteration} carries no policy_version "
                                           "tag; the staleness bound cannot be checked")
            if TOKEN_VERSIONS in batch:  # a partial rollout: a row is as stale as its oldest token
                batch[STALENESS_COLUMN] = oldest_token_versions(batch, fallback=int(version))
            else:
                batch[STALENESS_COLUMN] = torch.full((len(batch),), int(version), dtype=torch.long)
        return batch

    def _sync(self, actor: Any, version: int) -> None:
        """Send the actor's weights (``version`` once its queued calls end) to the rollout pool (WeightSyncs.send)."""
        self.syncs.send(actor, version, self._rollout_call, self._stats)

    def _rollout_call(self, method: str) -> Any:
        """The rollout pool's ``method`` with its ``reliability.deadlines["rollout.<method>"]`` (else the pool's
        deadline, ``trainer.deadline_s``)."""
        return node_method(self.group.rollout, "rollout", method, self.deadlines)

    def _dispatch(self, iteration: int, prompts: Batch, *, queue: bool = True) -> PendingRollout:
        version = self.syncs.synced_version
        assert version is not None
        tagged = prompts.with_meta(iteration=iteration, policy_version=version)
        source: Any  # one call, or one per chunk (streamed; queued in order, so the first is done first)
        generate = self._rollout_call("generate")
        if self.chunks > 1:
            source = [generate(part) for part in split_prompt_chunks(tagged, self.chunks)]
        else:
            source = generate(tagged)
        entry = PendingRollout(iteration=iteration, prompts=prompts, version=version, source=source)
        if queue:
            self.pending.append(entry)
            self._last_dispatched = iteration
        return entry


#: per-step counters of :class:`AsyncRollout` (zeroed by ``begin_step``): the weight syncs checked this step (bytes,
#: buckets, the largest bucket, the rollout worker's seconds waiting for the export and fetching + loading it, the
#: driver's seconds dispatching), the time the step waited for its rollout and the rollout pool's compute time
_STEP_STATS = ("async/weight_sync_bytes", "async/weight_sync_buckets", "async/weight_sync_peak_bucket_bytes",
               "async/weight_sync_wait_s", "async/weight_sync_load_s", "async/weight_sync_driver_s",
               "async/wait_s", "async/rollout_busy_s")


def _uids(batch: Batch) -> list[str]:
    return [str(uid) for uid in batch.non_tensors.get("uid", [])]
