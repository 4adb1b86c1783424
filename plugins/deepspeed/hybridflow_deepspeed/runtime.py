"""The ``deepspeed`` engine's options (``<role>.extra``), the DeepSpeed config built from them, and the one place
that imports DeepSpeed (lazily, with its JIT-built ops kept off).

Building the model and running steps are :mod:`hybridflow_deepspeed.training`'s business.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

from hybridflow.engines import TrainingEngineConfig
from hybridflow.errors import ConfigError, EngineError

__all__ = ["ZERO_STAGES", "EXTRA_KEYS", "DeepSpeedOptions", "parse_options", "build_deepspeed_config",
           "import_deepspeed", "init_deepspeed_distributed", "track_engine", "close_engine",
           "release_deepspeed_state", "forget_module"]

ZERO_STAGES = (1, 2, 3)
DEFAULT_ZERO_STAGE = 3
#: every ``<role>.extra`` key the engine reads; anything else is refused (a typo would silently change nothing)
EXTRA_KEYS = ("zero_stage", "offload_optimizer", "timeout_s", "handover_bucket_bytes", "attn_implementation",
              "param_persistence_threshold")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepSpeedOptions:
    """The validated ``<role>.extra`` of a ``deepspeed`` engine."""

    zero_stage: int = DEFAULT_ZERO_STAGE
    offload_optimizer: bool = False
    timeout_s: float = 120.0
    handover_bucket_bytes: int = 64 << 20
    attn_implementation: str = "sdpa"
    #: ZeRO-3 keeps parameters of fewer elements gathered on every rank (None: DeepSpeed's default, 1e5)
    param_persistence_threshold: int | None = None


def parse_options(role: str, config: TrainingEngineConfig) -> DeepSpeedOptions:
    """Validate ``config.extra`` and the generic keys the engine cannot honour; raises :class:`ConfigError`."""
    extra: Mapping[str, Any] = config.extra
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ConfigError(
            f"{role}.extra has keys the deepspeed engine does not know: {unknown}. Known: {list(EXTRA_KEYS)}. "
            f"Fix: remove them (options of another engine, e.g. fsdp's `handover`, do not apply here)."
        )
    stage = extra.get("zero_stage", DEFAULT_ZERO_STAGE)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in ZERO_STAGES:
        raise ConfigError(
            f"{role}.extra.zero_stage must be one of {list(ZERO_STAGES)} (ZeRO-1: optimizer state sharded, ZeRO-2: "
            f"+ gradients, ZeRO-3: + parameters); got {stage!r}. Fix: {role}.extra.zero_stage=3"
        )
    offload = extra.get("offload_optimizer", False)
    if not isinstance(offload, bool):
        raise ConfigError(f"{role}.extra.offload_optimizer must be true or false; got {offload!r}")
    timeout = extra.get("timeout_s", 120.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"{role}.extra.timeout_s must be a positive number of seconds; got {timeout!r}")
    bucket = extra.get("handover_bucket_bytes", 64 << 20)
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        raise ConfigError(f"{role}.extra.handover_bucket_bytes must be a positive byte count; got {bucket!r}")
    persistence = extra.get("param_persistence_threshold")
    if persistence is not None and (isinstance(persistence, bool) or not isinstance(persistence, int)
                                    or persistence < 0):
        raise ConfigError(f"{role}.extra.param_persistence_threshold must be an element count >= 0 (0: ZeRO-3 "
                          f"partitions every parameter); got {persistence!r}")
    if config.parallel.tensor_parallel_size != 1 or config.parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            f"the deepspeed engine shards over data-parallel ranks only (ZeRO); got {role}.parallel."
            f"tensor_parallel_size={config.parallel.tensor_parallel_size}, pipeline_parallel_size="
            f"{config.parallel.pipeline_parallel_size}. Use the megatron engine for tensor/pipeline parallelism."
        )
    if config.lora is not None:
        raise ConfigError(f"{role}.lora: the deepspeed engine does not train LoRA adapters; the fsdp engine does. Fix: "
                          f"set {role}.engine=fsdp, or remove {role}.lora to train every weight")
    if config.mixed_precision not in ("none", "bf16"):
        raise ConfigError(f'{role}.mixed_precision must be "none" or "bf16"; got {config.mixed_precision!r}')
    if config.model.dtype != "float32":
        raise ConfigError(
            f"the deepspeed engine keeps fp32 master weights and casts the model itself; got model.dtype="
            f"{config.model.dtype}. Fix: set model.dtype=float32 and {role}.mixed_precision=bf16 for bf16 compute."
        )
    return DeepSpeedOptions(zero_stage=stage, offload_optimizer=offload,
                            timeout_s=float(timeout), handover_bucket_bytes=bucket,
                            attn_implementation=str(extra.get("attn_implementation", "sdpa")),
                            param_persistence_threshold=persistence)


def build_deepspeed_config(config: TrainingEngineConfig, options: DeepSpeedOptions, *, world_size: int,
                           trainable: bool = True) -> dict[str, Any]:
    """The DeepSpeed config dict: ZeRO stage, bf16, clipping set explicitly, no DeepSpeed-built optimizer.

    Gradient accumulation is the engine's (1 here; it marks the boundary per mini-batch), and the optimizer is a torch
    AdamW the engine hands in: an optimizer named here would JIT-build FusedAdam/CPUAdam. A frozen role (reference,
    reward model) under ZeRO-1/2 runs at stage 0: those stages shard only optimizer state and gradients, which it has
    none of (DeepSpeed refuses stage 1/2 without an optimizer); under ZeRO-3 its parameters stay partitioned.
    """
    stage = options.zero_stage if trainable or options.zero_stage == 3 else 0
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        # DeepSpeed's default rebinds torch.nn.functional.linear to its ZeRO-3 wrapper for the whole process, for
        # good ("persists unless manually reset"): every other engine in that process (an fsdp reference beside
        # this actor) would then run DeepSpeed's linear, and torch function modes no longer see F.linear
        zero["memory_efficient_linear"] = False
    if stage == 3 and options.param_persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = options.param_persistence_threshold
    if options.offload_optimizer and trainable:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": config.micro_batch_size * world_size,
        # DeepSpeed clips at 1.0 when unset; 0 turns clipping off, as optim.grad_clip=0 does for the other engines
        "gradient_clipping": float(config.optim.grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": config.mixed_precision == "bf16"},
        "fp16": {"enabled": False},
        # a torch AdamW stepping offloaded fp32 partitions (DeepSpeedCPUAdam would be a C++ JIT build)
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 62,
        "wall_clock_breakdown": False,
    }


def import_deepspeed() -> ModuleType:
    """``import deepspeed`` with the shared-memory comm op marked unavailable (else ``init_distributed`` JIT-builds
    it); raises :class:`EngineError` with the install command when DeepSpeed is missing."""
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as exc:
        raise EngineError(
            f"the deepspeed engine needs DeepSpeed, which failed to import ({type(exc).__name__}: {exc}). "
            'Install: pip install "hybridflow-deepspeed[deepspeed]" torch==<your torch> (scripts/setup.sh --all does).'
        ) from exc
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return cast(ModuleType, deepspeed)


def init_deepspeed_distributed(device: str) -> ModuleType:
    """Wrap the already started torch.distributed group in DeepSpeed's comm layer; returns the module.

    DeepSpeed reads ``LOCAL_RANK``: set from the device index (0 on CPU) when the launcher did not set it.
    """
    import torch

    deepspeed = import_deepspeed()
    os.environ.setdefault("LOCAL_RANK", str(torch.device(device).index or 0))
    deepspeed.init_distributed(dist_backend="nccl" if device.startswith("cuda") else "gloo", dist_init_required=False,
                               verbose=False)
    return deepspeed


#: the DeepSpeed engines of this process not closed yet (weakly: one dropped without ``close()`` stops counting)
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def track_engine(engine: Any) -> None:
    """Count ``engine`` among this process's live DeepSpeed engines (:func:`close_engine` releases the state they
    share once the last one closes)."""
    _LIVE.add(engine)


def close_engine(engine: Any) -> bool:
    """``engine`` is closed: release DeepSpeed's process-wide state when no other live engine of this process uses
    it (:func:`release_deepspeed_state`); returns whether it was released."""
    _LIVE.discard(engine)
    if len(_LIVE):
        gc.collect()  # an engine dropped without close() may wait in a reference cycle (its handover holds it)
    if len(_LIVE):
        return False
    release_deepspeed_state()
    return True


def release_deepspeed_state() -> None:
    """Put DeepSpeed's module-level state back as a fresh import has it, so that the next engine in this process
    (after the worker host destroyed torch.distributed's world: hybridflow.controller.process_state) starts as in a
    fresh process. Call it on every rank, with no DeepSpeed engine left in use (:func:`close_engine` does).

    What ``deepspeed.initialize`` leaves behind, and what is put back here:

    - ``deepspeed.comm``'s backend object ``cdb`` (bound to the world it wrapped) and ``deepspeed.utils.groups``'
      references to the process groups it created in that world (its clone of the world group, the data/model/
      expert/sequence-parallel groups, the device mesh, the mpu): the next engine would run its collectives on
      groups of a destroyed world ("Group ... is not registered"). The groups themselves are torch's, destroyed with
      the world by whoever owns it (the worker); only DeepSpeed's references go, as
      ``deepspeed.comm.destroy_process_group`` releases them after a teardown.
    - ZeRO-3: ``parameter_offload.FWD_MODULE_STACK``, where every engine pushes its model for good (the model stays
      referenced, and the next engine's dangling-parameter search walks the stale modules), and the class-level
      counters of ``zero.Init`` (the next parameter id, the persisted parameters and elements, the persistence
      thresholds of the last engine).

    Every other module-level value the engines touch is a constant, a lazily filled registry that a fresh process
    fills the same way (the optimizers ZeRO supports) or per-engine state released by ``DeepSpeedEngine.destroy``
    (checked by the process reuse contract: tests/plugins/deepspeed/test_deepspeed_reuse.py)."""
    import sys

    comm: Any = sys.modules.get("deepspeed.comm.comm")  # untyped: its module-level names are Any here
    groups: Any = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        groups._release_process_group_references(None)
    if comm is not None:
        comm.cdb = None
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:
        offload.FWD_MODULE_STACK.clear()
    partition = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if partition is not None:
        from deepspeed.runtime.config_utils import get_config_default
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        init = partition.Init
        init.param_id = init.num_persisted_parameters = init.num_persisted_elements = 0
        init.apply_param_persistence = False
        for name in ("param_persistence_threshold", "model_persistence_threshold"):
            setattr(init, name, get_config_default(DeepSpeedZeroConfig, name))


def forget_module(module: Any) -> None:
    """Drop ``module`` from ZeRO-3's stack of forward modules (``DeepSpeedZeRoOffload`` pushes its model there for
    good), so a released engine's model is not kept alive by it."""
    import sys

    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None and module is not None:
        offload.FWD_MODULE_STACK[:] = [entry for entry in offload.FWD_MODULE_STACK if entry is not module]
