"""Join (or start) the torch.distributed process group, build the data-parallel DeviceMesh and apply FSDP2.

The controller sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; this module only reads them. Choosing what to
shard beyond "each decoder layer, then the root" is left to the engine configs of other plugins.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.errors import ConfigError, EngineError
from hybridflow_fsdp.models import transformer_blocks

__all__ = ["ensure_process_group", "build_data_parallel_mesh", "apply_fsdp", "FSDP_UNITS"]

DEFAULT_TIMEOUT_S = 120
#: what :func:`apply_fsdp` makes an FSDP unit: each decoder layer (then the root), or the whole model
FSDP_UNITS = ("layers", "model")


def ensure_process_group(device: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Use the existing process group, or start one from RANK/WORLD_SIZE/MASTER_* (a 1-rank group if unset)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
        if missing:
            raise ConfigError(
                f"RANK and WORLD_SIZE are set but {missing} are not; the controller (or torchrun) must set "
                "MASTER_ADDR and MASTER_PORT too, or unset RANK/WORLD_SIZE for a single-process engine"
            )
        dist.init_process_group(backend, init_method="env://", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    else:  # one rank: an in-process store, no TCP port to pick (and lose to another process before binding it)
        store = dist.HashStore()  # type: ignore[attr-defined]  # public in torch.distributed, not in its stubs
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)


def build_data_parallel_mesh(device: str, world_size: int) -> Any:
    """A 1-D mesh named ``dp`` over every rank (FSDP shards dim 0 of each parameter along it)."""
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if device.startswith("cuda") else "cpu"
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))


def apply_fsdp(model: nn.Module, *, mesh: Any, mixed_precision: str, reshard_after_forward: bool = True,
               shard_placement_fn: Callable[[nn.Parameter], Any] | None = None, units: str = "layers",
               reduce_dtype: str = "float32") -> nn.Module:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, head) — in place; with
    ``units="model"`` the root only: one FSDP unit, so one all-gather and one reduce-scatter per forward/backward
    (small models, and any forward that does not go through the decoder layers' ``forward``).

    ``shard_placement_fn`` (FSDP2's): a parameter's ``Shard(dim)``, None for the default dim 0. ``reduce_dtype``
    (``float32`` or ``bfloat16``): the gradients' reduce-scatter dtype under ``mixed_precision="bf16"``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mixed_precision == "bf16":
        if reduce_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f'reduce_dtype must be "float32" or "bfloat16", got {reduce_dtype!r}')
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce_dtype))
    elif mixed_precision == "none":
        policy = MixedPrecisionPolicy()
    else:
        raise ConfigError(f'mixed_precision must be "none" or "bf16", got {mixed_precision!r}')
    if units not in FSDP_UNITS:
        raise ConfigError(f"fsdp units must be one of {FSDP_UNITS}, got {units!r}")
    for block in transformer_blocks(model) if units == "layers" else ():
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=shard_placement_fn)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                shard_placement_fn=shard_placement_fn)
    return model


def raise_unequal_across_ranks(value: int, *, what: str, group: Any = None) -> NoReturn:
    """Raise on every rank, naming each rank's ``value``: called by every rank of ``group`` together once a cheaper
    collective has shown the values differ (``all_gather_object`` pickles: for the error path only)."""
    values: list[int] = [0] * dist.get_world_size(group)
    dist.all_gather_object(values, int(value), group=group)
    raise EngineError(
        f"{what} must be equal on every data-parallel rank; got {values} (by rank). Split the batch evenly "
        "across ranks (transfer protocol dp_compute, or dp_compute_padded for uneven batches)."
    )
