"""The Ray actor behind one slot of a worker group: it hosts every colocated role and runs their methods.

It resolves arguments from the object store (counting the bytes it fetched), strips padding, reports errors
with tracebacks and dumps its threads' stacks on request; which rows it receives is decided by the driver.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import ray

from hybridflow.batch import PADDING_KEY, Batch
from hybridflow.controller import process_state
from hybridflow.controller.worker import WorkerContext, set_context
from hybridflow.engines import MeshInfo
from hybridflow.errors import is_deterministic
from hybridflow.transfer.concat import concat_batches

__all__ = ["FetchArg", "RankPayload", "RankResult", "WorkerHost", "reserve_port", "tune_malloc", "value_nbytes"]


@dataclass(frozen=True, slots=True)
class FetchArg:
    """An argument the receiving rank fetches itself: the concatenation of ``refs`` plus optional padding rows, or
    a small batch carried ``inline`` in the call itself (no object-store round trip; its bytes still count)."""

    refs: tuple[Any, ...]
    padding_rows: int = 0
    pad_ref: Any = None
    mark_padding: bool = False
    inline: Any = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPayload:
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    padding_rows: int = 0
    deadline_at: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class RankResult:
    """What a rank reports about one call (small; the output itself is a separate object)."""

    rank: int
    ok: bool = True
    error: str = ""
    remote_traceback: str = ""
    is_batch: bool = False
    rows: int = 0
    nbytes_out: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    bytes_in: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)
    #: the error repeats on any retry (hybridflow.errors.is_deterministic)
    deterministic: bool = False


#: glibc mallopt parameters: M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def tune_malloc(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Keep freed tensor memory in this process's heap (glibc only; a no-op elsewhere); True when applied.

    Training steps allocate and free the same activation sizes every iteration. With glibc's defaults, blocks over
    its (adaptive) mmap threshold are mapped and unmapped each time and a grown heap is trimmed back, so every step
    page-faults its activations in again (hundreds of faults per step measured on the tiny GRPO fixture, up to
    ~1.5x its update time). Blocks under 256 MiB now come from the heap, which is kept up to 1 GiB above use: the
    18.9M-parameter bf16 update's per-step fp32 gradient buffers (76 MB each) were still mapped anew under the
    earlier 64 MiB threshold, ~37,000 minor faults and 8% of the update per step; none now.
    Workers call it at start-up unless ``HYBRIDFLOW_MALLOC_TUNING=0``.
    """
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or "glibc" not in " ".join(platform.libc_ver()).lower():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)))
    except (OSError, AttributeError):
        return False


def reserve_port(address: str | None = None) -> socket.socket:
    """A socket bound to a free TCP port on every local address (the IPv6 dual-stack wildcard, else IPv4's) with
    SO_REUSEADDR and left open, not listening: the port stays this process's until the socket is closed (the kernel
    hands it to no other ``bind(0)`` on any address, and a plain ``bind`` anywhere fails), while a listener that sets
    SO_REUSEADDR, as torch's TCPStore does, can still bind it.

    Rank 0's rendezvous port is reserved this way: a port that was bound once and closed could be taken by another
    process (another worker group's reservation) before rank 0's TCPStore binds it, and the other ranks would then
    wait on the wrong store until their deadline. The wildcard matters: TCPStore listens on every address, so a port
    held on one address only (the node's IP) could still be handed to a reservation on another (127.0.0.1) whose
    store then takes the wildcard listen first, and rank 0's store fails with EADDRINUSE.

    ``address`` (an IPv4 address) holds the port on that address only, as the spawn test helper does on 127.0.0.1:
    the kernel still hands it to no wildcard reservation (a wildcard conflicts with every address).
    """
    if address is not None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, 0))
        return sock
    if socket.has_ipv6:
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        except OSError:  # pragma: no cover - IPv6 compiled in but disabled on this host
            pass
        else:
            try:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual-stack: IPv4 addresses too
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("::", 0))
                return sock
            except OSError:  # pragma: no cover - no IPv6 address to bind
                sock.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    return sock


def value_nbytes(value: Any) -> int:
    """Tensor/array bytes of a fetched value (Batch tensors, numpy arrays, torch tensors); 0 otherwise."""
    if isinstance(value, Batch):
        return value.nbytes()
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.element_size() * value.numel())
    return 0


def node_ip_address() -> str:
    """The address the Ray node of this process registered with the cluster (its ``NodeManagerAddress``)."""
    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if node.get("NodeID") == here:
            return str(node["NodeManagerAddress"])
    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]  # pragma: no cover


def _is_user_frame(filename: str) -> bool:
    """False for frames inside Ray or the standard library's threading machinery."""
    ignored = (f"{os.sep}ray{os.sep}", "threading.py", f"concurrent{os.sep}futures", "queue.py", "selectors.py")
    return not any(part in filename for part in ignored) or "hybridflow" in filename


def _fetch(arg: FetchArg, deadline_at: float) -> tuple[Any, int]:
    if arg.inline is not None:
        return arg.inline, value_nbytes(arg.inline)
    timeout = max(1.0, deadline_at - time.time())
    refs = list(arg.refs) + ([arg.pad_ref] if arg.pad_ref is not None else [])
    values = ray.get(refs, timeout=timeout)
    fetched = sum(value_nbytes(value) for value in values)
    pieces = values[: len(arg.refs)]
    if arg.pad_ref is not None and arg.padding_rows:
        pieces.append(values[-1].index([0] * arg.padding_rows))
    if len(pieces) == 1 and not arg.mark_padding:
        return pieces[0], fetched
    pieces = [piece for piece in pieces if len(piece)]
    batch = concat_batches(pieces) if len(pieces) > 1 else pieces[0]
    return (batch.mark_padding(arg.padding_rows) if arg.mark_padding else batch), fetched


def _strip_padding(output: Any, padding_rows: int, input_rows: int) -> Any:
    if not padding_rows or not isinstance(output, Batch):
        return output
    if PADDING_KEY in output.tensors.keys():
        return output.drop_padding()
    if len(output) == input_rows:
        return output.slice(0, len(output) - padding_rows)
    raise ValueError(
        f"cannot strip {padding_rows} padding rows: the output has {len(output)} rows, expected {input_rows} (one per "
        f"input row) or an {PADDING_KEY!r} column. Fix: keep the input's {PADDING_KEY!r} column in the output"
    )


@ray.remote(  # type: ignore[call-overload]  # ray's keyword overload lists task options only, not actor options
    concurrency_groups={"control": 1, "transfer": 2}, max_restarts=0
)
class WorkerHost:
    """One slot: the colocated role instances of a group, sharing this process."""

    def __init__(self, group: str, rank: int, world_size: int, local_rank: int) -> None:
        self.context = WorkerContext(group=group, rank=rank, world_size=world_size, local_rank=local_rank)
        self.roles: dict[str, Any] = {}
        self._port_reservation: socket.socket | None = None  # held for this process's life: reserve_port
        if os.environ.get("HYBRIDFLOW_MALLOC_TUNING", "1") != "0":
            tune_malloc()
        try:
            import torch

            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        except ImportError:  # pragma: no cover - torch is a core dependency
            pass
        #: what a fresh process looks like, put back when the host is parked (hybridflow.controller.park)
        self._baseline = process_state.capture()
        self._threads_before: set[int] = set()
        #: groups this process has hosted (1 on a fresh process)
        self.hosted = 0

    def rebind(self, group: str, rank: int, world_size: int, local_rank: int) -> int:
        """Take a slot of a new group (a parked host, reused); returns this process's pid."""
        if self.roles:
            raise RuntimeError(f"rank {self.context.rank} of {self.context.group} still hosts roles "
                               f"{sorted(self.roles)}; expected a parked host (park() first)")
        self.context = WorkerContext(group=group, rank=rank, world_size=world_size, local_rank=local_rank)
        return os.getpid()

    def park(self) -> tuple[bool, str]:
        """Close and drop every role, then put the process back as a fresh one (process_state.restore);
        ``(True, "")`` when it may host another group's roles, else ``(False, why not)``. Every role must say yes
        through ``reusable_process()`` (core roles: their engines' info records); then each role's ``close()``
        runs."""
        reasons = []
        for name, role in self.roles.items():
            ask = getattr(role, "reusable_process", None)
            try:
                if not callable(ask) or not ask():
                    reasons.append(f"role {name} ({type(role).__qualname__}) is not reusable_process()")
            except Exception as exc:  # noqa: BLE001 - the process is then not reused
                reasons.append(f"role {name}'s reusable_process() raised {type(exc).__name__}: {exc}")
        if reasons:  # the driver kills this process: nothing to close
            return False, "; ".join(reasons)
        for name, role in self.roles.items():
            close = getattr(role, "close", None)
            try:
                if callable(close):
                    close()
            except Exception as exc:  # noqa: BLE001 - the process is then not reused
                reasons.append(f"closing role {name} failed: {type(exc).__name__}: {exc}")
        self.roles = {}
        if self._port_reservation is not None:
            self._port_reservation.close()
            self._port_reservation = None
        reasons += process_state.restore(self._baseline, self._threads_before)
        return not reasons, "; ".join(reasons)

    def reserve_master_address(self, loopback: bool) -> tuple[str, int]:
        """This node's IP (127.0.0.1 on a single-machine Ray) and a free TCP port, for rank 0's rendezvous.

        On a cluster it is the address this node registered with Ray (``ray start --node-ip-address``, what the
        other nodes reach it at), not ``ray.util.get_node_ip_address()``, which in a worker process guesses from
        the default route (e.g. a public interface while the cluster runs on a private network or on loopback).
        """
        address = "127.0.0.1" if loopback else node_ip_address()
        if self._port_reservation is not None:
            self._port_reservation.close()
        self._port_reservation = reserve_port()
        return address, int(self._port_reservation.getsockname()[1])

    def setup(self, master_addr: str, master_port: int, role_classes: dict[str, type],
              init_kwargs: dict[str, dict[str, Any]]) -> RankResult:
        """Export the distributed environment and construct every role (errors come back with the traceback)."""
        started = time.time()
        context = self.context
        self.context = WorkerContext(group=context.group, rank=context.rank, world_size=context.world_size,
                                     local_rank=context.local_rank, master_addr=master_addr, master_port=master_port)
        set_context(self.context)
        self._threads_before = process_state.python_threads()
        self.hosted += 1
        try:
            for role, cls in role_classes.items():
                self.roles[role] = cls(**init_kwargs.get(role, {}))
        except Exception as exc:  # noqa: BLE001 - reported to the driver as WorkerError
            return RankResult(rank=context.rank, ok=False, error=f"{type(exc).__name__}: {exc}",
                              remote_traceback=traceback.format_exc(), started_at=started, finished_at=time.time())
        return RankResult(rank=context.rank, started_at=started, finished_at=time.time())

    @ray.method(num_returns=2)
    def execute(self, role: str, method: str, payload: RankPayload) -> tuple[Any, RankResult]:
        """Run ``role.method`` on this rank's arguments; return (output, report)."""
        started = time.time()
        bytes_in = 0
        input_rows = 0
        try:
            args = []
            for value in payload.args:
                if isinstance(value, FetchArg):
                    value, fetched = _fetch(value, payload.deadline_at)
                    bytes_in += fetched
                    input_rows = max(input_rows, len(value) if isinstance(value, Batch) else 0)
                args.append(value)
            kwargs = {}
            for key, value in payload.kwargs.items():
                if isinstance(value, FetchArg):
                    value, fetched = _fetch(value, payload.deadline_at)
                    bytes_in += fetched
                    input_rows = max(input_rows, len(value) if isinstance(value, Batch) else 0)
                kwargs[key] = value
            output = getattr(self.roles[role], method)(*args, **kwargs)
            output = _strip_padding(output, payload.padding_rows, input_rows)
        except Exception as exc:  # noqa: BLE001 - reported to the driver as WorkerError
            return None, RankResult(rank=self.context.rank, ok=False, error=f"{type(exc).__name__}: {exc}",
                                    remote_traceback=traceback.format_exc(), bytes_in=bytes_in,
                                    started_at=started, finished_at=time.time(),
                                    deterministic=is_deterministic(exc))
        is_batch = isinstance(output, Batch)
        counters = getattr(self.roles[role], "counters", None)
        return output, RankResult(
            rank=self.context.rank,
            is_batch=is_batch,
            rows=len(output) if is_batch else 0,
            nbytes_out=value_nbytes(output),
            meta=dict(output.meta) if is_batch else {},
            bytes_in=bytes_in,
            started_at=started,
            finished_at=time.time(),
            counters=dict(counters()) if callable(counters) else {},
        )

    @ray.method(concurrency_group="transfer")
    def slice_rows(self, value: Batch, start: int, stop: int) -> Batch:
        """Rows ``[start, stop)`` of one of this rank's outputs, stored as a new object (only that shard moves)."""
        return value.slice(start, stop)

    @ray.method(concurrency_group="control")
    def dump_stacks(self) -> str:
        """Python stacks of every thread in this process except the one answering (the watchdog's evidence)."""
        me = threading.get_ident()
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        parts = [f"--- rank {self.context.rank} pid {os.getpid()} ---"]
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            summary = traceback.extract_stack(frame)
            if not any(_is_user_frame(entry.filename) for entry in summary):
                continue  # Ray's and the interpreter's idle threads are noise
            parts.append(f"Thread {names.get(ident, ident)}:\n{''.join(summary.format()[-40:])}")
        return "\n".join(parts)

    @ray.method(concurrency_group="control")
    def process_location(self) -> tuple[int, str]:
        """(pid, Ray node id) of this worker process."""
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def engine_options(self, role: str) -> dict[str, Any]:
        """What ``role``'s engines resolved (``resolved_options()`` of its training and rollout engine, where they
        report one): the manifest's ``engine_options``, e.g. the precision, the gradient reduction dtype and the
        collectives an ``auto`` setting chose on this machine."""
        instance = self.roles[role]
        options: dict[str, Any] = {}
        for key, engine in (("training", getattr(instance, "engine", None)), ("rollout", getattr(instance, "rollout",
                                                                                               None))):
            report = getattr(engine, "resolved_options", None)
            if callable(report):
                options[key] = dict(report())
        return options

    def mesh_info(self, role: str) -> MeshInfo:
        instance = self.roles[role]
        report = getattr(instance, "mesh_info", None)
        if report is None:
            return MeshInfo(dp_rank=self.context.rank, dp_size=self.context.world_size, is_collect=True)
        info = report()
        generation = getattr(info, "generation", None)
        return MeshInfo(dp_rank=int(info.dp_rank), dp_size=int(info.dp_size), is_collect=bool(info.is_collect),
                        generation=None if generation is None else MeshInfo(
                            dp_rank=int(generation.dp_rank), dp_size=int(generation.dp_size),
                            is_collect=bool(generation.is_collect)))
