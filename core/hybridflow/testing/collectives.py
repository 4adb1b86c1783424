"""Counting the bytes of ``torch.distributed`` collectives in a process (tests and benches of what a step moves):
:class:`CollectiveCounter` wraps the module-level functions FSDP2, the reshard executor and the engines call, and
tallies calls and received bytes per phase label. DTensor's functional collectives (``torch.ops._c10d_functional``,
e.g. the grad-norm all-reduce of a sharded clip: one scalar) do not go through these functions and are not counted.
Stability: developer."""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CollectiveCounter", "gathered_bytes", "GATHERS"]

#: the collectives that gather weights (FSDP2's all-gather, the executor's all-gather and point-to-point pieces)
GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather", "batch_isend_irecv")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _received_bytes(name: str, args: list[Any]) -> int:
    """Bytes this rank receives in one call of collective ``name`` (arguments in signature order): all-gather = output
    − input (the other ranks' pieces), reduce-scatter = input − output (the other ranks' contributions to this rank's
    piece), all-reduce and broadcast = the tensor (the payload, not a ring's 2(w−1)/w), point-to-point = the irecv
    buffers."""
    if name in ("all_gather_single", "all_gather_into_tensor"):
        return _nbytes(args[0]) - _nbytes(args[1])
    if name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return _nbytes(args[1]) - _nbytes(args[0])
    if name == "all_gather":
        return sum(_nbytes(t) for t in args[0]) - _nbytes(args[1])
    if name in ("all_reduce", "broadcast"):
        return _nbytes(args[0])
    if name == "batch_isend_irecv":
        return sum(_nbytes(op.tensor) for op in args[0] if op.op.__name__ == "irecv")
    return 0  # all_gather_object: pickled Python values (a row count), counted by calls only


class CollectiveCounter:
    """Wraps the ``torch.distributed`` functions FSDP2, the reshard executor and the engines call (until
    :meth:`close`); ``phase`` labels what is counted (calls and received bytes per collective name); a collective
    called inside another (all_gather_object's all_gather) is not counted again."""

    NAMES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
             "all_gather", "all_reduce", "broadcast", "batch_isend_irecv", "all_gather_object")

    def __init__(self) -> None:
        import torch.distributed as dist

        self.phase = "other"
        self.counts: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        self._depth = 0
        self._originals = {name: getattr(dist, name) for name in self.NAMES}
        for name, function in self._originals.items():
            setattr(dist, name, self._wrap(name, function))

    def close(self) -> None:
        """Put the original functions back."""
        import torch.distributed as dist

        for name, function in self._originals.items():
            setattr(dist, name, function)

    def _wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(function)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                entry = self.counts[self.phase][name]
                entry[0] += 1
                entry[1] += _received_bytes(name, list(signature.bind(*args, **kwargs).arguments.values()))
            self._depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def take(self) -> dict[str, dict[str, tuple[int, int]]]:
        """Counts so far, ``{phase: {collective: (calls, bytes received)}}``, and start again from zero."""
        out = {phase: {name: (c[0], c[1]) for name, c in names.items()} for phase, names in self.counts.items()}
        self.counts.clear()
        return out


def gathered_bytes(counts: dict[str, dict[str, tuple[int, int]]], phase: str) -> int:
    """Bytes received by the gathering collectives (:data:`GATHERS`) in ``phase`` of :meth:`CollectiveCounter.take`."""
    return sum(counts.get(phase, {}).get(name, (0, 0))[1] for name in GATHERS)
