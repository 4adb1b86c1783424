"""Train → generate weight handover of the FSDP engine: this rank's generation shards, from its FSDP shards, with
the bytes it sent and received counted.

Two paths, chosen by the training engine's ``extra["handover"]``:

- ``"reshard"`` (default): the 3D-HybridEngine planner and executor (:mod:`hybridflow.resharding`) from the FSDP
  layout (d ranks) to the generation layout (pg = 1, tg; micro-DP d / tg, stride grouping): the plan is built once
  and reused, bytes are counted from the buffers the executor actually sent and received (in bounded buckets), next
  to the plan's lower bound, and generation shards that coincide with the FSDP shard are views of it. The whole
  generation model is produced before the first tensor is yielded. With ``park=True`` (the actor worker's default
  when its rollout engine binds the shards) every other FSDP shard is *parked* in the generation shard that contains
  it: once the executor has copied it there (bucket by bucket), its FSDP storage is released
  (:class:`hybridflow.resharding.StorageParking`, one storage per FSDP parameter), so while generating a
  rank holds its weights once (M/(tg·pg) plus what its micro-DP group sent). :func:`restore_training_shards` (the
  engine's ``end_generation()``) gives each FSDP shard its storage back from that generation shard, parameter by
  parameter, bit for bit; a forward or a state_dict call on the model does it first too.
  At tg = 1, when the engine is one FSDP unit that keeps its weights gathered from its forward into its backward
  (the trainable actor without LoRA: ``engine.unshard_handover``, ``extra.handover_unshard: auto`` takes it under
  ``mixed_precision=bf16`` and for fp32 models up to 64 MiB of weights), the handover instead *is* FSDP's own
  all-gather (:func:`unshard_generation_weights`): generation binds views of FSDP's unsharded parameters, and the
  update's forward that follows finds them gathered and does not gather again — one all-gather of the weights per
  step instead of two, the same bytes on the wire as the planner's (the lower bound, Shard(0) without padding; in
  bf16 under mixed precision, half the fp32 bytes, which a bf16 rollout engine binds as they are).
- ``"stream"`` (tg = 1 only): one ``DTensor.full_tensor`` per parameter, so only one gathered parameter is alive at a
  time; bytes received are computed as the payload each rank lacked (full − shard), not counted from buffers.

With LoRA (``actor.lora``) both paths hand over the base model's parameters with the adapters merged into their
weights (:func:`generation_parameters`) — unless the rollout engine applies adapters itself
(:mod:`hybridflow.adapter_sync`, the default with the hf engine): then the first handover is the *base* weights
(``merge_lora=False``) and every later one :func:`adapter_generation_weights`, the factors alone.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from hybridflow.errors import EngineError
from hybridflow.resharding.parking import StorageParking
from hybridflow.resharding.planner import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from hybridflow.resharding import ReshardPlan
    from hybridflow_fsdp.training import FSDPTrainingEngine

__all__ = ["HandoverStats", "generation_parameters", "stream_generation_weights", "reshard_generation_weights",
           "handover_plan", "fsdp_shard_dims", "restore_training_shards", "parked_bytes", "TARGETS", "PATHS",
           "DEFAULT_PATH", "unshard_generation_weights", "unshard_handover_unsupported_reason", "fsdp_params",
           "adapter_generation_weights"]

TARGETS = ("hf",)
PATHS = ("reshard", "stream")
DEFAULT_PATH = "reshard"


@dataclass(frozen=True, kw_only=True, slots=True)
class HandoverStats:
    """What one handover moved on this rank.

    ``path="reshard"``: ``bytes_received``/``bytes_sent`` are the executor's counts of the buffers it received and
    sent, ``lower_bound_bytes`` what this rank had to receive at least (its generation shards minus what it held),
    ``aliased_bytes`` the generation shards handed over as views of the training storage, ``peak_gathered_bytes``
    the executor's memory high-water mark above max(source, target) footprint, ``parked_bytes`` the FSDP storage
    released while generating (``park=True``: those shards live on in their generation shards). ``path="stream"``:
    ``bytes_received`` is computed (full tensor − own shard per parameter), ``peak_gathered_bytes`` the largest full
    tensor alive at once. ``via``: what moved the bytes of a ``reshard``: ``"executor"`` (the planner's executor) or
    ``"fsdp_all_gather"`` (:func:`unshard_generation_weights`: FSDP's own all-gather, bytes counted from its buffers,
    0 when the unit was already gathered; every generation weight a view of FSDP's unsharded parameters;
    ``peak_gathered_bytes`` its shards + its flat all-gather buffer, alive with the gathered weights at its peak).
    """

    rank: int
    world_size: int
    parameters: int
    bytes_total: int
    bytes_local: int
    bytes_received: int
    peak_gathered_bytes: int
    seconds: float
    path: str = "stream"
    bytes_sent: int | None = None
    lower_bound_bytes: int | None = None
    aliased_bytes: int = 0
    tensor_parallel_size: int = 1
    parked_bytes: int = 0
    via: str = "executor"


def _base_parameters(engine: FSDPTrainingEngine) -> dict[str, torch.Tensor]:
    """The model's parameters by HF name, LoRA adapter factors left out."""
    from hybridflow_fsdp.lora import is_adapter_name

    return {name: p for name, p in engine.model.named_parameters() if not is_adapter_name(name)}


def generation_parameters(engine: FSDPTrainingEngine, *, merge_lora: bool = True) -> dict[str, torch.Tensor]:
    """What generation receives, by HF name: the model's parameters, with LoRA adapters (``actor.lora``) merged
    into their base weights (``W + B·A·scale``, fresh tensors in the weight's placement; a collective), or with
    ``merge_lora=False`` the base weights alone."""
    from hybridflow_fsdp.lora import merged_parameters

    if engine.config.lora is None:
        return dict(engine.model.named_parameters())
    return merged_parameters(engine.model) if merge_lora else _base_parameters(engine)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def stream_generation_weights(engine: FSDPTrainingEngine, *, target: str = "hf") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf name, full tensor)`` for every parameter (tied weights once), gathering shard by shard.

    Every rank must consume the whole iterator in step (each item is an all-gather). On exhaustion the engine's
    ``last_handover_stats`` holds a :class:`HandoverStats`.
    """
    from torch.distributed.tensor import DTensor

    if target not in TARGETS:
        raise EngineError(f"generation weight target {target!r} is not supported by the fsdp engine; known: {TARGETS}")
    started = time.perf_counter()
    total = local = received = peak = count = 0
    engine.last_handover_stats = None
    with torch.no_grad():
        for name, parameter in generation_parameters(engine).items():
            if isinstance(parameter, DTensor):
                shard = parameter.to_local()
                full = parameter.full_tensor()
            else:
                shard = full = parameter.detach()
            count += 1
            total += _nbytes(full)
            local += _nbytes(shard)
            received += _nbytes(full) - _nbytes(shard)
            peak = max(peak, _nbytes(full))
            yield name, full.detach()
            del full
    engine.last_handover_stats = HandoverStats(
        rank=engine.rank, world_size=engine.world_size, parameters=count, bytes_total=total, bytes_local=local,
        bytes_received=received, peak_gathered_bytes=peak, seconds=time.perf_counter() - started,
    )


def adapter_generation_weights(engine: FSDPTrainingEngine) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, whole factor)`` for every LoRA factor (``….lora_A`` / ``….lora_B``), all-gathered from the FSDP
    shards (a collective: every rank consumes the whole iterator). ``last_handover_stats``: ``path="adapters"``,
    bytes received computed as for ``stream`` (whole factor − own shard, per factor), ``bytes_total`` the adapter
    bytes."""
    from torch.distributed.tensor import DTensor

    from hybridflow_fsdp.lora import full_adapters, is_adapter_name

    started = _begin_handover(engine, "hf")
    shards = {name: p for name, p in engine.model.named_parameters() if is_adapter_name(name)}
    local = sum(_nbytes(p.to_local() if isinstance(p, DTensor) else p) for p in shards.values())
    factors = full_adapters(engine.model)
    total = sum(_nbytes(tensor) for tensor in factors.values())
    engine.last_handover_stats = HandoverStats(
        rank=engine.rank, world_size=engine.world_size, parameters=len(factors), bytes_total=total, bytes_local=local,
        bytes_received=total - local, peak_gathered_bytes=total, seconds=time.perf_counter() - started,
        path="adapters", via="full_tensor")
    yield from factors.items()


def fsdp_shard_dims(engine: FSDPTrainingEngine) -> dict[str, int]:
    """Tensor dim each parameter is FSDP-sharded along, read from its DTensor placement (0 for plain tensors)."""
    from torch.distributed.tensor import DTensor, Shard

    dims = {}
    for name, parameter in _base_parameters(engine).items():
        placement = parameter.placements[0] if isinstance(parameter, DTensor) else None
        dims[name] = placement.dim if isinstance(placement, Shard) else 0
    return dims


def handover_plan(engine: FSDPTrainingEngine, *, tensor: int = 1) -> ReshardPlan:
    """The ``hybridflow`` plan from the engine's FSDP shards to generation layout (pg = 1, tg = ``tensor``), built on
    first use and cached per ``tensor``."""
    from hybridflow.resharding import plan_reshard
    from hybridflow_fsdp.layouts import build_fsdp_training_layout, build_hf_rollout_layout

    plans = engine._handover_plans
    if tensor not in plans:
        parameters = _base_parameters(engine)
        shapes = {name: tuple(p.shape) for name, p in parameters.items()}
        dtype = next(iter(parameters.values())).dtype
        source = build_fsdp_training_layout(shapes, data=engine.world_size, dtype=dtype,
                                            shard_dims=fsdp_shard_dims(engine))
        target = build_hf_rollout_layout(shapes, data=engine.world_size, tensor=tensor, dtype=dtype)
        bucket = int(engine.config.extra.get("handover_bucket_bytes", DEFAULT_BUCKET_BYTES))
        plans[tensor] = plan_reshard(source, target, strategy="hybridflow", bucket_bytes=bucket)
    return plans[tensor]


def _begin_handover(engine: FSDPTrainingEngine, target: str) -> float:
    """Check ``target``, bring a previous handover's parked shards home before anything reads them, clear the last
    stats; the start time."""
    if target not in TARGETS:
        raise EngineError(f"generation weight target {target!r} is not supported by the fsdp engine; known: {TARGETS}")
    restore_training_shards(engine)
    engine.last_handover_stats = None
    return time.perf_counter()


def reshard_generation_weights(engine: FSDPTrainingEngine, *, target: str = "hf", tensor: int = 1,
                               park: bool = False, merge_lora: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf name, this rank's generation shard)`` for generation layout (pg = 1, tg = ``tensor``), moved by the
    reshard planner's cached plan (stride grouping: only the micro-DP group's pieces travel); a collective: every
    rank must consume the whole iterator.

    Shards whose box this rank's FSDP shard already is (column/vocab weights at d == tg, row weights too when the
    engine shards them along dim 1) are views of the training storage, not copies: the consumer must not write
    into them. With ``park`` every other FSDP shard whose box lies inside this rank's generation shard is released
    once copied there (see the module docstring): the consumer must not write into those generation shards either
    until :func:`restore_training_shards`. ``last_handover_stats`` gets the executor's counts and the plan's lower
    bound. ``merge_lora=False``: a LoRA actor's base weights, adapters not merged.
    """
    from torch.distributed.tensor import DTensor

    from hybridflow.resharding import execute_reshard

    started = _begin_handover(engine, target)
    parameters = generation_parameters(engine, merge_lora=merge_lora)
    plan = handover_plan(engine, tensor=tensor)
    parking = None
    with torch.no_grad():
        local = {name: (p.to_local() if isinstance(p, DTensor) else p).detach() for name, p in parameters.items()}
        if park:  # every FSDP shard that lies in this rank's generation shards gives its own storage up once copied
            _install_restore_hooks(engine)
            parking = StorageParking(plan, engine.rank, local)
        shards, stats = execute_reshard(plan, local, rank=engine.rank, views=True,
                                        on_release=None if parking is None else parking.on_release)
        if parking is not None and parking.finish(shards):
            _PARKED[engine] = parking
    engine.last_handover_stats = HandoverStats(
        rank=engine.rank, world_size=engine.world_size, parameters=len(parameters), bytes_total=stats.target_bytes,
        bytes_local=stats.source_bytes, bytes_received=stats.bytes_received, peak_gathered_bytes=stats.peak_extra_bytes,
        seconds=time.perf_counter() - started, path="reshard", bytes_sent=stats.bytes_sent,
        lower_bound_bytes=plan.lower_bound_bytes(engine.rank), aliased_bytes=stats.aliased_bytes,
        tensor_parallel_size=tensor, parked_bytes=0 if parking is None else parking.parked_bytes,
    )
    for name in parameters:
        yield name, shards.pop(name)


def fsdp_params(engine: FSDPTrainingEngine) -> list[Any]:
    """FSDP2's per-parameter states (``FSDPParam``) of the engine's FSDP units: torch's private ``fully_shard``
    internals, which :func:`unshard_handover_unsupported_reason` checks before the unshard handover relies on them."""
    state = engine.model._get_fsdp_state()  # type: ignore[operator]
    return [param for group in state._fsdp_param_groups for param in group.fsdp_params]


def unshard_handover_unsupported_reason(engine: FSDPTrainingEngine) -> str | None:
    """Why FSDP's own all-gather cannot be the handover of this engine (None: it can): it needs one FSDP unit, every
    parameter sharded along dim 0 in its own padded storage (what :class:`_ShardParking` releases and restores)."""
    from torch.distributed.tensor import Shard

    if not hasattr(engine.model, "_get_fsdp_state"):
        return "the model is not sharded by FSDP2"
    state = engine.model._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None or len(groups) != 1:
        return f"it needs exactly one FSDP unit, the model has {0 if groups is None else len(groups)}"
    for param in fsdp_params(engine):
        data = getattr(param, "_sharded_param_data", None)
        placement = getattr(param, "fsdp_placement", None)
        if not isinstance(data, torch.Tensor) or not isinstance(placement, Shard) or placement.dim != 0:
            return f"parameter {getattr(param, '_param_fqn', '?')} is not sharded along dim 0 in a flat buffer"
        if data.storage_offset() != 0 or data.untyped_storage().nbytes() != _nbytes(data):
            return f"parameter {getattr(param, '_param_fqn', '?')} shares its shard's storage"
    return None


class _ShardParking:
    """The FSDP shards of a one-unit engine, released while generation reads the weights FSDP gathered: rank r's
    padded shard of each parameter is row r of FSDP's all-gather output, from which :meth:`restore` copies it back
    (bit for bit, padding included) as long as the unit stays gathered — :func:`restore_training_shards` runs before
    anything reshards it (``engine._ensure_sharded``) or reads the shards (a forward, a state_dict)."""

    def __init__(self, params: list[Any], *, rank: int, world_size: int) -> None:
        self._params = params
        self._rank, self._world_size = rank, world_size
        self._sizes: list[int] = [int(param._sharded_param_data.untyped_storage().nbytes()) for param in params]
        for param in params:
            param._sharded_param_data.untyped_storage().resize_(0)
        self.parked_bytes: int = sum(self._sizes)

    def restore(self) -> int:
        with torch.no_grad():
            for param, size in zip(self._params, self._sizes, strict=True):
                data = param._sharded_param_data
                data.untyped_storage().resize_(size)
                data.copy_(param.all_gather_outputs[0].view(self._world_size, -1)[self._rank])
        restored, self.parked_bytes = self.parked_bytes, 0
        return restored


def unshard_generation_weights(engine: FSDPTrainingEngine, *, target: str = "hf",
                               park: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf name, full tensor)`` for every parameter at tg = 1, gathered by FSDP's own all-gather
    (``FSDPModule.unshard``; nothing moves when a no-grad forward left the unit gathered): each tensor is a view of
    FSDP's unsharded parameter, which the next forward (the update's) uses without gathering again, as FSDP keeps a
    one-unit trainable model gathered (``reshard_after_forward=False``). The views stay valid until the unit is
    resharded (after the next update's last backward, a checkpoint, an export); the consumer must not write into
    them. With ``park`` the FSDP shards give their storage up while generating (the weights are held once) and
    :func:`restore_training_shards` copies them back from the gathered weights. A collective: every rank must
    consume the whole iterator. ``last_handover_stats``: ``path="reshard"``, ``via="fsdp_all_gather"``, bytes
    received counted from FSDP's buffers next to the planner's lower bound (0 and 0 when nothing moved)."""
    from torch.distributed.fsdp import FSDPModule

    started = _begin_handover(engine, target)
    params = fsdp_params(engine)
    groups = engine.model._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
    gathered = all(group.is_unsharded for group in groups)
    shard_bytes = sum(_nbytes(param._sharded_param_data) for param in params)
    with torch.no_grad():
        cast("FSDPModule", engine.model).unshard()
    output_bytes = sum(_nbytes(param.all_gather_outputs[0]) for param in params)
    # under mixed precision FSDP gathers the shards cast to the compute dtype: bytes on the wire in that dtype
    wire = params[0].all_gather_outputs[0].element_size() / params[0]._sharded_param_data.element_size()
    received = 0 if gathered else output_bytes - int(shard_bytes * wire)
    lower_bound = 0 if gathered else int(handover_plan(engine, tensor=1).lower_bound_bytes(engine.rank) * wire)
    weights = {name: parameter.detach() for name, parameter in engine.model.named_parameters()}
    parking = None
    # under mixed precision the gathered weights are bf16 copies, not the fp32 shards: nothing to park them in
    mixed = any(getattr(param, "param_dtype", None) not in (None, param._sharded_param_data.dtype) for param in params)
    if park and not mixed:
        _install_restore_hooks(engine)
        parking = _ShardParking(params, rank=engine.rank, world_size=engine.world_size)
        _PARKED[engine] = parking
    total = sum(_nbytes(tensor) for tensor in weights.values())
    engine.last_handover_stats = HandoverStats(
        rank=engine.rank, world_size=engine.world_size, parameters=len(weights), bytes_total=total,
        bytes_local=shard_bytes, bytes_received=received,
        # as the executor's: live bytes at the high-water mark (the shards, FSDP's flat all-gather buffer and the
        # gathered parameters it copies out into) minus the larger footprint (the gathered parameters)
        peak_gathered_bytes=0 if gathered else shard_bytes + output_bytes,
        seconds=time.perf_counter() - started, path="reshard",
        bytes_sent=0 if gathered else int(shard_bytes * wire) * (engine.world_size - 1), lower_bound_bytes=lower_bound,
        aliased_bytes=total, parked_bytes=0 if parking is None else parking.parked_bytes, via="fsdp_all_gather",
    )
    for name in list(weights):
        yield name, weights.pop(name)


#: engine → its parked FSDP storages (absent: nothing parked)
_PARKED: weakref.WeakKeyDictionary[Any, StorageParking | _ShardParking] = weakref.WeakKeyDictionary()
_HOOKED: weakref.WeakSet[Any] = weakref.WeakSet()


def parked_bytes(engine: FSDPTrainingEngine) -> int:
    """FSDP storage bytes released now (parked in generation shards); 0 when every shard is home."""
    parking = _PARKED.get(engine)
    return 0 if parking is None else parking.parked_bytes


def restore_training_shards(engine: FSDPTrainingEngine) -> int:
    """Give every parked FSDP shard its storage back, copied from the generation shard it lay in (padding zeroed, as
    FSDP keeps it), one parameter at a time, dropping the references to each generation shard as it goes
    (:meth:`hybridflow.resharding.StorageParking.restore`); returns the bytes restored. A no-op when nothing is
    parked."""
    parking = _PARKED.pop(engine, None)
    return 0 if parking is None else parking.restore()


def _install_restore_hooks(engine: FSDPTrainingEngine) -> None:
    """Once per engine: a forward or state_dict call on the model (before FSDP's own all-gather) and a
    load_state_dict restore parked shards first, so a caller that skips ``end_generation()`` never reads freed
    storage."""
    if engine in _HOOKED:
        return
    _HOOKED.add(engine)
    ref = weakref.ref(engine)

    def restore(*_: Any, **__: Any) -> None:
        owner = ref()
        if owner is not None:
            restore_training_shards(owner)

    engine.model.register_forward_pre_hook(restore, prepend=True)
    engine.model.register_state_dict_pre_hook(restore)  # type: ignore[no-untyped-call]
    engine.model.register_load_state_dict_pre_hook(restore)  # type: ignore[no-untyped-call]
