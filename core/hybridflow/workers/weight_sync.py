"""How the actor's generation weights cross to a rollout pool (``rollout.weight_sync``, docs/guide/async.md), in
buckets of bounded bytes either way:

- ``object_store``: :func:`pack_weight_buckets` on the actor's rank 0, the buckets its call's output in Ray's object
  store, fetched by the rollout worker (:class:`~hybridflow.workers.rollout.WeightsRef`);
- ``collective``: a torch.distributed broadcast group of the actor's rank 0 (the root, which holds the gathered
  weights) and every rollout rank, gloo on CPU and NCCL when both pools are on CUDA. It is built lazily at the
  first sync of each side from a :class:`SyncGroupSpec` (a rendezvous store the driver hosts,
  :class:`SyncRendezvous`) and kept per process. The root packs one bucket at a time from the engine's weight
  stream (:func:`broadcast_weights`: no copy of the weights beyond one bucket) and broadcasts per bucket a header
  (policy version, bucket index, bytes), the bucket's layout and its bytes; :class:`WeightReceiver` checks every
  header's version against the one the rollout pool expects (:class:`VersionMismatchError` otherwise, after
  draining the rest so the group stays in step) and yields the tensors as views into the bucket received.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]  # exported at runtime

from hybridflow.errors import EngineError, VersionMismatchError

__all__ = ["BUCKET_BYTES", "WeightBucket", "iter_weight_buckets", "pack_weight_buckets", "unpack_weight_buckets",
           "SyncGroupSpec", "SyncRendezvous", "broadcast_weights", "WeightReceiver", "close_sync_groups"]

#: default bound of one bucket of a weight sync between pools (``rollout.weight_sync_bucket_bytes``)
BUCKET_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightBucket:
    """Named tensors flattened into one buffer per dtype run: ``entries`` = (name, dtype, shape, offset, numel)."""

    buffer: torch.Tensor
    entries: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel() * self.buffer.element_size())


def iter_weight_buckets(weights: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int,
                        device: str | torch.device = "cpu") -> Iterator[WeightBucket]:
    """Weights packed into buckets of at most ``bucket_bytes`` on ``device`` (a single larger tensor gets a bucket
    of its own), one dtype per bucket, each yielded once full: the stream is read one bucket ahead at most."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0

    def pack() -> WeightBucket:
        dtype = pending[0][1].dtype
        buffer = torch.empty(sum(t.numel() for _, t in pending), dtype=dtype, device=device)
        entries, offset = [], 0
        for name, tensor in pending:
            buffer[offset:offset + tensor.numel()].copy_(tensor.detach().reshape(-1))
            entries.append((name, dtype, tuple(tensor.shape), offset, tensor.numel()))
            offset += tensor.numel()
        return WeightBucket(buffer=buffer, entries=tuple(entries))

    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and (size + nbytes > bucket_bytes or tensor.dtype != pending[0][1].dtype):
            yield pack()
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield pack()


def pack_weight_buckets(weights: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int) -> list[WeightBucket]:
    """All of :func:`iter_weight_buckets` on the CPU (the object-store export); bytes copied once."""
    return list(iter_weight_buckets(weights, bucket_bytes=bucket_bytes))


def unpack_weight_buckets(buckets: Iterable[WeightBucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors of :func:`pack_weight_buckets`, as views into the buckets' buffers (streamed)."""
    for bucket in buckets:
        for name, dtype, shape, offset, numel in bucket.entries:
            if bucket.buffer.dtype != dtype:
                raise EngineError(f"weight bucket holds {bucket.buffer.dtype} but entry {name!r} says {dtype}")
            yield name, bucket.buffer[offset:offset + numel].view(shape)


# --- the collective transport --------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class SyncGroupSpec:
    """Where the members of a collective weight sync meet: the driver's rendezvous store (``host``, ``port``), the
    group's size (1 actor rank + the rollout ranks), backend, timeout of every collective, and ``epoch`` (a group
    is built once per epoch; the driver starts a new one after a failed or abandoned sync)."""

    host: str
    port: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 900.0
    epoch: int = 0

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"


class SyncRendezvous:
    """The driver's rendezvous store for the sync group (a ``TCPStore`` server on a free port, alive for the run)."""

    def __init__(self, *, world_size: int, backend: str, timeout_s: float) -> None:
        import ray

        from hybridflow.controller.host import node_ip_address

        # the address this node registered with Ray (what the workers' nodes reach it at; loopback on a local Ray)
        self.host = node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.store = TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))
        self.world_size, self.backend, self.timeout_s = world_size, backend, timeout_s
        self.epoch = 0

    def spec(self) -> SyncGroupSpec:
        return SyncGroupSpec(host=self.host, port=int(self.store.port), world_size=self.world_size,
                             backend=self.backend, timeout_s=self.timeout_s, epoch=self.epoch)

    def renew(self) -> None:
        """The next sync builds a fresh group (the old one may have a sync half done)."""
        self.epoch += 1


#: this process's sync group member, per (host, port, epoch, rank) (one rank per worker process; the key keeps the
#: members of a test that runs several in one process apart)
_GROUPS: dict[tuple[str, int, int, int], Any] = {}


def _key(spec: SyncGroupSpec, rank: int) -> tuple[str, int, int, int]:
    return spec.host, spec.port, spec.epoch, rank


#: the (host, port, epoch, rank) members whose sync failed in this process: their group is out of step for good
_FAILED: set[tuple[str, int, int, int]] = set()


def _group(spec: SyncGroupSpec, rank: int) -> Any:
    """This process's member of ``spec``'s group at ``rank`` (built on first use; blocks until every member joins,
    at most ``spec.timeout_s``). A member whose sync failed is not built again for the same epoch: its peers are
    out of step (or dead, and rebuilding would wait the whole timeout for them), so the call fails at once."""
    key = _key(spec, rank)
    if key in _FAILED:
        raise EngineError(f"the weight sync group of epoch {spec.epoch} failed in this process (rank {rank}) and its "
                          "members are out of step; expected a sync on a fresh epoch. The driver moves to one when "
                          "the failed step is retried (AsyncRollout.reset)")
    if key not in _GROUPS:
        for old in [old for old in _GROUPS if old[3] == rank]:  # an older epoch's member is abandoned
            del _GROUPS[old]
        timeout = timedelta(seconds=spec.timeout_s)
        store = PrefixStore(f"weight_sync/{spec.epoch}",
                                 TCPStore(spec.host, spec.port, is_master=False, timeout=timeout))
        if spec.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            _GROUPS[key] = dist.ProcessGroupNCCL(store, rank, spec.world_size, options)
        elif spec.backend == "gloo":
            _GROUPS[key] = dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)
        else:
            raise EngineError(f"weight sync backend must be gloo or nccl, got {spec.backend!r}")
    return _GROUPS[key]


def close_sync_groups() -> None:
    """Forget this process's sync group members and failed epochs (its roles are closing: the process may host the
    next run's, whose driver starts its own store)."""
    _GROUPS.clear()
    _FAILED.clear()


def _drop(spec: SyncGroupSpec, rank: int) -> None:
    """Forget a member whose sync failed, and refuse its epoch from now on in this process."""
    _GROUPS.pop(_key(spec, rank), None)
    _FAILED.add(_key(spec, rank))


_HEADER = 4  # int64: policy version, bucket index (-1: the end), payload bytes, layout bytes


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    group.broadcast(tensor, 0).wait()


def broadcast_weights(spec: SyncGroupSpec, weights: Iterable[tuple[str, torch.Tensor]], *, version: int,
                      bucket_bytes: int) -> dict[str, float]:
    """Send ``weights`` (a stream) as the root of ``spec``'s group, bucket by bucket, each tagged with ``version``.
    Returns bytes, buckets, the largest bucket's bytes and the seconds taken (waiting for the receivers included).
    When the group fails (a receiver died, or hung past the timeout) the stream is read to its end before the error
    is raised: producing it may be a collective of the sender's own group."""
    started = time.perf_counter()
    stream = iter(weights)
    sent = buckets = peak = 0
    try:
        group = _group(spec, 0)
        for index, bucket in enumerate(iter_weight_buckets(stream, bucket_bytes=bucket_bytes, device=spec.device)):
            layout = json.dumps({"dtype": str(bucket.buffer.dtype).removeprefix("torch."),
                                 "entries": [[name, list(shape)] for name, _, shape, _, _ in bucket.entries]})
            encoded = torch.frombuffer(bytearray(layout.encode()), dtype=torch.uint8).to(spec.device)
            _broadcast(group, torch.tensor([version, index, bucket.nbytes, encoded.numel()], device=spec.device))
            _broadcast(group, encoded)
            _broadcast(group, bucket.buffer.view(torch.uint8))
            sent, buckets, peak = sent + bucket.nbytes, buckets + 1, max(peak, bucket.nbytes)
        _broadcast(group, torch.tensor([version, -1, 0, 0], device=spec.device))
    except BaseException:
        _drop(spec, 0)  # a half-done sync leaves the group out of step: the next epoch builds a new one
        # a receiver died or hung: the rest of the stream is still read, since producing it may be a collective of
        # the actor's ranks (the FSDP gather), which must not be left blocked in it while this rank moves on
        for _ in stream:
            pass
        raise
    return {"bytes": float(sent), "buckets": float(buckets), "peak_bucket_bytes": float(peak),
            "send_s": time.perf_counter() - started}


class WeightReceiver:
    """A rollout rank's side of a collective sync: :meth:`named_tensors` streams the buckets the root sends (views
    into the bucket just received), checking each bucket's version tag against ``expected_version``; :meth:`drain`
    receives whatever the root still sends (after a mismatch, or when the loader stopped early)."""

    def __init__(self, spec: SyncGroupSpec, rank: int, *, expected_version: int,
                 before_bucket: Callable[[int], None] | None = None) -> None:
        self.spec, self.expected_version = spec, int(expected_version)
        self.before_bucket = before_bucket  # called with a bucket's index once received, before its tensors yield
        self.rank = rank
        self.group = _group(spec, rank)
        self.bytes = self.buckets = self.peak_bucket_bytes = 0
        self.first_header_s: float | None = None  # seconds until the root started sending (its update + gather)
        self._started = time.perf_counter()
        self._done = False

    def _receive(self) -> tuple[int, int, dict[str, Any] | None, torch.Tensor | None]:
        try:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.spec.device)
            _broadcast(self.group, header)
            if self.first_header_s is None:
                self.first_header_s = time.perf_counter() - self._started
            version, index, nbytes, layout_bytes = (int(v) for v in header.tolist())
            if index < 0:
                self._done = True
                return version, index, None, None
            encoded = torch.zeros(layout_bytes, dtype=torch.uint8, device=self.spec.device)
            _broadcast(self.group, encoded)
            payload = torch.empty(nbytes, dtype=torch.uint8, device=self.spec.device)
            _broadcast(self.group, payload)
        except BaseException:
            _drop(self.spec, self.rank)
            self._done = True
            raise
        layout: dict[str, Any] = json.loads(encoded.cpu().numpy().tobytes().decode())
        self.bytes, self.buckets = self.bytes + nbytes, self.buckets + 1
        self.peak_bucket_bytes = max(self.peak_bucket_bytes, nbytes)
        return version, index, layout, payload

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        expected_index = 0
        while not self._done:
            version, index, layout, payload = self._receive()
            if version != self.expected_version:
                self.drain()
                raise VersionMismatchError(f"the actor sent weights of version {version}; the rollout pool expects "
                                           f"version {self.expected_version} (did the update before the sync fail?)")
            if layout is None or payload is None:
                return
            if index != expected_index:
                self.drain()
                raise EngineError(f"weight sync bucket {index} arrived, bucket {expected_index} was expected")
            expected_index += 1
            if self.before_bucket is not None:
                self.before_bucket(index)
            dtype = getattr(torch, layout["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise EngineError(f"weight sync bucket of unknown dtype {layout['dtype']!r}")
            buffer, offset = payload.view(dtype), 0
            for name, shape in layout["entries"]:
                numel = 1
                for dim in shape:
                    numel *= int(dim)
                yield name, buffer[offset:offset + numel].view(tuple(shape))
                offset += numel

    def drain(self) -> None:
        while not self._done:
            self._receive()

    def stats(self) -> dict[str, float]:
        total = time.perf_counter() - self._started
        waited = self.first_header_s or 0.0
        return {"version": float(self.expected_version), "bytes": float(self.bytes), "buckets": float(self.buckets),
                "peak_bucket_bytes": float(self.peak_bucket_bytes), "wait_s": waited, "load_s": total - waited}
