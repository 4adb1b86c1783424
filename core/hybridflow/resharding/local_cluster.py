"""Runs functions on ``n`` local CPU processes joined in one gloo process group, for tests and benchmarks.

Spawning is slow on a small box, so :class:`GlooCluster` keeps its processes and runs many functions on them; it
knows nothing about resharding. Stability: developer.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.errors import WorkerError

__all__ = ["GlooCluster"]


def _worker(rank: int, world: int, rendezvous: str, inbox: Any, outbox: Any, timeout: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    faulthandler.enable()
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        # Prefix groups {0..w-1} let a function run on fewer ranks; new_group is collective, so all create them.
        prefixes = {w: dist.new_group(ranks=list(range(w))) for w in range(2, world)}
    except BaseException:  # noqa: BLE001 - forwarded to the parent, which raises it
        outbox.put((rank, False, traceback.format_exc()))
        return
    outbox.put((rank, True, "ready"))
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, size, args = task
        faulthandler.dump_traceback_later(timeout, exit=True)  # a hung collective prints its stack and exits
        try:
            if rank >= size:
                result = None
            else:
                group = None if size == world else prefixes.get(size)
                result = fn(rank, size, group, *args)
            outbox.put((rank, True, result))
        except BaseException:  # noqa: BLE001 - report everything to the parent, which raises it
            outbox.put((rank, False, traceback.format_exc()))
        faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


class GlooCluster:
    """``world`` spawned CPU processes in one gloo group; ``run(fn, *args)`` calls ``fn(rank, size, group, *args)``.

    ``group`` is None (the default group) when ``size == world``, else a prefix group of ranks ``0..size-1``
    (size 1 runs on rank 0 with ``group=None`` and no communication). Use as a context manager.
    """

    def __init__(self, world: int, *, timeout: float = 180.0) -> None:
        self.world = world
        self.timeout = timeout
        context = mp.get_context("spawn")
        self._outbox = context.Queue()
        self._inboxes = [context.Queue() for _ in range(world)]
        # the ranks meet through a file (a FileStore), not a port: a port picked here and handed on could be taken
        # by another process before rank 0 bound it; gloo's own connections bind ports the ranks hold themselves
        self._rendezvous_dir = tempfile.mkdtemp(prefix="hf-gloo-")
        rendezvous = os.path.join(self._rendezvous_dir, "store")
        self._procs = [
            context.Process(target=_worker, args=(rank, world, rendezvous, self._inboxes[rank], self._outbox, timeout),
                            daemon=True)
            for rank in range(world)
        ]
        for proc in self._procs:
            proc.start()
        try:
            self._collect()
        except BaseException:
            self.close()
            raise

    def _collect(self) -> list[Any]:
        results: dict[int, Any] = {}
        while len(results) < self.world:
            try:
                rank, ok, value = self._outbox.get(timeout=self.timeout)
            except Exception as exc:
                raise WorkerError(
                    f"only ranks {sorted(results)} of {self.world} answered within {self.timeout}s"
                ) from exc
            if not ok:
                raise WorkerError(f"rank {rank} failed:\n{value}", rank=rank, remote_traceback=value)
            results[rank] = value
        return [results[rank] for rank in range(self.world)]

    def run(self, fn: Callable[..., Any], *args: Any, size: int | None = None) -> list[Any]:
        """Run ``fn`` on ranks ``0..size-1`` (default all) and return their results by rank.

        Raises:
            WorkerError: a rank raised or did not answer in time; the cluster is closed then.
        """
        size = self.world if size is None else size
        if not 1 <= size <= self.world:
            raise WorkerError(f"size must be in [1, {self.world}]; got {size}.")
        for inbox in self._inboxes:
            inbox.put((fn, size, args))
        try:
            return self._collect()[:size]
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the workers (killing any that do not exit within a few seconds)."""
        for inbox in self._inboxes:
            with contextlib.suppress(Exception):  # a closed queue means the worker is gone already
                inbox.put(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        shutil.rmtree(self._rendezvous_dir, ignore_errors=True)

    def __enter__(self) -> GlooCluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
