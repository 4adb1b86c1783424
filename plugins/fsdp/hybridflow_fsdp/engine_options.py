"""What the ``fsdp`` engine's ``auto`` options resolve to (``extra.fsdp_units``, ``extra.handover_unshard``,
``extra.reduce_dtype``): pure functions of the setting, the model's size and precision and the device, so the
choice is testable without building an engine. Stability: public (the engine's resolved options are in the run
manifest's ``engine_options``)."""

from __future__ import annotations

import torch

from hybridflow.errors import ConfigError
from hybridflow_fsdp.distributed import FSDP_UNITS

__all__ = ["ONE_UNIT_MAX_BYTES", "REDUCE_DTYPES", "UNSHARD_HANDOVER_FP32_MAX_BYTES", "resolve_fsdp_units",
           "resolve_reduce_dtype", "resolve_unshard_handover"]

#: ``extra.reduce_dtype`` values besides ``auto`` (:func:`resolve_reduce_dtype`)
REDUCE_DTYPES = ("float32", "bfloat16")
#: ``extra.fsdp_units: auto`` makes the whole model one FSDP unit up to this many bytes of weights
ONE_UNIT_MAX_BYTES = 1 << 30
#: ``extra.handover_unshard: auto`` hands over through FSDP's all-gather in fp32 up to this many bytes of weights
UNSHARD_HANDOVER_FP32_MAX_BYTES = 64 << 20


def resolve_fsdp_units(setting: object, weight_bytes: int, *, lean: bool) -> str:
    """``extra.fsdp_units``: ``layers`` (a unit per decoder layer, then the root: the HF forward, one layer's weights
    gathered at a time), ``model`` (one unit: the lean forward where it applies, one all-gather and one reduce-scatter
    a step, all weights gathered from forward to backward) or ``auto``: ``model`` when the lean forward applies and
    the model's weights (``weight_bytes``, unsharded) take at most :data:`ONE_UNIT_MAX_BYTES`, else ``layers``."""
    if setting == "auto":
        return "model" if lean and weight_bytes <= ONE_UNIT_MAX_BYTES else "layers"
    if setting not in FSDP_UNITS:
        raise ConfigError(f"actor.extra.fsdp_units must be one of {['auto', *FSDP_UNITS]}, got {setting!r}")
    return str(setting)


def resolve_unshard_handover(setting: object, *, mixed_precision: str, weight_bytes: int) -> bool:
    """``extra.handover_unshard``: whether a one-unit actor's tg = 1 handover is FSDP's own all-gather (True) or the
    planner's executor (False). ``auto``: True under ``mixed_precision=bf16`` (the gathered bf16 weights are the
    generation weights) and in fp32 up to :data:`UNSHARD_HANDOVER_FP32_MAX_BYTES` of weights. In fp32 its transient
    is FSDP's — shards, flat all-gather buffer and gathered parameters, 2.5 M per rank at two ranks against M plus
    one bucket for the executor (docs/guide/fsdp.md) — which matters for large models only; small ones save the update's
    second all-gather and the executor's per-tensor work: at 77K parameters on two ranks the GRPO step ran
    1.19-1.36x faster with it (bench/e2e_grpo.py --workers 2, alternated pairs, 2026-12-03)."""
    if setting == "auto":
        return mixed_precision == "bf16" or weight_bytes <= UNSHARD_HANDOVER_FP32_MAX_BYTES
    if isinstance(setting, bool):
        return setting
    raise ConfigError(f"actor.extra.handover_unshard must be true, false or auto, got {setting!r}. Fix: set one of "
                      "them (auto: FSDP's all-gather hands over under bf16 and for fp32 models up to "
                      f"{UNSHARD_HANDOVER_FP32_MAX_BYTES >> 20} MiB of weights)")


def resolve_reduce_dtype(setting: object, *, role: str, mixed_precision: str, device: torch.device) -> str:
    """``extra.reduce_dtype`` (verl's ``mixed_precision.reduce_dtype``): the dtype gradients are reduce-scattered in
    under ``mixed_precision=bf16`` (fp32 compute reduces in fp32). ``auto``: ``bfloat16`` on CPU, ``float32`` on GPUs.

    On CPU the reduction is gloo over host memory and costs as much as the backward it follows: at 18.9M parameters
    on two ranks a bf16 reduce-scatter made the whole GRPO step 1.26-1.32x faster than an fp32 one in one alternating
    pair of runs (no fp32 copy of the bf16 gradients, half the bytes; docs/guide/fsdp.md has a noisier pair too). Its
    cost in precision is one bf16 rounding of each summed gradient element per reduction step (at two ranks: of a + b),
    on gradients already computed in bf16; the fp32 master weights and AdamW state are unchanged. GPUs keep verl's fp32
    reduction.
    """
    if setting == "auto":
        return "bfloat16" if mixed_precision == "bf16" and device.type == "cpu" else "float32"
    if setting not in REDUCE_DTYPES:
        raise ConfigError(f"{role}.extra.reduce_dtype must be one of {['auto', *REDUCE_DTYPES]}, got {setting!r}")
    return str(setting)
