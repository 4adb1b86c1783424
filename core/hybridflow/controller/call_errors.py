"""The errors a failed group call raises: ranks that reported an exception, or ranks whose process died.

Each names the call, the failed ranks among the group's and the fix; deciding when a call has failed (and waiting for
its ranks) is :class:`hybridflow.controller.future.CallHandle`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridflow.controller.host import RankResult
from hybridflow.errors import WorkerError

__all__ = ["raised_call_error", "dead_call_error"]


def raised_call_error(node: str, method: str, role: str, world_size: int, failed: Sequence[RankResult], *,
                      running: Sequence[int] = ()) -> WorkerError:
    """The error of a call in which the ranks ``failed`` raised (the lowest one's traceback shown); ``running``:
    ranks still running, abandoned."""
    first = min(failed, key=lambda result: result.rank)
    ranks = sorted(result.rank for result in failed)
    abandoned = (f"; ranks {list(running)} were still running (waiting for it in a collective?) and are abandoned: "
                 "restart the group (the supervisor does)" if running else "")
    return WorkerError(
        f"{node}.{method} failed on rank {first.rank} of {world_size}"
        f"{f' (failed ranks: {ranks})' if len(ranks) > 1 else ''}: {first.error}{abandoned}. "
        f"Fix the worker code; the remote traceback follows.\n--- rank {first.rank} traceback ---\n"
        f"{first.remote_traceback}",
        rank=first.rank, method=f"{role}.{method}", remote_traceback=first.remote_traceback,
        deterministic=first.deterministic,
    )


def dead_call_error(node: str, method: str, role: str, world_size: int, dead: dict[int, str], *,
                    running: Sequence[int] = ()) -> WorkerError:
    """The error of a call whose ranks ``dead`` (rank → the error that showed it) died; ``running``: ranks still
    running, abandoned."""
    first = min(dead)
    return WorkerError(
        f"{node}.{method} failed: rank {first} of {world_size} died"
        f"{f' (dead ranks: {sorted(dead)})' if len(dead) > 1 else ''} ({dead[first]})"
        f"{f'; ranks {list(running)} were still running and are abandoned' if running else ''}. A dead worker "
        f"process or Ray node (OOM kill, crash, machine lost); the supervisor restarts the group.",
        rank=first, method=f"{role}.{method}", remote_traceback=dead[first],
    )
