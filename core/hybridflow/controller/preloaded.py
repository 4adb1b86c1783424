"""Local child processes that start with torch and transformers already imported.

A fresh Python process pays ~10 CPU-s on a 2-core box to import torch, transformers' modeling code (which pulls in
``torch._dynamo``) and tensordict before it runs a line of its own. The gloo rank harnesses
(:func:`hybridflow.testing.contracts.run_ranks`, the megatron and sglang test ranks) start such processes by the
hundred, so they use :func:`preloaded_process`: a child forked from a *forkserver* that imported :data:`PRELOAD` once.
The forkserver is itself a fresh interpreter (never a fork of the caller, so no caller thread or lock is copied) and
starts no thread while importing; each child is a fork of it, taken in a few milliseconds.

What a spawned child would have, a forked one gets too: the caller's ``sys.path`` and working directory (multiprocessing
sends them with every child) and the caller's environment *at the child's start* (the forkserver's own is from when it
started, so the child replaces it with the one the caller passes). What differs: a variable read only while torch or
transformers is imported takes the forkserver's value. ``HYBRIDFLOW_FORKSERVER=0`` (or a platform without forkserver)
falls back to plain spawned children.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["PRELOAD", "preloaded_context", "preloaded_process"]

#: Imported once by the forkserver; a module missing here is skipped by multiprocessing without a word.
PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils", "tensordict")


def preloaded_context() -> BaseContext:
    """The forkserver context with :data:`PRELOAD` (spawn when ``HYBRIDFLOW_FORKSERVER=0`` or unavailable)."""
    turned_off = os.environ.get("HYBRIDFLOW_FORKSERVER", "1") == "0"
    if turned_off or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))  # read when the forkserver starts (the first child), then fixed
    return context


def preloaded_process(target: Callable[..., Any], args: tuple[Any, ...] = (), *, daemon: bool = False) -> BaseProcess:
    """An unstarted child running ``target(*args)`` in the caller's current environment; ``target`` must be picklable
    (module level), as for a spawned child."""
    process: BaseProcess = preloaded_context().Process(  # type: ignore[attr-defined]  # BaseContext declares no Process
        target=_in_environment, args=(dict(os.environ), target, args), daemon=daemon
    )
    return process


def _in_environment(environment: dict[str, str], target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    target(*args)
