"""The ``deepspeed`` training engine: an HF model wrapped by a DeepSpeed ZeRO (stage 1, 2 or 3) engine for one role
(actor, critic, reference, reward model).

It computes per-token log-probs/entropy/values/scores and runs optimizer steps with a loss the caller supplies; the
algorithm and how batches reach the ranks belong to the core. Models, forward helpers and the LR schedule are
hybridflow-fsdp's (the same HF modules, so the two engines agree number for number). Stability: public.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.engines import ROLES, LossFn, MeshInfo, TrainingEngineConfig, local_mini_batch_rows
from hybridflow.errors import ConfigError, EngineError
from hybridflow_deepspeed import checkpoint, handover
from hybridflow_deepspeed.runtime import build_deepspeed_config, init_deepspeed_distributed, parse_options
from hybridflow_fsdp import forward
from hybridflow_fsdp.distributed import check_equal_across_ranks, ensure_process_group
from hybridflow_fsdp.models import build_model
from hybridflow_fsdp.optim import build_optimizer, build_scheduler

__all__ = ["DeepSpeedTrainingEngine", "build_deepspeed_training_engine", "TRAINABLE_ROLES"]

TRAINABLE_ROLES = ("actor", "critic")
LOSS_SCALE_ROWS = "loss_scale_rows"
LOSS_SCALE_TOKENS = "loss_scale_tokens"


class DeepSpeedTrainingEngine:
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
            enable = cast("Callable[[], None] | None", getattr(model, "activation_checkpointing_enable", None))
            if enable is None:
                enable = cast("Callable[[], None]", model.gradient_checkpointing_enable)
            enable()
        if not self.trainable:
            model.requires_grad_(False)
        ds_config = build_deepspeed_config(config, self.options, world_size=self.world_size, trainable=self.trainable)
        optimizer = build_optimizer(model.parameters(), config.optim) if self.trainable else None
        scheduler_factory = (lambda basic: build_scheduler(basic, config.optim)) if self.trainable else None
        self.engine: Any
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler_factory, config=ds_config,
            dist_init_required=False,
        )
        self.module: torch.nn.Module = self.engine.module
        self._version = 0
        self.handover = handover.WeightHandover(self, bucket_bytes=self.options.handover_bucket_bytes)
        self.last_handover_stats: handover.HandoverStats | None = None
        self._captured_scores: list[torch.Tensor] = []
        if role == "reward_model":
            head = getattr(self.module, "score", None)
            if head is None:
                raise ConfigError(f"reward model {type(self.module).__name__} has no `score` head")
            head.register_forward_hook(lambda _module, _inputs, output: self._captured_scores.append(output))

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

    # --- inference ------------------------------------------------------------------------------------------
    def _micro_batches(self, batch: Batch) -> Iterator[Batch]:
        size = self.config.micro_batch_size
        for start in range(0, len(batch), size):
            yield batch.slice(start, min(start + size, len(batch)))

    def _forward_outputs(self, micro: Batch, *, with_entropy: bool,
                         entropy_metric: bool = False) -> dict[str, torch.Tensor]:
        """``log_probs`` (and ``entropy``: with gradients when ``with_entropy``, detached for the metric when only
        ``entropy_metric``) of the response tokens, or the critic's ``values``."""
        if self.role == "critic":
            length = forward.response_length(micro)
            logits = self.engine(**forward.model_inputs(micro, self.device), use_cache=False).logits
            return {"values": logits[:, -length - 1 : -1, 0].float()}
        logits = forward.response_logits(self.engine, micro, self.device)
        tokens = micro["responses"].to(self.device)
        if not (with_entropy or entropy_metric):
            return {"log_probs": forward.compute_token_log_probs(logits, tokens)}
        log_softmax = torch.log_softmax(logits.float(), dim=-1)
        outputs = {"log_probs": log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)}
        if with_entropy:
            outputs["entropy"] = -(log_softmax.exp() * log_softmax).sum(-1)
        else:
            with torch.no_grad():
                detached = log_softmax.detach()
                outputs["entropy"] = -(detached.exp() * detached).sum(-1)
        return outputs

    def _check_role(self, method: str, roles: tuple[str, ...]) -> None:
        if self.role not in roles:
            raise EngineError(f"{method} is for roles {list(roles)}; this engine is a {self.role}")

    def _infer(self, batch: Batch, *, with_entropy: bool, columns: tuple[str, ...]) -> Batch:
        self.engine.eval()
        parts: dict[str, list[torch.Tensor]] = {column: [] for column in columns}
        with torch.no_grad():
            for micro in self._micro_batches(batch):
                outputs = self._forward_outputs(micro, with_entropy=with_entropy)
                for column in columns:
                    parts[column].append(outputs[column].cpu())
        return Batch({c: torch.cat(p) for c, p in parts.items()}, meta=batch.meta, batch_size=len(batch))

    def compute_log_probs(self, batch: Batch, *, with_entropy: bool = False) -> Batch:
        """``log_probs`` [B, R] (and ``entropy``) of ``responses``; only the new columns, with ``batch.meta``."""
        self._check_role("compute_log_probs", ("actor", "reference"))
        forward.require_columns(batch, "input_ids", "attention_mask", "responses", method="compute_log_probs")
        columns = ("log_probs", "entropy") if with_entropy else ("log_probs",)
        return self._infer(batch, with_entropy=with_entropy, columns=columns)

    def compute_values(self, batch: Batch) -> Batch:
        """``values`` [B, R]: the value of the state before each response token; only the new column is returned."""
        self._check_role("compute_values", ("critic",))
        forward.require_columns(batch, "input_ids", "attention_mask", "responses", method="compute_values")
        return self._infer(batch, with_entropy=False, columns=("values",))

    @torch.no_grad()
    def compute_scores(self, batch: Batch) -> Batch:
        """``scores`` [B]: the reward head at the last non-pad token of each row; only the new column is returned."""
        self._check_role("compute_scores", ("reward_model",))
        forward.require_columns(batch, "input_ids", "attention_mask", method="compute_scores")
        self.engine.eval()
        scores = []
        for micro in self._micro_batches(batch):
            self._captured_scores.clear()
            inputs = forward.model_inputs(micro, self.device)
            self.engine(**inputs, use_cache=False)
            per_token = self._captured_scores[-1][..., 0].float()
            index = forward.last_token_index(inputs["attention_mask"])
            scores.append(per_token.gather(1, index.unsqueeze(1)).squeeze(1).cpu())
        self._captured_scores.clear()
        return Batch({"scores": torch.cat(scores)}, meta=batch.meta, batch_size=len(batch))

    # --- training -------------------------------------------------------------------------------------------
    def _count_global(self, mini: Batch) -> tuple[int, int]:
        """Rows and valid response tokens of the mini-batch on all ranks (``is_padding`` rows excluded)."""
        from hybridflow.algorithms.losses import compute_loss_scale

        scale = compute_loss_scale(mini) if "response_mask" in mini else {"loss_scale_rows": len(mini),
                                                                            "loss_scale_tokens": 0}
        counts = torch.tensor([scale["loss_scale_rows"], scale["loss_scale_tokens"]], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(counts)
        return int(counts[0]), int(counts[1])

    def train_step(self, batch: Batch, *, loss_fn: LossFn, mini_batch_size: int | None = None) -> dict[str, float]:
        """One optimizer step per mini-batch (all of ``batch`` when ``mini_batch_size`` is None); returns metrics.

        ``mini_batch_size`` counts rows over all data-parallel ranks; ``micro_batch_size`` (config) counts rows per
        forward on this rank. Every rank must hold the same number of rows.
        """
        self._check_role("train_step", TRAINABLE_ROLES)
        forward.require_columns(batch, "input_ids", "attention_mask", "responses", method="train_step")
        check_equal_across_ranks(len(batch), what="rows per train_step")
        local_mini = local_mini_batch_rows(len(batch), mini_batch_size, self.world_size)
        wants = getattr(loss_fn, "required_outputs", None)
        with_entropy = self.role == "actor" and (wants is None or "entropy" in wants)
        self.engine.train()
        totals: dict[str, float] = {}
        steps = 0
        for mini_start in range(0, len(batch), local_mini):
            mini = batch.slice(mini_start, mini_start + local_mini)
            global_rows, global_tokens = self._count_global(mini)
            micros = list(self._micro_batches(mini))
            for index, micro in enumerate(micros):
                micro = micro.with_meta(**{LOSS_SCALE_ROWS: global_rows / self.world_size,
                                           LOSS_SCALE_TOKENS: global_tokens / self.world_size})
                # gradients are reduced over ranks (and the step taken) only at the mini-batch's last micro-batch
                self.engine.set_gradient_accumulation_boundary(index == len(micros) - 1)
                outputs = self._forward_outputs(micro, with_entropy=with_entropy, entropy_metric=self.role == "actor")
                loss, metrics = loss_fn(outputs, micro)
                self.engine.backward(loss)  # gradient_accumulation_steps = 1: DeepSpeed leaves the loss unscaled
                weight = len(micro) / len(mini)
                totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + float(value) * weight
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + self._step()
            steps += 1
        metrics = {key: value / steps for key, value in totals.items()}
        metrics.update(lr=float(self.engine.get_lr()[0]), optimizer_steps=float(steps))
        return metrics

    def _step(self) -> float:
        """DeepSpeed's step (clip to ``optim.grad_clip``, AdamW, LR schedule); returns the pre-clip gradient norm."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        if self.engine.was_step_applied():
            self._version += 1
        return float(norm) if norm is not None else math.nan

    # --- state ----------------------------------------------------------------------------------------------
    def state_version(self) -> int:
        """Number of optimizer steps taken (restored by ``load_checkpoint``)."""
        return self._version

    def mesh_info(self) -> MeshInfo:
        return MeshInfo(dp_rank=self.rank, dp_size=self.world_size, is_collect=True)

    def save_checkpoint(self, path: str) -> None:
        """DeepSpeed's checkpoint (module, ZeRO optimizer partitions, scheduler) plus step and RNG state of every
        rank, written atomically under ``path``."""
        checkpoint.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Restore everything :meth:`save_checkpoint` wrote; the next step matches an uninterrupted run bit for bit."""
        checkpoint.load(self, path)

    def export_hf(self, path: str) -> None:
        """Write an HF model directory (config + safetensors; tokenizer copied when the source has one) from rank 0."""
        checkpoint.export_hf(self, path)

    def generation_weights(self, *, target: str = "hf") -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights for a tg = 1 generation engine (a collective under ZeRO-3: every rank must consume the whole
        iterator); bytes received are in ``last_handover_stats`` once it is exhausted."""
        self._check_role("generation_weights", ("actor", "reference"))
        return self.handover.full_weights(target=target)

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
            self.engine.destroy()
        self.engine = None
        if hasattr(self, "module"):
            del self.module


def build_deepspeed_training_engine(*, role: str, config: TrainingEngineConfig,
                                    device: str = "cpu") -> DeepSpeedTrainingEngine:
    """Factory registered as training engine ``"deepspeed"``."""
    return DeepSpeedTrainingEngine(role=role, config=config, device=device)
