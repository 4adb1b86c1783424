"""FSDP2's all-gather and reduce-scatter through shared memory, for CPU ranks that share one host.

gloo moves a collective's bytes through loopback TCP: at 18.9M parameters in bf16 (38 MB) on two CPU ranks an
all-gather takes ~33 ms and a reduce-scatter ~47 ms (bench/shm_comm.py), about 14% of a GRPO step. Ranks on one
host can instead read each other's buffers: each rank's FSDP communication buffer (what FSDP asks the comm's
``allocate`` for: the all-gather output, the reduce-scatter input) is a file in ``/dev/shm`` that every rank of the
group maps, and a collective is a gloo barrier, plain copies (or adds) of the peers' slices, and a second barrier
(so no rank overwrites its buffer while a peer still reads it). The barriers are the only messages.

Installed through FSDP2's own hook (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``) on a model
that is one FSDP unit (``extra.fsdp_units: model``: one all-gather and one reduce-scatter buffer alive at a time),
when every rank of the group is on this host (same boot id and hostname) and the device is the CPU. A call FSDP makes
with a buffer that is not this comm's (a future FSDP allocating elsewhere) falls back to the process group's own
collective. Files are unlinked as soon as every rank has mapped them: nothing is left in ``/dev/shm`` if a rank dies.

Results: an all-gather is bitwise the gloo one (copies); a reduce-scatter sums the ranks' slices in rank order in
the buffer's dtype (one rounding per add, as gloo; at two ranks a + b, bitwise the gloo result).
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SharedMemoryGroup", "ShmAllGather", "ShmReduceScatter", "install_shm_comm", "same_host_reason",
           "SpinChannel", "spin_channel_unsupported_reason",
           "SHM_DIR", "COMM_SETTINGS", "AUTO_MIN_BYTES"]

SHM_DIR = Path("/dev/shm")
#: ``auto`` uses shared memory from this many bytes of weights: below, a collective's two barriers cost about what
#: gloo's copy through loopback does (77K parameters in fp32: 27,472 against 28,033 tokens/s through the trainer)
AUTO_MIN_BYTES = 4 << 20
#: ``extra.comm``: ``auto`` (shared memory where it applies), ``shm`` (required: an error where it cannot), ``gloo``
COMM_SETTINGS = ("auto", "shm", "gloo")


def _host_identity() -> str:
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


def _free_shm_bytes() -> int:
    if not SHM_DIR.is_dir() or not os.access(SHM_DIR, os.W_OK):
        return -1
    stats = os.statvfs(SHM_DIR)
    return int(stats.f_bavail * stats.f_frsize)


def same_host_reason(group: Any, device: torch.device, *, need_bytes: int = 0) -> str | None:
    """Why the ranks of ``group`` cannot share ``need_bytes`` of memory in all (None: they can). A collective over
    ``group`` (every rank gets the same answer). ``/dev/shm`` is a tmpfs: a buffer written past its free space kills
    the process with SIGBUS, hence the check (Docker gives containers 64 MB unless run with ``--shm-size``)."""
    if device.type != "cpu":  # the engine's device, the same on every rank of a group
        return f"the device is {device.type}, not the CPU"
    facts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(facts, (_host_identity(), _free_shm_bytes()), group=group)
    if len({identity for identity, _free in facts}) != 1:
        return f"the ranks are on {len({identity for identity, _free in facts})} hosts"
    free = min(free for _identity, free in facts)
    if free < 0:
        return f"{SHM_DIR} is not a writable directory"
    if free < need_bytes:
        return (f"{SHM_DIR} has {free >> 20} MiB free, the buffers need {need_bytes >> 20} MiB (in a container, "
                f"raise its shared memory, e.g. docker run --shm-size=1g)")
    return None


class SharedMemoryGroup:
    """The ranks of one process group on one host, each owning a ``/dev/shm`` buffer per (name, dtype, size) that
    every rank maps; :meth:`buffer` is collective (every rank calls it in the same order)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        token = [secrets.token_hex(8) if self.rank == 0 else None]
        dist.broadcast_object_list(token, group_src=0, group=group)
        self.prefix = f"hybridflow-fsdp-{token[0]}"
        self._buffers: dict[tuple[str, torch.dtype, int], list[torch.Tensor]] = {}

    def buffer(self, name: str, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        """Every rank's buffer ``name`` of ``numel`` elements, by group rank (this rank's own is writable by it
        alone, by convention); created and mapped on first use, then cached."""
        key = (name, dtype, int(numel))
        if key not in self._buffers:
            itemsize = torch.empty((), dtype=dtype).element_size()
            stem = f"{self.prefix}-{name}-{str(dtype).removeprefix('torch.')}-{numel}"
            own = SHM_DIR / f"{stem}-{self.rank}"
            with own.open("wb") as handle:
                handle.truncate(int(numel) * itemsize)
            dist.barrier(group=self.group)  # every rank's file exists
            views = [torch.from_file(str(SHM_DIR / f"{stem}-{r}"), shared=True, size=int(numel), dtype=dtype)
                     for r in range(self.world_size)]
            dist.barrier(group=self.group)  # every rank mapped every file: the names can go
            own.unlink()
            self._buffers[key] = views
        return self._buffers[key]

    def owns(self, tensor: torch.Tensor) -> bool:
        return any(tensor.data_ptr() == views[self.rank].data_ptr() for views in self._buffers.values())

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class ShmAllGather:
    """FSDP2 ``AllGather`` comm: the output buffer in shared memory; the call copies each peer's slice."""

    def __init__(self, shared: SharedMemoryGroup) -> None:
        self.shared = shared
        self.calls = 0
        self.fallbacks = 0

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        numel = 1
        for dim in size:
            numel *= int(dim)
        return self.shared.buffer("all_gather", dtype, numel)[self.shared.rank].view(*[int(d) for d in size])

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        shared = self.shared
        if not shared.owns(output_tensor):
            self.fallbacks += 1
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        views = shared.buffer("all_gather", output_tensor.dtype, output_tensor.numel())
        chunk = input_tensor.numel()
        shared.barrier()  # every rank's input is in its slice of its buffer
        flat = output_tensor.view(-1)
        for rank, view in enumerate(views):
            if rank != shared.rank:
                flat[rank * chunk:(rank + 1) * chunk].copy_(view[rank * chunk:(rank + 1) * chunk])
        shared.barrier()  # every rank has read every buffer: they may be written again
        self.calls += 1
        return None


class ShmReduceScatter:
    """FSDP2 ``ReduceScatter`` comm: the input buffer in shared memory (the output is a plain tensor: FSDP keeps
    views of it as the sharded gradients); the call sums the ranks' slices of this rank's shard in rank order."""

    def __init__(self, shared: SharedMemoryGroup) -> None:
        self.shared = shared
        self.calls = 0
        self.fallbacks = 0
        self._input_next = True

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        numel = 1
        for dim in size:
            numel *= int(dim)
        # FSDP allocates the input (world x shard) first, then the output (one shard): only the input is shared
        input_next, self._input_next = self._input_next, not self._input_next
        if input_next:
            return self.shared.buffer("reduce_scatter", dtype, numel)[self.shared.rank].view(*[int(d) for d in size])
        return torch.empty(*[int(d) for d in size], dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        shared = self.shared
        self._input_next = True
        if not shared.owns(input_tensor) or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            self.fallbacks += 1
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if shared.owns(output_tensor):  # FSDP keeps views of the output as the gradients: never a shared buffer
            raise RuntimeError("ShmReduceScatter: the output is a shared buffer; FSDP allocated in another order")
        views = shared.buffer("reduce_scatter", input_tensor.dtype, input_tensor.numel())
        chunk = output_tensor.numel()
        mine = slice(shared.rank * chunk, (shared.rank + 1) * chunk)
        out = output_tensor.view(-1)
        shared.barrier()  # every rank's gradients are in its buffer
        out.copy_(views[0][mine])
        for view in views[1:]:
            out.add_(view[mine])
        if op == dist.ReduceOp.AVG:
            out.div_(shared.world_size)
        shared.barrier()  # every rank has read its shard from every buffer
        self.calls += 1
        return None


def install_shm_comm(model: Any, *, setting: str, device: torch.device, role: str) -> str | None:
    """Install the shared-memory comms on a one-unit FSDP ``model`` per ``extra.comm`` (``auto``/``shm``/``gloo``);
    returns why they were not installed (None: installed). A collective where ``setting`` is not ``gloo``."""
    from hybridflow.errors import ConfigError

    if setting not in COMM_SETTINGS:
        raise ConfigError(f"{role}.extra.comm must be one of {list(COMM_SETTINGS)}, got {setting!r}")
    if setting == "gloo":
        return "extra.comm is gloo"
    groups = model._get_fsdp_state()._fsdp_param_groups if hasattr(model, "_get_fsdp_state") else []
    reason = None
    if not hasattr(model, "_get_fsdp_state"):
        reason = "the model is not sharded by FSDP"
    elif dist.get_world_size() == 1:
        reason = "one rank: nothing to communicate"
    elif setting == "auto" and (size := sum(p.numel() * p.element_size() for p in model.parameters())) < AUTO_MIN_BYTES:
        reason = f"the weights take {size} bytes, under auto's {AUTO_MIN_BYTES} (gloo is as fast there)"
    elif len(groups) != 1:
        reason = f"it needs one FSDP unit (extra.fsdp_units: model), the model has {len(groups)}"
    else:
        group = groups[0].mesh_info.shard_process_group
        # each rank: an all-gather output and a reduce-scatter input of the whole unit, at most fp32 each
        weights = sum(p.numel() for p in model.parameters()) * 4
        reason = same_host_reason(group, device, need_bytes=2 * weights * dist.get_world_size(group))
    if reason is not None:
        if setting == "shm":
            raise ConfigError(f"{role}.extra.comm is shm, but shared-memory collectives cannot run here: {reason}. "
                              f"Fix: set {role}.extra.comm to auto (gloo where shm cannot run) or gloo")
        return reason
    shared = SharedMemoryGroup(group)
    model.set_custom_all_gather(ShmAllGather(shared))
    model.set_custom_reduce_scatter(ShmReduceScatter(shared))
    return None


class SpinChannel:
    """Small collectives (all-reduce SUM, all-gather) among the ranks of one host through shared memory, waiting by
    spinning on per-rank sequence counters instead of a message: what tensor-parallel decoding needs, two all-reduces
    per layer per token of a few KB each, where a gloo call's latency is the whole cost.

    Each rank owns one ``/dev/shm`` mapping (a counter, then two slots of :attr:`SLOT_BYTES`) that every rank maps
    (unlinked once all have). A call writes this rank's tensor into the slot of its parity, publishes the call's
    sequence number, spins until every rank has published it, then reads the peers' slots (sums them in rank order,
    so every rank gets the same bits). Double-buffered: a rank writes a slot again two calls later, after every rank
    published the call in between, i.e. finished reading it. Relies on stores becoming visible in program order
    (x86's TSO): :func:`spin_channel_unsupported_reason` refuses other machines. Tensors over a slot fall back to the
    process group; a peer silent for ``timeout_s`` (dead) raises instead of spinning forever."""

    SLOT_BYTES = 4 << 20
    HEADER_BYTES = 64

    def __init__(self, group: Any, *, timeout_s: float = 120.0) -> None:
        import mmap

        import numpy as np

        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.timeout_s = float(timeout_s)
        token = [secrets.token_hex(8) if self.rank == 0 else None]
        dist.broadcast_object_list(token, group_src=0, group=group)
        self.prefix = f"hybridflow-spin-{token[0]}"
        total = self.HEADER_BYTES + 2 * self.SLOT_BYTES
        own = SHM_DIR / f"{self.prefix}-{self.rank}"
        with own.open("wb") as handle:
            handle.truncate(total)
        dist.barrier(group=group)
        self._maps = []
        for rank in range(self.size):
            with (SHM_DIR / f"{self.prefix}-{rank}").open("r+b") as handle:
                self._maps.append(mmap.mmap(handle.fileno(), total))
        dist.barrier(group=group)
        own.unlink()
        self._counters = [np.frombuffer(m, dtype=np.int64, count=1) for m in self._maps]
        self._slots = [[torch.frombuffer(m, dtype=torch.uint8, count=self.SLOT_BYTES,
                                         offset=self.HEADER_BYTES + parity * self.SLOT_BYTES) for parity in (0, 1)]
                       for m in self._maps]
        self._seq = 0
        self.calls = 0

    def _fits(self, x: torch.Tensor) -> bool:
        return x.is_contiguous() and x.device.type == "cpu" and x.numel() * x.element_size() <= self.SLOT_BYTES

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``x``, wait for every rank's, return every rank's as views of their slots (valid until the
        channel's next-but-one call)."""
        import time

        self._seq += 1
        seq, parity = self._seq, self._seq % 2
        nbytes = x.numel() * x.element_size()
        self._slots[self.rank][parity][:nbytes].copy_(x.reshape(-1).view(torch.uint8))
        self._counters[self.rank][0] = seq  # after the data: seen after it (TSO)
        for rank, counter in enumerate(self._counters):
            spins, deadline = 0, 0.0
            while counter[0] < seq:
                spins += 1
                if spins % 4096 == 0:
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_s
                    if now > deadline:
                        raise RuntimeError(f"SpinChannel: rank {rank} of the tensor group did not reach call {seq} "
                                           f"within {self.timeout_s:.0f} s (its process died or hangs)")
                    os.sched_yield()
        self.calls += 1
        return [slots[parity][:nbytes].view(x.dtype).view(x.shape) for slots in self._slots]

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (rank order: the same bits on every rank)."""
        if not self._fits(x):
            dist.all_reduce(x, group=self.group)
            return x
        parts = self._exchange(x)
        x.copy_(parts[0])
        for part in parts[1:]:
            x.add_(part)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x``, by group rank (copies)."""
        if not self._fits(x):
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            return parts
        return [part.clone() for part in self._exchange(x)]


def spin_channel_unsupported_reason(group: Any) -> str | None:
    """Why :class:`SpinChannel` cannot serve ``group`` (None: it can). A collective over ``group``."""
    import platform

    need = dist.get_world_size(group) * (SpinChannel.HEADER_BYTES + 2 * SpinChannel.SLOT_BYTES)
    reason = same_host_reason(group, torch.device("cpu"), need_bytes=need)  # first: every rank takes part
    machine = platform.machine().lower()
    if reason is None and machine not in ("x86_64", "amd64"):
        return f"it relies on x86's store order, this machine is {machine}"
    return reason
