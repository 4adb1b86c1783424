"""What a worker process puts back before it hosts another group's roles (a parked host: hybridflow.controller.park).

A fresh worker process starts from Ray's environment, torch's default flags and torch's default RNG seed. A parked
one must look the same to the next roles: :func:`capture` records that state when the host starts, and
:func:`restore` destroys torch.distributed's process groups and puts the environment, ``sys.path``, torch's global
flags and its RNG back, then reports what it could not put back (threads the roles left running), which makes the
process unfit for reuse. Module-level state of a library is beyond it: engines declare whether they leave any
(``reusable_process`` in their info record, hybridflow.engines).
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["ProcessBaseline", "capture", "python_threads", "restore"]

#: how long :func:`restore` waits for threads the roles started to end before it calls the process unfit
THREAD_GRACE_S = 2.0
#: name prefixes of threads that belong to the process, not to a role: started on first use, kept for its life
#: (hybridflow.transfer.concat's copy pool)
PROCESS_THREADS = ("hybridflow-concat",)


@dataclass(frozen=True, slots=True)
class ProcessBaseline:
    """The process-wide state a fresh worker process has (what :func:`restore` puts back)."""

    environ: dict[str, str]
    sys_path: tuple[str, ...]
    torch_state: dict[str, Any]


def _torch_state() -> dict[str, Any]:
    import torch

    return {"num_threads": torch.get_num_threads(), "default_dtype": torch.get_default_dtype(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "matmul_precision": torch.get_float32_matmul_precision(), "initial_seed": torch.initial_seed()}


def capture() -> ProcessBaseline:
    """This process's state now (the host calls it once it has started, before any role exists)."""
    return ProcessBaseline(environ=dict(os.environ), sys_path=tuple(sys.path), torch_state=_torch_state())


def python_threads() -> set[int]:
    """Idents of the Python-started threads alive now, less Ray's executor threads (dummy threads) and
    :data:`PROCESS_THREADS`."""
    return {thread.ident for thread in threading.enumerate()
            if thread.ident is not None and type(thread) is not threading._DummyThread
            and thread is not threading.main_thread() and not thread.name.startswith(PROCESS_THREADS)}


def _destroy_process_groups() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _restore_torch(state: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(int(state["num_threads"]))
    torch.set_default_dtype(state["default_dtype"])
    torch.set_grad_enabled(True)
    torch.use_deterministic_algorithms(bool(state["deterministic"]), warn_only=bool(state["deterministic_warn_only"]))
    torch.set_float32_matmul_precision(str(state["matmul_precision"]))
    torch.manual_seed(int(state["initial_seed"]))
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _trim_heap() -> None:
    """Hand the heap's free memory back to the OS (glibc's ``malloc_trim``; the host's tuned malloc keeps up to
    1 GiB of it otherwise: hybridflow.controller.host.tune_malloc), so a parked process holds what it uses."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def restore(baseline: ProcessBaseline, threads_before: set[int]) -> list[str]:
    """Put the process back to ``baseline``; the reasons it is still unfit for reuse (empty: fit).

    ``threads_before``: :func:`python_threads` before the roles were built; threads started since that are still
    alive after :data:`THREAD_GRACE_S` are the roles' and make the process unfit (they would run on beside the
    next roles)."""
    reasons: list[str] = []
    try:
        _destroy_process_groups()
    except Exception as exc:  # noqa: BLE001 - reported as the reason this process is not reused
        reasons.append(f"destroying torch.distributed's process groups failed: {type(exc).__name__}: {exc}")
    os.environ.clear()
    os.environ.update(baseline.environ)
    sys.path[:] = list(baseline.sys_path)
    try:
        _restore_torch(baseline.torch_state)
    except Exception as exc:  # noqa: BLE001
        reasons.append(f"restoring torch's global state failed: {type(exc).__name__}: {exc}")
    random.seed()  # as a fresh interpreter: from the OS's entropy
    gc.collect()
    _trim_heap()
    until = time.monotonic() + THREAD_GRACE_S
    started = [thread for thread in threading.enumerate() if thread.ident in python_threads() - threads_before]
    for thread in started:
        thread.join(max(0.0, until - time.monotonic()))
    left = sorted(thread.name for thread in started if thread.is_alive())
    if left:
        reasons.append(f"threads the roles started are still running: {left}")
    return reasons
