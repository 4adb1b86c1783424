"""The ``deepspeed`` training engine: an HF model wrapped by a DeepSpeed ZeRO (stage 1, 2 or 3) engine for one role
(actor, critic, reference, reward model).

It computes per-token log-probs/entropy/values/scores and runs optimizer steps with a loss the caller supplies; the
algorithm and how batches reach the ranks belong to the core. Models, forward helpers and the LR schedule are
hybridflow-fsdp's (the same HF modules, so the two engines agree number for number). Stability: public.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.engines import ROLES, TrainingEngineConfig
from hybridflow.errors import ConfigError
from hybridflow.resharding.layout import ParallelLayout
from hybridflow_deepspeed import checkpoint, handover, runtime
from hybridflow_deepspeed.runtime import build_deepspeed_config, init_deepspeed_distributed, parse_options
from hybridflow_fsdp.distributed import ensure_process_group
from hybridflow_fsdp.engine_base import LOSS_SCALE_ROWS as LOSS_SCALE_ROWS
from hybridflow_fsdp.engine_base import LOSS_SCALE_TOKENS as LOSS_SCALE_TOKENS
from hybridflow_fsdp.engine_base import TRAINABLE_ROLES, HFTrainingEngineBase, enable_gradient_checkpointing
from hybridflow_fsdp.models import build_model
from hybridflow_fsdp.optim import build_optimizer, build_scheduler

__all__ = ["DeepSpeedTrainingEngine", "build_deepspeed_training_engine", "TRAINABLE_ROLES"]


class DeepSpeedTrainingEngine(HFTrainingEngineBase):
    """One rank of a DeepSpeed ZeRO model (stability: public).

    Loss convention (the core's, see :mod:`hybridflow.algorithms.losses`): before each ``loss_fn`` call the engine
    puts the mini-batch totals in ``micro_batch.meta`` (``loss_scale_tokens``, ``loss_scale_rows``: all-reduced over
    data-parallel ranks, divided by their number) and back-propagates the returned loss unweighted. DeepSpeed runs
    with ``gradient_accumulation_steps=1`` and the engine marks the accumulation boundary itself (last micro-batch of
    each mini-batch), so DeepSpeed neither rescales the loss nor steps early; its gradient average over ranks then
    gives exactly the full-batch update.
    """

    def __init__(self, *, role: str, config: TrainingEngineConfig, device: str = "cpu") -> None:
        if role not in ROLES:
            raise ConfigError(f"unknown role {role!r}; the deepspeed engine serves {list(ROLES)}")
        self.role = role
        self.config = config
        self.options = parse_options(role, config)
        self.device = torch.device(device)
        ensure_process_group(device, timeout_s=self.options.timeout_s)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        config.parallel.resolve(self.world_size)
        deepspeed = init_deepspeed_distributed(device)
        model = build_model(config.model, role=role, attn_implementation=self.options.attn_implementation)
        self.trainable = role in TRAINABLE_ROLES
        if config.gradient_checkpointing and self.trainable:
            enable_gradient_checkpointing(model)
        if not self.trainable:
            model.requires_grad_(False)
        ds_config = build_deepspeed_config(config, self.options, world_size=self.world_size, trainable=self.trainable)
        optimizer = build_optimizer(model.parameters(), config.optim) if self.trainable else None
        scheduler_factory = (lambda basic: build_scheduler(basic, config.optim)) if self.trainable else None
        self.engine: Any
        try:
            self.engine, _, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler_factory, config=ds_config,
                dist_init_required=False,
            )
        except BaseException:
            runtime.close_engine(self)  # what initialize left half-built is not the next engine's (when no other)
            raise
        runtime.track_engine(self)
        self.module: torch.nn.Module = self.engine.module
        self._version = 0
        self.handover = handover.WeightHandover(self, bucket_bytes=self.options.handover_bucket_bytes)
        self.last_handover_stats: handover.HandoverStats | None = None
        self._captured_scores: list[torch.Tensor] = []
        if role == "reward_model":
            self._capture_scores(self.module)

    # --- parameters -----------------------------------------------------------------------------------------
    def named_parameter_shapes(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """``(name, full shape, dtype)`` of every parameter (tied ones once); ZeRO-3's partitioned ones included."""
        out = []
        for name, parameter in self.module.named_parameters():
            shape = tuple(getattr(parameter, "ds_shape", parameter.shape))
            out.append((name, shape, parameter.dtype))
        return out

    def parameter_dtype(self) -> torch.dtype:
        """The dtype the module holds its weights in (float32, or bfloat16 under mixed_precision=bf16)."""
        return next(self.module.parameters()).dtype

    # --- engine_base hooks ----------------------------------------------------------------------------------
    def _forward_module(self) -> Any:
        self.handover.restore()  # parked ZeRO-3 partitions (generation_weights(park=True)) come home first
        return self.engine

    def _before_micro(self, index: int, count: int) -> None:
        # gradients are reduced over ranks (and the step taken) only at the mini-batch's last micro-batch
        self.engine.set_gradient_accumulation_boundary(index == count - 1)

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)  # gradient_accumulation_steps = 1: DeepSpeed leaves the loss unscaled

    def _optimizer_step(self) -> float:
        """DeepSpeed's step (clip to ``optim.grad_clip``, AdamW, LR schedule); returns the pre-clip gradient norm."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        if self.engine.was_step_applied():
            self._version += 1
        return float(norm) if norm is not None else math.nan

    def _current_lr(self) -> float:
        return float(self.engine.get_lr()[0])

    # --- state ----------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """DeepSpeed's checkpoint (module, ZeRO optimizer partitions, scheduler) plus step and RNG state of every
        rank, written atomically under ``path``."""
        self.handover.restore()
        checkpoint.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Restore everything :meth:`save_checkpoint` wrote; the next step matches an uninterrupted run bit for bit."""
        self.handover.restore()
        checkpoint.load(self, path)

    def export_hf(self, path: str) -> None:
        """Write an HF model directory (config + safetensors; tokenizer copied when the source has one) from rank 0."""
        self.handover.restore()
        checkpoint.export_hf(self, path)

    def parallel_layout(self) -> ParallelLayout:
        """The training mesh the reshard planner sees: ``d`` data ranks, one shard group (ZeRO-3 partitions every
        parameter over them; under ZeRO-1/2 each rank holds them whole and slices what a generation layout asks)."""
        return ParallelLayout(data=self.world_size, data_sharded=True)

    def generation_weights(self, *, target: str = "hf", tensor_parallel_size: int = 1,
                           park: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's weights of generation layout (pg = 1, tg = ``tensor_parallel_size``) drawn inside
        :meth:`parallel_layout` (stride grouping), Hugging Face-named: full tensors at tg = 1, tensor-parallel shards
        above (column/vocab dim 0, row dim 1, norms whole), moved by the reshard planner. A collective under ZeRO-3
        (and at tg > 1): every rank must consume the whole iterator; bytes received are in ``last_handover_stats``
        once it is exhausted. ``park`` (the actor worker's default; ZeRO-3): the partitions' storage and the persistent
        parameters' full data are released, the generation shards holding every byte of them on this rank or its
        tensor-parallel peers, until :meth:`end_generation` or the next forward bring them back bit for bit (a
        collective at tg > 1)."""
        self._check_role("generation_weights", ("actor", "reference"))
        if tensor_parallel_size < 1 or self.world_size % tensor_parallel_size:
            raise ConfigError(f"generation tensor_parallel_size {tensor_parallel_size} must divide the deepspeed "
                              f"engine's {self.world_size} ranks; pick one of the divisors of {self.world_size}")
        if tensor_parallel_size == 1:
            return self.handover.full_weights(target=target, park=park)
        return self.handover.shard_weights(target=target, tensor=tensor_parallel_size, park=park)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors holding this rank's weights (capability ``holds_weights``; none once released)."""
        return list(self.module.parameters()) if hasattr(self, "module") else []

    def end_generation(self) -> None:
        """Give the ZeRO-3 partitions and persistent parameters parked by ``generation_weights(park=True)`` their
        storage back (bit for bit, from the generation shards; a collective on every rank); a no-op when none is
        parked."""
        self.handover.restore()

    def reshard_weights(self, target: Any) -> dict[str, torch.Tensor]:
        """This rank's shards of a generation layout ``target`` (a :class:`hybridflow.resharding.ModelLayout` over
        ``GenerationLayout(..., training=<this engine's mesh>)``, e.g. ``handover.generation_layout(tensor=2)``),
        moved by the reshard planner; a collective over all ranks."""
        self._check_role("reshard_weights", ("actor", "reference"))
        return self.handover.reshard(target, name="layout")

    def full_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter in full on every rank, for any role (export); a collective under ZeRO-3."""
        return self.handover.full_weights(target="hf")

    def release(self) -> None:
        """Destroy the DeepSpeed engine (its ZeRO hooks and optimizer) and drop the model; the process group stays,
        it belongs to the worker. A released engine fails on its next call."""
        if getattr(self, "engine", None) is not None:
            runtime.forget_module(getattr(self.engine, "module", None))
            self.engine.destroy()
        self.engine = None
        if hasattr(self, "module"):
            del self.module

    def close(self) -> None:
        """:meth:`release`, then, once no other DeepSpeed engine of this process is open, DeepSpeed's process-wide
        state (its comm backend and its references to the process groups of this torch.distributed world:
        :func:`hybridflow_deepspeed.runtime.release_deepspeed_state`), so that the worker host may restore this
        process for another run's engines (``reusable_process``). No collective; the process group stays, it
        belongs to the worker. Idempotent."""
        self.release()
        self._captured_scores = []
        runtime.close_engine(self)


def build_deepspeed_training_engine(*, role: str, config: TrainingEngineConfig,
                                    device: str = "cpu") -> DeepSpeedTrainingEngine:
    """Factory registered as training engine ``"deepspeed"``."""
    return DeepSpeedTrainingEngine(role=role, config=config, device=device)
