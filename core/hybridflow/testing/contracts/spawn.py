"""Run a function on N local processes forming a gloo process group, with a bounded wait and the children's
tracebacks surfaced; what the function does is the caller's business. The processes start with torch and transformers
imported (:mod:`hybridflow.controller.preloaded`)."""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_ranks", "run_rank_groups"]


def _child(function: Callable[..., Any], rank: int, world_size: int, port: int, error_file: str,
           args: tuple[Any, ...]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    finished = False
    try:
        import torch

        torch.set_num_threads(1)
        function(rank, world_size, *args)
        finished = True
    except BaseException:
        Path(error_file).write_text(traceback.format_exc())
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            if finished:  # no rank tears its group down while a peer may still use it (a C++ abort at exit, seen
                dist.barrier()  # as exit code -6 about once in 15 runs under load)
            dist.destroy_process_group()


def _start(function: Callable[..., Any], world_size: int, args: tuple[Any, ...],
           workdir: Path) -> tuple[list[Any], list[str], socket.socket]:
    from hybridflow.controller.host import reserve_port
    from hybridflow.controller.preloaded import preloaded_process

    # rank 0's port held until the run ends (its TCPStore still binds it, no other process can), so another run
    # starting meanwhile, e.g. on the other pytest-xdist worker, cannot take it
    reservation = reserve_port("127.0.0.1")
    port = int(reservation.getsockname()[1])
    processes, error_files = [], []
    for rank in range(world_size):
        error_file = str(workdir / f"rank{rank}_{port}.error")
        error_files.append(error_file)
        process = preloaded_process(_child, (function, rank, world_size, port, error_file, args))
        process.start()
        processes.append(process)
    return processes, error_files, reservation


def run_rank_groups(
    jobs: list[tuple[Callable[..., Any], int, tuple[Any, ...]]], *, workdir: Path, timeout_s: float = 180
) -> None:
    """Start every ``(function, world_size, args)`` job at once (each its own process group), then wait for all.

    Each rank calls ``function(rank, world_size, *args)`` with RANK/WORLD_SIZE/MASTER_* set; ``function`` must be
    importable (module level). Raises ``AssertionError`` with the failing ranks' tracebacks; hung ranks are killed.
    """
    started = [(function, _start(function, world_size, args, workdir)) for function, world_size, args in jobs]
    deadline = time.monotonic() + timeout_s
    failures = []
    for function, (processes, error_files, reservation) in started:
        for process in processes:
            process.join(max(1.0, deadline - time.monotonic()))
        reservation.close()
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for rank in hung:
            processes[rank].kill()
            processes[rank].join(10)
        errors = [Path(f).read_text() for f in error_files if Path(f).exists()]
        if hung or errors or any(p.exitcode for p in processes):
            failures.append(
                f"{len(processes)}-rank run of {function.__name__} failed: hung ranks {hung} (waited {timeout_s} s), "
                f"exit codes {[p.exitcode for p in processes]}\n" + "\n".join(errors)
            )
    if failures:
        raise AssertionError("\n".join(failures))


def run_ranks(function: Callable[..., Any], world_size: int, *args: Any, workdir: Path, timeout_s: float = 180) -> None:
    """:func:`run_rank_groups` with one job."""
    run_rank_groups([(function, world_size, args)], workdir=workdir, timeout_s=timeout_s)
