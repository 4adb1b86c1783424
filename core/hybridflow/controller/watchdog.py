"""The watchdog: bounded waits on remote calls and, on expiry, the stuck workers' stacks in the error.

It raises; killing or restarting the stuck group is the caller's policy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import ray

from hybridflow.errors import DeadlineExceededError

__all__ = ["collect_stacks", "raise_deadline_exceeded", "STACK_DUMP_TIMEOUT_S"]

#: how long the watchdog waits for a stuck worker to answer ``dump_stacks`` before trying py-spy
STACK_DUMP_TIMEOUT_S = 5.0


def _py_spy_dump(pid: int) -> str:
    executable = shutil.which("py-spy")
    if executable is None:
        return f"(py-spy not installed; no stack for pid {pid})"
    try:
        done = subprocess.run([executable, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy dump --pid {pid} failed: {exc})"
    return done.stdout if done.returncode == 0 else f"(py-spy dump --pid {pid} failed: {done.stderr.strip()})"


def collect_stacks(hosts: Mapping[int, Any], pids: Mapping[int, int]) -> dict[int, str]:
    """Python stacks of each rank's worker: asked over Ray first (a separate thread), py-spy if it does not answer."""
    refs = {rank: host.dump_stacks.remote() for rank, host in hosts.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=STACK_DUMP_TIMEOUT_S)
    ready_set = set(ready)
    stacks: dict[int, str] = {}
    for rank, ref in refs.items():
        text = ""
        if ref in ready_set:
            try:
                text = ray.get(ref, timeout=1.0)
            except Exception as exc:  # noqa: BLE001 - a dead worker has no stack; say why
                text = f"(no stack over Ray: {type(exc).__name__}: {exc})"
        if not text or text.startswith("(no stack"):
            pid = pids.get(rank)
            text = (text + "\n" if text else "") + (_py_spy_dump(pid) if pid else "(pid unknown)")
        stacks[rank] = text
    return stacks


def raise_deadline_exceeded(
    *,
    node: str,
    method: str,
    stuck_ranks: Sequence[int],
    deadline_s: float,
    hosts: Mapping[int, Any],
    pids: Mapping[int, int],
    stack_dump_dir: str | os.PathLike[str] | None,
) -> NoReturn:
    """Dump the stuck ranks' stacks (into the message and ``stack_dump_dir``) and raise DeadlineExceededError."""
    stacks = collect_stacks({rank: hosts[rank] for rank in stuck_ranks}, pids)
    where = ""
    if stack_dump_dir is not None:
        directory = Path(stack_dump_dir)
        directory.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for rank, text in stacks.items():
            (directory / f"{node}.{method}.rank{rank}.{stamp}.txt").write_text(text)
        where = f" Stacks written to {directory}."
    body = "\n".join(stacks[rank] for rank in sorted(stacks))
    raise DeadlineExceededError(
        f"{node}.{method} did not finish within its deadline of {deadline_s:.1f}s on ranks {sorted(stuck_ranks)} "
        f"(expected every rank to return).{where} Fix: raise the deadline (WorkerGroup(deadline_s=...) or "
        f"@register(deadline_s=...)) if the work is legitimately slow, else look at the stacks below; the stuck "
        f"workers are still running (restart or shut down the group).\n{body}"
    )
