"""``BatchFuture``: the lazy result of a non-blocking group call, holding per-rank object refs and row ranges.

Slicing or chunking a future fetches nothing: it narrows row ranges, so a receiving group's ranks each fetch
only their shard. The worker group (:mod:`hybridflow.controller.group`) creates call handles and routes futures;
the errors of a failed call are :mod:`hybridflow.controller.call_errors`'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from hybridflow.batch import check_versions
from hybridflow.controller.call_errors import dead_call_error, raised_call_error
from hybridflow.controller.host import FetchArg, RankResult
from hybridflow.controller.records import CallObserver, CallRecord, notify_observers
from hybridflow.controller.watchdog import raise_deadline_exceeded
from hybridflow.errors import ConfigError
from hybridflow.transfer.concat import concat_batches
from hybridflow.transfer.protocol import TransferContext

__all__ = ["BatchFuture", "CallHandle", "Segment", "FAST_PATH_S", "FAILURE_GRACE_S"]

#: a call first waits this long for every rank's report at once (one round trip for short calls); longer calls are
#: then waited for rank by rank, so that one rank's failure ends the call at once
FAST_PATH_S = 0.25
#: after a rank reports an error, how long the others get to report theirs before the call fails without them
FAILURE_GRACE_S = 0.5


@dataclass(slots=True)
class CallHandle:
    """One dispatched call: per-rank refs, the protocol that collects them and, once resolved, rank reports."""

    group: str
    role: str
    method: str
    protocol_name: str
    protocol: Any
    context: TransferContext
    hosts: dict[int, Any]
    pids: dict[int, int]
    data_refs: dict[int, Any]
    info_refs: dict[int, Any]
    collect_ranks: list[int]
    started_at: float
    deadline_s: float
    world_size: int
    stack_dump_dir: str | None = None
    observers: Sequence[CallObserver] = ()
    rank_zero_only: bool = False
    #: called once the call is known to have failed, with whether every rank is alive and idle (each reported:
    #: none died, hung or was left running); the group then does not park its processes
    on_failure: Callable[[bool], None] | None = None
    results: dict[int, RankResult] | None = None
    failure: BaseException | None = None
    fetched: dict[int, Any] | None = None

    @property
    def node(self) -> str:
        return f"{self.group}.{self.role}"

    def resolve(self, timeout: float | None = None, *, with_outputs: list[int] | None = None) -> dict[int, RankResult]:
        """Wait (bounded by the deadline and ``timeout``) for every rank's report; raise the first failure.

        ``with_outputs``: ranks whose outputs are fetched in the same call (kept for :meth:`fetch_outputs`)."""
        if self.failure is not None:
            raise self.failure
        if self.results is not None:
            return self.results
        remaining = self.started_at + self.deadline_s - time.time()
        wait_s = max(0.0, remaining if timeout is None else min(timeout, remaining))
        refs = list(self.info_refs.values())
        results: dict[int, RankResult] = {}
        waited_from = time.time()
        wanted = [self.data_refs[rank] for rank in with_outputs or []]
        try:  # the common case in one call: every report (and wanted output) arrives within the fast path
            values = ray.get(refs + wanted, timeout=min(wait_s, FAST_PATH_S))
            results = dict(zip(self.info_refs, values[: len(refs)]))
            if wanted:
                self.fetched = dict(zip(with_outputs or [], values[len(refs):]))
            ready = refs
        except (GetTimeoutError, RayActorError, RayError):
            # a longer call, out of time, or a rank died: wait rank by rank (what is left of the time), then sort
            # ranks out below; a rank that died or raised ends the wait (its peers may be blocked in a collective
            # with it until the deadline, e.g. when its node died or its code failed before the collective)
            ready, dead, raised = self._wait_unless_failed(refs, until=waited_from + wait_s)
            if dead:
                return self._fail_dead(dead, ready)
            if raised and len(ready) < len(refs):
                return self._fail_raised(ready)
        if len(ready) < len(refs):
            ready_set = set(ready)
            stuck = [rank for rank, ref in self.info_refs.items() if ref not in ready_set]
            final = timeout is None or timeout >= remaining  # the deadline itself expired: the call is over
            if final:
                self._emit({}, ok=False)
            try:
                raise_deadline_exceeded(node=self.node, method=self.method, stuck_ranks=stuck,
                                        deadline_s=min(self.deadline_s, time.time() - self.started_at),
                                        hosts=self.hosts, pids=self.pids, stack_dump_dir=self.stack_dump_dir)
            except BaseException as exc:
                if final:
                    self.failure = exc
                raise
        died = False
        try:
            if not results:  # waited rank by rank: the reports and wanted outputs now in one round trip
                values = ray.get(refs + wanted, timeout=max(10.0, self.deadline_s))
                results = dict(zip(self.info_refs, values[: len(refs)]))
                if wanted:
                    self.fetched = dict(zip(with_outputs or [], values[len(refs):]))
        except (RayActorError, RayError, GetTimeoutError):
            for rank, ref in self.info_refs.items():  # find which ranks died
                try:
                    results[rank] = ray.get(ref, timeout=10.0)
                except (RayActorError, RayError, GetTimeoutError) as exc:
                    died = True
                    results[rank] = RankResult(rank=rank, ok=False, remote_traceback=str(exc), finished_at=time.time(),
                                               error=f"worker process died ({type(exc).__name__})")
        self.results = results
        failed = [result for result in results.values() if not result.ok]
        self._emit(results, ok=not failed, idle=not died)
        if failed:
            self.failure = raised_call_error(self.node, self.method, self.role, self.world_size, failed)
            raise self.failure
        return results

    def _wait_unless_failed(self, refs: list[Any], *, until: float) -> tuple[list[Any], dict[int, str], bool]:
        """Wait until every report is in or ``until``; stop early once a rank's process is found dead, or (after
        :data:`FAILURE_GRACE_S` for the other ranks' reports) once a rank reported an error.

        Returns the ready refs, the dead ranks with their error, and whether a ready rank reported a failure."""
        ready: list[Any] = []
        pending = list(refs)
        dead: dict[int, str] = {}
        failed = False
        grace_until = float("inf")
        rank_of = {ref: rank for rank, ref in self.info_refs.items()}
        while pending:
            limit = min(until, grace_until)
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, min(1.0, limit - time.time())))
            if done and pending:  # whatever else is ready by now
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                done = done + more
            try:  # one round trip for every report that is in
                reports = ray.get(done, timeout=0)
            except (RayActorError, RayError):  # a raised error is a dead process (code errors come back): find it
                reports = []
                for ref in done:
                    try:
                        reports.append(ray.get(ref, timeout=0))
                    except (RayActorError, RayError) as exc:
                        dead[rank_of[ref]] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            for report in reports:
                if isinstance(report, RankResult) and not report.ok and not failed:
                    failed, grace_until = True, time.time() + FAILURE_GRACE_S
            ready.extend(done)
            if dead or time.time() >= limit:
                break
        return ready, dead, failed

    def _fail_raised(self, ready: list[Any]) -> dict[int, RankResult]:
        """A rank raised while others still run (blocked in a collective with it, say): report and raise now."""
        ready_set = set(ready)
        results = {rank: ray.get(ref, timeout=10.0) for rank, ref in self.info_refs.items() if ref in ready_set}
        self.results = results
        self._emit(results, ok=False)
        failed = [result for result in results.values() if not result.ok]
        running = sorted(set(self.info_refs) - set(results))
        self.failure = raised_call_error(self.node, self.method, self.role, self.world_size, failed, running=running)
        raise self.failure

    def _fail_dead(self, dead: dict[int, str], ready: list[Any]) -> dict[int, RankResult]:
        """The call failed because ranks died: report them (others still running are abandoned) and raise."""
        ready_set = set(ready)
        results: dict[int, RankResult] = {}
        for rank, ref in self.info_refs.items():
            if rank in dead:
                results[rank] = RankResult(rank=rank, ok=False, remote_traceback=dead[rank], finished_at=time.time(),
                                           error=f"worker process died ({dead[rank]})")
            elif ref in ready_set:
                results[rank] = ray.get(ref, timeout=10.0)
        self.results = results
        self._emit(results, ok=False)
        running = sorted(set(self.info_refs) - set(results))
        self.failure = dead_call_error(self.node, self.method, self.role, self.world_size, dead, running=running)
        raise self.failure

    def _emit(self, results: dict[int, RankResult], *, ok: bool, idle: bool = False) -> None:
        """Notify the observers of the finished call; ``idle``: every rank reported and is alive (a failure
        then left no rank running, hung or dead)."""
        if not ok and self.on_failure is not None:
            self.on_failure(idle and len(results) == len(self.info_refs))
        finished = max((result.finished_at for result in results.values()), default=time.time())
        record = CallRecord(
            group=self.group, role=self.role, method=self.method, protocol=self.protocol_name,
            seconds=max(0.0, finished - self.started_at),
            bytes_in_per_rank=tuple(results[r].bytes_in if r in results else 0 for r in range(self.world_size)),
            bytes_out=sum(result.nbytes_out for result in results.values()),
            started_at=self.started_at, finished_at=finished,
            compute_seconds_per_rank=tuple(
                results[r].finished_at - results[r].started_at if r in results else 0.0 for r in range(self.world_size)
            ),
            ok=ok,
            counters_per_rank=tuple(results[r].counters if r in results else {} for r in range(self.world_size)),
        )
        notify_observers(record, self.observers)

    def fetch_outputs(self, ranks: list[int], timeout: float | None) -> list[Any]:
        self.resolve(timeout, with_outputs=ranks if self.results is None else None)
        fetched, self.fetched = self.fetched or {}, None
        if all(rank in fetched for rank in ranks):
            return [fetched[rank] for rank in ranks]
        return list(ray.get([self.data_refs[rank] for rank in ranks], timeout=timeout or max(10.0, self.deadline_s)))


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows ``[start, stop)`` of the output object ``ref`` of producer ``rank`` (``length`` rows in all)."""

    rank: int
    ref: Any
    start: int
    stop: int
    length: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(slots=True)
class _View:
    segments: tuple[Segment, ...]
    padding_rows: int = 0
    pad_source: Segment | None = None
    mark_padding: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


class BatchFuture:
    """The not-yet-fetched result of a non-blocking call. Stability: public.

    ``get()`` brings the data to the driver; passing the future to another group's method sends each of its ranks
    only the object refs (or producer-side slices) covering its rows. ``len``, ``meta``, ``slice`` and ``chunk``
    wait for the producing ranks to finish (bounded by the call's deadline) but fetch no rows.
    """

    def __init__(self, handle: CallHandle, view: _View | None = None) -> None:
        self._handle = handle
        self._view = view

    # --- status ---------------------------------------------------------------------------------------------
    @property
    def node(self) -> str:
        return f"{self._handle.node}.{self._handle.method}"

    def done(self) -> bool:
        """True once every rank has reported (success or failure); never blocks."""
        refs = list(self._handle.info_refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def wait(self, timeout: float | None = None) -> BatchFuture:
        """Block until the call finished (raising its WorkerError / DeadlineExceededError); fetch no data."""
        self._handle.resolve(timeout)
        return self

    def output_ref(self, rank: int = 0) -> Any:
        """The object ref of ``rank``'s raw output, without waiting or fetching: passed inside another call's
        arguments (not resolved by Ray there), that worker fetches the output itself, straight from the producer's
        object store, while the driver never holds the bytes (the rollout pool's weight sync does this)."""
        if rank not in self._handle.data_refs:
            raise ConfigError(f"{self.node} ran on ranks {sorted(self._handle.data_refs)}; expected one of them, got "
                              f"rank {rank}")
        return self._handle.data_refs[rank]

    def get(self, timeout: float | None = None) -> Any:
        """The collected result, fetched to the driver (a ``Batch`` for concatenating protocols)."""
        handle = self._handle
        if self._view is None:
            outputs = handle.fetch_outputs(handle.collect_ranks, timeout)
            return outputs[0] if handle.rank_zero_only else handle.protocol.collect(outputs, handle.context)
        view = self._view
        segments = [segment for segment in view.segments if segment.rows]
        sources = segments + ([view.pad_source] if view.pad_source is not None and view.padding_rows else [])
        values = handle.fetch_outputs([segment.rank for segment in sources], timeout)
        pieces = [value.slice(segment.start, segment.stop) for value, segment in zip(values, sources)]
        if view.pad_source is not None and view.padding_rows:
            pieces[-1] = pieces[-1].index([0] * view.padding_rows)
        batch = concat_batches(pieces) if len(pieces) > 1 else pieces[0]
        return batch.mark_padding(view.padding_rows) if view.mark_padding else batch

    # --- lazy row algebra -----------------------------------------------------------------------------------
    def _resolved_view(self) -> _View:
        if self._view is not None:
            return self._view
        handle = self._handle
        results = handle.resolve()
        concatenates = handle.protocol.concatenates or handle.rank_zero_only
        if not concatenates or not all(results[rank].is_batch for rank in handle.collect_ranks):
            raise ConfigError(
                f"{self.node} returned {'non-Batch outputs' if concatenates else 'per-rank outputs'} "
                f"(protocol {handle.protocol_name}); expected Batches concatenated by rows to use the result lazily. "
                f"Fix: call .get() and pass the value"
            )
        metas = [results[rank].meta for rank in handle.collect_ranks]
        agreed = check_versions(metas, what=f"outputs of {self.node}")
        segments = tuple(Segment(rank=rank, ref=handle.data_refs[rank], start=0, stop=results[rank].rows,
                                 length=results[rank].rows) for rank in handle.collect_ranks)
        self._view = _View(segments=segments, meta={**(metas[0] if metas else {}), **agreed})
        return self._view

    @property
    def is_batch(self) -> bool:
        """True when the result is a row-concatenated Batch (waits for the call)."""
        try:
            self._resolved_view()
        except ConfigError:
            return False
        return True

    @property
    def meta(self) -> dict[str, Any]:
        """The producers' agreed ``meta`` (raises VersionMismatchError if the producing ranks disagree)."""
        return dict(self._resolved_view().meta)

    def __len__(self) -> int:
        view = self._resolved_view()
        return sum(segment.rows for segment in view.segments) + view.padding_rows

    def slice(self, start: int, stop: int) -> BatchFuture:
        """Rows ``[start, stop)`` as a future (nothing fetched)."""
        view = self._resolved_view()
        if view.padding_rows:
            raise ConfigError(f"cannot slice a padded chunk of {self.node}; slice the unpadded future first")
        total = len(self)
        start, stop = max(0, min(start, total)), max(0, min(stop, total))
        out: list[Segment] = []
        offset = 0
        for segment in view.segments:
            lo, hi = max(start, offset), min(stop, offset + segment.rows)
            if lo < hi:
                shift = segment.start - offset
                out.append(replace(segment, start=lo + shift, stop=hi + shift))
            offset += segment.rows
        return BatchFuture(self._handle, _View(segments=tuple(out), meta=view.meta))

    def chunk(self, chunks: int, *, pad: bool = False) -> list[BatchFuture]:
        """Like :meth:`Batch.chunk`: equal parts; ``pad=True`` pads with the last row and marks ``is_padding``."""
        total = len(self)
        if chunks <= 0:
            raise ConfigError(f"chunks must be positive, got {chunks}")
        if total % chunks == 0:
            size = total // chunks
            return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]
        if not pad:
            raise ConfigError(f"cannot split {total} rows of {self.node} evenly into {chunks} chunks; expected a "
                              f"multiple of {chunks}. Fix: use protocol dp_compute_padded")
        size = -(-total // chunks)
        last = self.slice(total - 1, total)._resolved_view().segments[0]
        out = []
        for index in range(chunks):
            part = self.slice(min(index * size, total), min((index + 1) * size, total))
            padding = size - len(part)
            out.append(BatchFuture(self._handle, _View(segments=part._resolved_view().segments, padding_rows=padding,
                                                       pad_source=last if padding else None, mark_padding=True,
                                                       meta=part._resolved_view().meta)))
        return out

    def to_fetch_arg(self, slice_cache: dict[tuple[Any, int, int], Any]) -> FetchArg:
        """The refs a receiving rank fetches: whole outputs as they are, partial ones sliced by their producer."""
        view = self._resolved_view()
        hosts = self._handle.hosts

        def ref_of(segment: Segment) -> Any:
            if segment.start == 0 and segment.stop == segment.length:
                return segment.ref
            key = (segment.ref, segment.start, segment.stop)
            if key not in slice_cache:
                slice_cache[key] = hosts[segment.rank].slice_rows.remote(segment.ref, segment.start, segment.stop)
            return slice_cache[key]

        refs = tuple(ref_of(segment) for segment in view.segments if segment.rows)
        pad_ref = ref_of(view.pad_source) if view.pad_source is not None and view.padding_rows else None
        return FetchArg(refs=refs, padding_rows=view.padding_rows, pad_ref=pad_ref, mark_padding=view.mark_padding)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"BatchFuture({self.node}, {state})"
