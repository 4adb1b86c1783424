"""The ``fsdp`` training engine: an HF model sharded with FSDP2 for one role (actor, critic, reference, reward model).

It computes per-token log-probs/entropy/values/scores and runs optimizer steps with a loss the caller supplies; the
algorithm (PPO, GRPO, ...) and how batches reach the ranks belong to the core. Stability: public.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.engines import ROLES, LossFn, MeshInfo, TrainingEngineConfig, local_mini_batch_rows
from hybridflow.errors import ConfigError, EngineError
from hybridflow.resharding.layout import ParallelLayout
from hybridflow_fsdp import checkpoint, forward, handover
from hybridflow_fsdp.distributed import (
    apply_fsdp,
    build_data_parallel_mesh,
    check_equal_across_ranks,
    ensure_process_group,
)
from hybridflow_fsdp.fast_decode import build_lean_decoder
from hybridflow_fsdp.models import build_model
from hybridflow_fsdp.optim import build_optimizer, build_scheduler

if TYPE_CHECKING:

    from hybridflow.resharding import ReshardPlan

__all__ = ["FSDPTrainingEngine", "build_fsdp_training_engine", "TRAINABLE_ROLES"]

TRAINABLE_ROLES = ("actor", "critic")
#: meta keys the engine sets on every micro-batch it passes to ``loss_fn`` (the core's convention)
LOSS_SCALE_ROWS = "loss_scale_rows"
LOSS_SCALE_TOKENS = "loss_scale_tokens"


class FSDPTrainingEngine:
    """One rank of an FSDP2-sharded model (stability: public).

    Loss convention (the core's, see :mod:`hybridflow.algorithms.losses`): before each ``loss_fn`` call the engine
    puts the mini-batch totals in ``micro_batch.meta`` — ``loss_scale_tokens`` (valid response tokens) and
    ``loss_scale_rows`` (rows), each all-reduced over data-parallel ranks and divided by their number — and calls
    ``backward()`` on the returned loss as is. A loss normalised by those totals sums over micro-batches to the
    mini-batch loss, and FSDP's gradient average over ranks then gives exactly the full-batch update.
    """

    def __init__(self, *, role: str, config: TrainingEngineConfig, device: str = "cpu") -> None:
        if role not in ROLES:
            raise ConfigError(f"unknown role {role!r}; the fsdp engine serves {list(ROLES)}")
        self.role = role
        self.config = config
        self.device = torch.device(device)
        ensure_process_group(device, timeout_s=float(config.extra.get("timeout_s", 120)))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        config.parallel.resolve(self.world_size)
        if config.parallel.tensor_parallel_size != 1 or config.parallel.pipeline_parallel_size != 1:
            raise ConfigError(
                f"the fsdp engine shards over data-parallel ranks only; got tensor_parallel_size="
                f"{config.parallel.tensor_parallel_size}, "
                f"pipeline_parallel_size={config.parallel.pipeline_parallel_size}."
                " Use the megatron engine for tensor/pipeline parallelism."
            )
        self.mesh = build_data_parallel_mesh(device, self.world_size)
        attn_implementation = str(config.extra.get("attn_implementation", "sdpa"))
        model = build_model(config.model, role=role, attn_implementation=attn_implementation)
        if config.gradient_checkpointing and role in TRAINABLE_ROLES:
            # decoder layers recompute their forward in backward (transformers >= 5 names it activation checkpointing)
            enable = cast("Callable[[], None] | None", getattr(model, "activation_checkpointing_enable", None))
            if enable is None:
                enable = cast("Callable[[], None]", model.gradient_checkpointing_enable)
            enable()
        self.trainable = role in TRAINABLE_ROLES
        if not self.trainable:
            model.requires_grad_(False)
        model.to(self.device)
        # one rank in full precision: nothing to shard, so the plain module runs without FSDP's per-op DTensor cost
        self.sharded = self.world_size > 1 or config.mixed_precision != "none" or bool(config.extra.get("fsdp_always"))
        # generating at tg > 1: shard row-parallel weights along dim 1, as the generation layout splits them, so each
        # FSDP shard lies inside (at d == tg: is) its tensor-parallel shard and the handover hands it over as a view
        self.generation_tensor_parallel_size = int(config.extra.get("generation_tensor_parallel_size", 1))
        placement = (_row_dim_one_placement(model) if self.generation_tensor_parallel_size > 1 and role == "actor"
                     else None)
        self.model = (apply_fsdp(model, mesh=self.mesh, mixed_precision=config.mixed_precision,
                                 shard_placement_fn=placement) if self.sharded else model)
        self._handover_plans: dict[int, ReshardPlan] = {}  # by tg, built by handover.handover_plan on first use
        # the lean forward of fast_decode (same logits and gradients, less per-op overhead) on unsharded models
        self.lean = None
        checkpointing = self.trainable and config.gradient_checkpointing  # the lean forward would bypass it
        if (not self.sharded and role in ("actor", "reference") and not checkpointing
                and config.extra.get("lean_forward", True)):
            self.lean = build_lean_decoder(self.model)
        self.optimizer = (build_optimizer(self.model.parameters(), config.optim, fused=not self.sharded)
                          if self.trainable else None)
        self.scheduler = build_scheduler(self.optimizer, config.optim) if self.optimizer is not None else None
        self._version = 0
        self.last_handover_stats: handover.HandoverStats | None = None
        self._captured_scores: list[torch.Tensor] = []
        if role == "reward_model":
            head = getattr(self.model, "score", None)
            if head is None:
                raise ConfigError(f"reward model {type(self.model).__name__} has no `score` head")
            head.register_forward_hook(lambda _module, _inputs, output: self._captured_scores.append(output))

    # --- inference ------------------------------------------------------------------------------------------
    def _micro_batches(self, batch: Batch) -> Iterator[Batch]:
        size = self.config.micro_batch_size
        for start in range(0, len(batch), size):
            yield batch.slice(start, min(start + size, len(batch)))

    def _forward_outputs(self, micro: Batch, *, with_entropy: bool,
                         entropy_metric: bool = False) -> dict[str, torch.Tensor]:
        """``log_probs`` (and ``entropy``) of the response tokens, or the critic's ``values``.

        ``with_entropy`` computes the entropy with gradients (an entropy bonus); ``entropy_metric`` computes it
        detached from the same log-softmax, for the ``actor/entropy`` metric: no extra forward, no backward cost.
        """
        if self.role == "critic":
            length = forward.response_length(micro)
            logits = self.model(**forward.model_inputs(micro, self.device), use_cache=False).logits
            return {"values": logits[:, -length - 1 : -1, 0].float()}
        if self.lean is not None:
            inputs = forward.model_inputs(micro, self.device)
            length = forward.response_length(micro)
            logits = self.lean.response_logits(inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"],
                                               length)
        else:
            logits = forward.response_logits(self.model, micro, self.device)
        if not (with_entropy or entropy_metric):
            return {"log_probs": forward.compute_token_log_probs(logits, micro["responses"].to(self.device))}
        # one log-softmax for both (forward.compute_token_log_probs and forward.compute_entropy would make two)
        log_softmax = torch.log_softmax(logits.float(), dim=-1)
        tokens = micro["responses"].to(self.device)
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
        self.model.eval()
        parts: dict[str, list[torch.Tensor]] = {column: [] for column in columns}
        # unsharded: inference mode (less per-op bookkeeping); FSDP's hooks keep the plain no-grad mode
        with torch.inference_mode() if not self.sharded else torch.no_grad():
            for micro in self._micro_batches(batch):
                outputs = self._forward_outputs(micro, with_entropy=with_entropy)
                for column in columns:
                    parts[column].append(outputs[column].cpu())
            merged = {c: torch.cat(p) for c, p in parts.items()}
        # ordinary tensors out (inference tensors cannot be saved for a later backward)
        return Batch({c: t.clone() for c, t in merged.items()}, meta=batch.meta, batch_size=len(batch))

    def compute_log_probs(self, batch: Batch, *, with_entropy: bool = False) -> Batch:
        """``log_probs`` [B, R] (and ``entropy``) of ``responses``.

        Returns only the new columns, with ``batch.meta``.
        """
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
        self.model.eval()
        scores = []
        for micro in self._micro_batches(batch):
            self._captured_scores.clear()
            inputs = forward.model_inputs(micro, self.device)
            self.model(**inputs, use_cache=False)
            per_token = self._captured_scores[-1][..., 0].float()
            index = forward.last_token_index(inputs["attention_mask"])
            scores.append(per_token.gather(1, index.unsqueeze(1)).squeeze(1).cpu())
        self._captured_scores.clear()
        return Batch({"scores": torch.cat(scores)}, meta=batch.meta, batch_size=len(batch))

    # --- training -------------------------------------------------------------------------------------------
    def _local_mini_batch_rows(self, rows: int, mini_batch_size: int | None) -> int:
        return local_mini_batch_rows(rows, mini_batch_size, self.world_size)

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
        assert self.optimizer is not None and self.scheduler is not None
        forward.require_columns(batch, "input_ids", "attention_mask", "responses", method="train_step")
        check_equal_across_ranks(len(batch), what="rows per train_step")
        local_mini = self._local_mini_batch_rows(len(batch), mini_batch_size)
        wants = getattr(loss_fn, "required_outputs", None)
        # entropy with gradients only when the loss asks for it; an actor's loss always gets it (detached otherwise)
        with_entropy = self.role == "actor" and (wants is None or "entropy" in wants)
        self.model.train()
        totals: dict[str, float] = {}
        steps = 0
        for mini_start in range(0, len(batch), local_mini):
            mini = batch.slice(mini_start, mini_start + local_mini)
            global_rows, global_tokens = self._count_global(mini)
            for micro in self._micro_batches(mini):
                micro = micro.with_meta(**{LOSS_SCALE_ROWS: global_rows / self.world_size,
                                           LOSS_SCALE_TOKENS: global_tokens / self.world_size})
                outputs = self._forward_outputs(micro, with_entropy=with_entropy, entropy_metric=self.role == "actor")
                loss, metrics = loss_fn(outputs, micro)
                torch.autograd.backward(loss)  # = loss.backward(), which torch leaves unannotated
                weight = len(micro) / len(mini)  # metrics are micro-batch means; the loss is already a share
                totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + float(value) * weight
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + self._clip_and_step()
            steps += 1
        metrics = {key: value / steps for key, value in totals.items()}
        metrics.update(lr=float(self.scheduler.get_last_lr()[0]), optimizer_steps=float(steps))
        return metrics

    def _clip_and_step(self) -> float:
        assert self.optimizer is not None and self.scheduler is not None
        max_norm = self.config.optim.grad_clip if self.config.optim.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=not self.sharded or None)
        norm_value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(norm_value):
            self.optimizer.step()
            self._version += 1
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm_value

    # --- state ----------------------------------------------------------------------------------------------
    def state_version(self) -> int:
        """Number of optimizer steps taken (restored by ``load_checkpoint``)."""
        return self._version

    def mesh_info(self) -> MeshInfo:
        return MeshInfo(dp_rank=self.rank, dp_size=self.world_size, is_collect=True)

    def parallel_layout(self) -> ParallelLayout:
        """The training mesh the reshard planner sees: ``d`` data-sharded ranks (FSDP)."""
        return ParallelLayout(data=self.world_size, data_sharded=True)

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, scheduler, step and RNG state of every rank, written atomically under ``path``."""
        checkpoint.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Restore everything :meth:`save_checkpoint` wrote; the next step matches an uninterrupted run bit for bit."""
        checkpoint.load(self, path)

    def export_hf(self, path: str) -> None:
        """Write an HF model directory (config + safetensors; tokenizer copied when the source has one) from rank 0."""
        checkpoint.export_hf(self, path)

    def generation_weights(self, *, target: str = "hf",
                           tensor_parallel_size: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's weights of generation layout (pg = 1, tg = ``tensor_parallel_size``), HF-named: full tensors
        at tg = 1, tensor-parallel shards (column/vocab dim 0, row dim 1, norms whole) above. A collective: every
        rank must consume the whole iterator. Default path ``reshard`` (the planner; shards that coincide with the
        FSDP shard are views of it); ``extra.handover=stream`` gathers full tensors one by one (tg = 1 only). Bytes
        are in ``last_handover_stats`` once it is exhausted."""
        self._check_role("generation_weights", ("actor", "reference"))
        path = self.config.extra.get("handover", handover.DEFAULT_PATH)
        if path not in handover.PATHS:
            raise ConfigError(f"actor.extra.handover must be one of {handover.PATHS}, got {path!r}")
        if self.world_size % tensor_parallel_size:
            raise ConfigError(f"generation tensor_parallel_size {tensor_parallel_size} must divide the fsdp engine's "
                              f"{self.world_size} ranks; pick one of the divisors of {self.world_size}")
        if path == "stream":
            if tensor_parallel_size != 1:
                raise ConfigError(f"actor.extra.handover=stream gathers full weights (tg = 1) but generation asks "
                                  f"for tg = {tensor_parallel_size}; remove actor.extra.handover (default reshard)")
            return handover.stream_generation_weights(self, target=target)
        return handover.reshard_generation_weights(self, target=target, tensor=tensor_parallel_size)

    def release(self) -> None:
        """Drop the model and optimizer (the process group stays, it belongs to the worker)."""
        if hasattr(self, "model"):
            del self.model  # a released engine holds no model; a later call fails on the missing attribute
        self.lean = None
        self.optimizer = None
        self.scheduler = None


def _row_dim_one_placement(model: torch.nn.Module) -> Callable[[torch.nn.Parameter], Any]:
    """FSDP2 ``shard_placement_fn``: ``Shard(1)`` for row-parallel weights (o_proj, down_proj), default elsewhere."""
    from torch.distributed.tensor import Shard

    from hybridflow_fsdp.layouts import row_parallel_names

    names = dict(model.named_parameters())
    rows = {id(names[name]) for name in row_parallel_names(list(names))}

    def placement(parameter: torch.nn.Parameter) -> Any:
        return Shard(1) if id(parameter) in rows else None

    return placement


def build_fsdp_training_engine(*, role: str, config: TrainingEngineConfig, device: str = "cpu") -> FSDPTrainingEngine:
    """Factory registered as training engine ``"fsdp"``."""
    return FSDPTrainingEngine(role=role, config=config, device=device)
