"""The ``fsdp`` training engine: an HF model sharded with FSDP2 for one role (actor, critic, reference, reward model).

It computes per-token log-probs/entropy/values/scores and runs optimizer steps with a loss the caller supplies; the
algorithm (PPO, GRPO, ...) and how batches reach the ranks belong to the core. Stability: public.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.engines import ROLES, LossFn, TrainingEngineConfig
from hybridflow.errors import ConfigError, EngineError
from hybridflow.resharding.layout import ParallelLayout
from hybridflow_fsdp import checkpoint, forward, handover, packing
from hybridflow_fsdp.distributed import apply_fsdp, build_data_parallel_mesh, ensure_process_group
from hybridflow_fsdp.engine_base import LOSS_SCALE_ROWS as LOSS_SCALE_ROWS
from hybridflow_fsdp.engine_base import LOSS_SCALE_TOKENS as LOSS_SCALE_TOKENS
from hybridflow_fsdp.engine_base import TRAINABLE_ROLES, HFTrainingEngineBase, enable_gradient_checkpointing
from hybridflow_fsdp.engine_options import (
    ONE_UNIT_MAX_BYTES,
    REDUCE_DTYPES,
    UNSHARD_HANDOVER_FP32_MAX_BYTES,
    resolve_fsdp_units,
    resolve_reduce_dtype,
    resolve_unshard_handover,
)
from hybridflow_fsdp.fast_decode import build_lean_decoder, lean_decoder_unsupported_reason
from hybridflow_fsdp.lora import adapter_parameters, apply_lora, lora_scales
from hybridflow_fsdp.models import build_model
from hybridflow_fsdp.moe import (
    ROUTED_EXPERTS,
    RouterTap,
    RoutingPass,
    compute_load_balancing_loss,
    compute_routing_metrics,
    compute_z_loss,
    find_moe_blocks,
)
from hybridflow_fsdp.optim import build_optimizer, build_scheduler, clip_sharded_grad_norm_, count_state_bytes
from hybridflow_fsdp.prompt_sharing import shares_prompts
from hybridflow_fsdp.shm_comm import install_shm_comm

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from hybridflow.resharding import ReshardPlan

__all__ = ["FSDPTrainingEngine", "build_fsdp_training_engine", "resolve_fsdp_units", "resolve_reduce_dtype",
           "TRAINABLE_ROLES", "ONE_UNIT_MAX_BYTES", "REDUCE_DTYPES", "resolve_unshard_handover",
           "UNSHARD_HANDOVER_FP32_MAX_BYTES"]

#: the method name the lean forward gets on the FSDP root, so FSDP's forward hooks run around it
LEAN_FORWARD_METHOD = "hybridflow_lean_response_logits"
#: ``extra.lora_sync``: how a LoRA actor's weights reach a rollout engine that applies adapters itself
LORA_SYNC_MODES = ("adapters", "merged")


class FSDPTrainingEngine(HFTrainingEngineBase):
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
        # padding removal: the rows of a micro-batch packed into one sequence, attention per row (packing.py)
        self.packed = config.use_remove_padding and role in ("actor", "critic", "reference")
        if self.packed:
            if attn_implementation != "sdpa":
                raise ConfigError(
                    f"{role}.use_remove_padding=true packs rows for SDPA attention, but {role}.extra."
                    f"attn_implementation is {attn_implementation!r}. Fix: remove {role}.extra.attn_implementation, "
                    f"or set {role}.use_remove_padding=false to run {attn_implementation!r} on padded rows.")
            packing.register_varlen_attention()
            attn_implementation = packing.VARLEN_ATTENTION
        model = build_model(config.model, role=role, attn_implementation=attn_implementation)
        if config.lora is not None:  # freeze the base, wrap the targeted layers (before sharding: FSDP2 shards both)
            if role != "actor":
                raise ConfigError(f"lora trains the actor's adapters; this engine is a {role}. Fix: remove {role}.lora")
            apply_lora(model, config.lora, seed=config.model.seed)
        reason = packing.packing_unsupported_reason(model) if self.packed else None
        if reason is not None:
            raise ConfigError(f"{role}.use_remove_padding=true cannot pack this model: {reason}. "
                              f"Fix: set {role}.use_remove_padding=false.")
        # MoE (moe.py): the actor's routers are tapped for routing replay, the router losses and their metrics
        self.router_tap = _build_router_tap(model, role=role, config=config)
        if config.gradient_checkpointing and role in TRAINABLE_ROLES:
            enable_gradient_checkpointing(model)
        self.trainable = role in TRAINABLE_ROLES
        if not self.trainable:
            model.requires_grad_(False)
        model.to(self.device)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # before sharding: the whole
        # one rank in full precision: nothing to shard, so the plain module runs without FSDP's per-op DTensor cost
        self.sharded = self.world_size > 1 or config.mixed_precision != "none" or bool(config.extra.get("fsdp_always"))
        # generating at tg > 1: shard row-parallel weights along dim 1, as the generation layout splits them, so each
        # FSDP shard lies inside (at d == tg: is) its tensor-parallel shard and the handover hands it over as a view
        self.generation_tensor_parallel_size = int(config.generation_tensor_parallel_size)
        placement = (_row_dim_one_placement(model) if self.generation_tensor_parallel_size > 1 and role == "actor"
                     else None)
        # the lean forward of fast_decode (same logits and gradients, less per-op overhead) for the actor and the
        # reference, with padding removal or without (use_remove_padding; other roles and models pack through the
        # HF modules, packing.py); sharded, it needs the whole model as one FSDP unit (it bypasses the layers'
        # forward, where per-layer units would all-gather). It reads the base weights: not with LoRA adapters.
        checkpointing = self.trainable and config.gradient_checkpointing  # the lean forward would bypass it
        lean_possible = (role in ("actor", "reference") and not checkpointing
                         and config.lora is None and bool(config.extra.get("lean_forward", True))
                         and lean_decoder_unsupported_reason(model) is None
                         and not find_moe_blocks(model))  # MoE: HF's modules, whose routers moe.py taps
        self.fsdp_units = resolve_fsdp_units(config.extra.get("fsdp_units", "auto"), weight_bytes, lean=lean_possible)
        # one unit of a trainable model stays gathered from its forward through its backward (one all-gather a step)
        self._one_unit = self.sharded and self.fsdp_units == "model"
        self.reduce_dtype = resolve_reduce_dtype(config.extra.get("reduce_dtype", "auto"), role=role,
                                                 mixed_precision=config.mixed_precision, device=self.device)
        self.model = (apply_fsdp(model, mesh=self.mesh, mixed_precision=config.mixed_precision,
                                 reduce_dtype=self.reduce_dtype, shard_placement_fn=placement, units=self.fsdp_units,
                                 reshard_after_forward=not (self._one_unit and self.trainable))
                      if self.sharded else model)
        # one unit on ranks of one host: FSDP's all-gather and reduce-scatter through shared memory (shm_comm.py)
        self.comm = str(config.extra.get("comm", "auto"))
        self.shm_comm_unused_reason = install_shm_comm(self.model, setting=self.comm, device=self.device, role=role)
        self._handover_plans: dict[int, ReshardPlan] = {}  # by tg, built by handover.handover_plan on first use
        # the tg = 1 handover of a one-unit trainable actor (no LoRA) is FSDP's own all-gather, whose gathered
        # weights generation binds and the update's forward then uses: one all-gather a step instead of two
        # (resolve_unshard_handover: the default under bf16 and for small fp32 models)
        self.unshard_handover = (self._one_unit and self.trainable and role == "actor" and config.lora is None
                                 and resolve_unshard_handover(config.extra.get("handover_unshard", "auto"),
                                                              mixed_precision=config.mixed_precision,
                                                              weight_bytes=weight_bytes)
                                 and handover.unshard_handover_unsupported_reason(self) is None)
        self.lean = None
        if lean_possible and (not self.sharded or self.fsdp_units == "model"):
            self.lean = build_lean_decoder(self.model)
        self._lean_logits = self.lean.response_logits if self.lean is not None else None
        if self.lean is not None and self.sharded:
            from torch.distributed.fsdp import register_fsdp_forward_method

            # through FSDP's forward hooks: all-gather before it, gradients reduce-scattered after its backward
            setattr(self.model, LEAN_FORWARD_METHOD, self.lean.response_logits)
            register_fsdp_forward_method(self.model, LEAN_FORWARD_METHOD)
            self._lean_logits = getattr(self.model, LEAN_FORWARD_METHOD)
        #: micro-batches each packed forward computed in the current train_step (``lean_packed`` / ``hf_packed``)
        self._routes: Counter[str] = Counter()
        #: what the routers did in each forward of the current train_step (MoE actors)
        self._routing: list[RoutingPass] = []
        # fused AdamW and foreach clipping: one kernel (one DTensor dispatch when sharded) for all parameters
        self._fused = self.device.type in ("cpu", "cuda")
        self._memory_metrics_cache: tuple[object, dict[str, float]] | None = None
        trained = adapter_parameters(self.model) if config.lora is not None else self.model.parameters()
        self.optimizer = build_optimizer(trained, config.optim, fused=self._fused) if self.trainable else None
        self.scheduler = build_scheduler(self.optimizer, config.optim) if self.optimizer is not None else None
        self._version = 0
        self.last_handover_stats: handover.HandoverStats | None = None
        self._captured_scores: list[torch.Tensor] = []
        if role == "reward_model":
            self._capture_scores(self.model)

    @property
    def moe_layers(self) -> int:
        """The actor model's MoE layers whose routers are tapped (capability ``replays_routing``; 0: dense)."""
        return 0 if self.router_tap is None else self.router_tap.num_layers

    # --- engine_base hooks ----------------------------------------------------------------------------------
    def _forward_module(self) -> torch.nn.Module:
        return self.model

    def train_step(self, batch: Batch, *, loss_fn: LossFn, mini_batch_size: int | None = None) -> dict[str, float]:
        """The base class's step; with padding removal it also reports ``lean_forward_share``: the share of its
        micro-batches the lean forward computed (the rest went through HF's packed forward)."""
        self._routes.clear()
        self._routing.clear()
        metrics = super().train_step(batch, loss_fn=loss_fn, mini_batch_size=mini_batch_size)
        if self._routes:
            metrics["lean_forward_share"] = self._routes["lean_packed"] / sum(self._routes.values())
        if self.router_tap is not None:
            metrics.update(compute_routing_metrics(self._routing, self.router_tap.blocks, prefix=self.role))
            self._routing.clear()
        return metrics

    def _forward_outputs(self, micro: Batch, *, with_entropy: bool,
                         entropy_metric: bool = False) -> dict[str, torch.Tensor]:
        """The model's outputs; for an MoE actor with its routers tapped: the recorded experts (``routed_experts``)
        replayed under ``router_replay=R3``, compared with what the forward routed, and the router logits kept
        for the losses when training."""
        tap = self.router_tap
        if tap is None:
            return self._model_outputs(micro, with_entropy=with_entropy, entropy_metric=entropy_metric)
        targets, compare, valid = self._routing_targets(micro)
        tap.begin(targets, compare, replay=self.config.router_replay == "R3", keep_logits=torch.is_grad_enabled(),
                  valid=valid)
        try:
            outputs = self._model_outputs(micro, with_entropy=with_entropy, entropy_metric=entropy_metric)
        finally:
            routing = tap.end()
        if torch.is_grad_enabled():
            self._routing.append(routing)
        return outputs

    def _routing_targets(self, micro: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The micro-batch's recorded experts [N, L, K], the tokens the flip metric counts [N] (recorded response
        tokens) and the valid (non-padding) tokens [N], each in the order the routers see the tokens (packed:
        :func:`packing.packed_source_index`; padded: row-major); the first two None without a recording."""
        mask = micro["attention_mask"].to(self.device).bool()
        rows, width = mask.shape
        index = packing.packed_source_index(mask) if self.packed else None
        valid = None if index is not None else mask.reshape(-1)
        if ROUTED_EXPERTS not in micro:
            if self.config.router_replay == "R3":
                raise EngineError(
                    f"actor.router_replay.mode=R3 replays the experts the rollout recorded, but the batch has no "
                    f"{ROUTED_EXPERTS!r} column (columns: {sorted(micro.keys())}). The hf rollout engine records "
                    "them in generate() for MoE models; multi-turn agent rollouts and other engines do not. Fix: "
                    "use rollout.engine=hf single-turn, or set actor.router_replay.mode=disabled")
            return None, None, valid
        recorded = micro[ROUTED_EXPERTS].to(self.device)
        if tuple(recorded.shape[:2]) != (rows, width):
            raise EngineError(f"{ROUTED_EXPERTS} is {tuple(recorded.shape)} but input_ids is {(rows, width)}: the "
                              "recorded routing must cover every input position [B, T, MoE layers, top-k]")
        response = torch.zeros_like(mask)
        response[:, width - forward.response_length(micro):] = True
        compare = mask & response & (recorded[..., 0, 0] >= 0)
        flat_targets = recorded.reshape(rows * width, *recorded.shape[2:])
        flat_compare = compare.reshape(-1)
        if index is None:
            return flat_targets, flat_compare, valid
        return flat_targets[index], flat_compare[index], valid

    def _auxiliary_loss(self, share: float) -> tuple[torch.Tensor | None, dict[str, float]]:
        """An MoE actor's router losses of the micro-batch just forwarded (Megatron's, summed over MoE layers):
        ``router_aux_loss_coef`` × load-balancing loss + ``router_z_loss_coef`` × z-loss, × ``share``; the metrics
        ``<role>/moe/load_balancing_loss`` and ``<role>/moe/z_loss`` are their means over layers, unscaled
        (measured when the coefficients are 0 too)."""
        if self.router_tap is None or not self._routing or not self._routing[-1].logits:
            return None, {}
        routing = self._routing[-1]
        blocks = self.router_tap.blocks
        balance = torch.stack([compute_load_balancing_loss(logits, own, block.num_experts)
                               for logits, own, block in zip(routing.logits, routing.own, blocks)])
        z_loss = torch.stack([compute_z_loss(logits) for logits in routing.logits])
        routing.logits = []  # the graph holds them until backward; the pass keeps only the own choices
        metrics = {f"{self.role}/moe/load_balancing_loss": float(balance.detach().mean()),
                   f"{self.role}/moe/z_loss": float(z_loss.detach().mean())}
        aux, z = self.config.router_aux_loss_coef, self.config.router_z_loss_coef
        if aux == 0 and z == 0:
            return None, metrics
        return share * (aux * balance.sum() + z * z_loss.sum()), metrics

    def _model_outputs(self, micro: Batch, *, with_entropy: bool,
                       entropy_metric: bool = False) -> dict[str, torch.Tensor]:
        if not self.packed:
            return super()._forward_outputs(micro, with_entropy=with_entropy, entropy_metric=entropy_metric)
        inputs = forward.model_inputs(micro, self.device) if self._lean_logits is not None else None
        if inputs is not None and shares_prompts(inputs, forward.response_length(micro)):
            # the lean forward removes the padding itself (valid tokens' logits only) and computes each repeated
            # prompt once; rows that share nothing pack through HF's modules, whose per-row causal attention is
            # faster on them (bench/packing.py: the lean forward 0.88-0.95x there)
            self._routes["lean_packed"] += 1
            logits = self._response_logits(micro, valid_only=True, inputs=inputs)  # [M, V]
            valid = micro["attention_mask"][:, -forward.response_length(micro):].to(self.device).bool()
            responses = micro["responses"].to(self.device)
            return packing.valid_token_outputs(logits, responses[valid], valid.reshape(-1).nonzero().squeeze(1),
                                               (valid.shape[0], valid.shape[1]), with_entropy=with_entropy,
                                               entropy_metric=entropy_metric)
        self._routes["hf_packed"] += 1
        return packing.packed_forward_outputs(self.model, micro, self.device, role=self.role,
                                              with_entropy=with_entropy, entropy_metric=entropy_metric)

    def _response_logits(self, micro: Batch, *, valid_only: bool = False,
                         inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        if self._lean_logits is None:
            return super()._response_logits(micro)
        # the lean forward (an FSDP forward method) skips the model's forward pre-hooks, among them the one that
        # brings parked shards home (handover.py, park=True): restore first, or FSDP would all-gather freed storage
        handover.restore_training_shards(self)
        inputs = inputs if inputs is not None else forward.model_inputs(micro, self.device)
        length = forward.response_length(micro)
        logits: torch.Tensor = self._lean_logits(inputs["input_ids"], inputs["attention_mask"],
                                                 inputs["position_ids"], length, remove_padding=self.packed,
                                                 valid_only=valid_only)
        return logits

    def _before_micro(self, index: int, count: int) -> None:
        if self._one_unit and self.trainable:
            # one unit: accumulate the gradients of a mini-batch's micro-batches unsharded and reduce-scatter once,
            # after the last backward (the weights stay gathered between them, as they do within one)
            last = index == count - 1
            module = cast("FSDPModule", self.model)
            module.set_requires_gradient_sync(last)
            module.set_reshard_after_backward(last)
        elif self.sharded and self.trainable and self.config.lora is not None:
            # LoRA (per-layer units): only the adapters have gradients, a few MB at most; accumulate them unsharded
            # over the micro-batches and reduce-scatter each unit once, after the last backward, instead of once per
            # micro-batch (the weights still reshard after every backward)
            cast("FSDPModule", self.model).set_requires_gradient_sync(index == count - 1)

    def _ensure_sharded(self) -> None:
        """Free the gathered weights a no-grad forward of the one-unit model left (they are gathered again by the
        next forward): what reads the parameters as shards (handover, checkpoints) must find shards."""
        if self._one_unit and self.trainable:
            handover.restore_training_shards(self)  # shards parked in the gathered weights come home before those go
            cast("FSDPModule", self.model).reshard()

    def _inference_context(self) -> AbstractContextManager[Any]:
        # unsharded: inference mode (less per-op bookkeeping); FSDP's hooks keep the plain no-grad mode
        return torch.inference_mode() if not self.sharded else torch.no_grad()

    def _backward(self, loss: torch.Tensor) -> None:
        torch.autograd.backward(loss)  # = loss.backward(), which torch leaves unannotated

    def _optimizer_step(self) -> float:
        assert self.optimizer is not None and self.scheduler is not None
        max_norm = self.config.optim.grad_clip if self.config.optim.grad_clip > 0 else math.inf
        # sharded: on the local shards with one scalar all-reduce (DTensor's dispatch cost more than the math at small
        # sizes); torch's for plain tensors and any gradient layout that helper does not take
        norm_value = clip_sharded_grad_norm_(self.model.parameters(), max_norm) if self.sharded else None
        if norm_value is None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=self._fused or None)
            norm_value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(norm_value):
            self.optimizer.step()
            self._version += 1
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm_value

    def _current_lr(self) -> float:
        assert self.scheduler is not None
        return float(self.scheduler.get_last_lr()[0])

    def _memory_metrics(self) -> dict[str, float]:
        # counted once per layout of what they count, not every step: reading a DTensor's local shard is an autograd
        # call (~240 a step at 26 parameters with AdamW state); the shards' shapes are fixed for the engine's life,
        # so what can change them is which parameters train and which have optimizer state
        parameters = list(self.model.parameters())
        state = self.optimizer.state if self.optimizer is not None else {}
        key = (tuple((id(p), p.requires_grad) for p in parameters),
               tuple((id(p), len(values)) for p, values in state.items()))
        if self._memory_metrics_cache is None or self._memory_metrics_cache[0] != key:
            counted = count_state_bytes(self.model, self.optimizer)
            self._memory_metrics_cache = (key, {f"{self.role}/{name}": float(value) for name, value in counted.items()})
        return dict(self._memory_metrics_cache[1])

    # --- state ----------------------------------------------------------------------------------------------
    def parallel_layout(self) -> ParallelLayout:
        """The training mesh the reshard planner sees: ``d`` data-sharded ranks (FSDP)."""
        return ParallelLayout(data=self.world_size, data_sharded=True)

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, scheduler, step and RNG state of every rank, written atomically under ``path``."""
        self._ensure_sharded()
        checkpoint.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Restore everything :meth:`save_checkpoint` wrote; the next step matches an uninterrupted run bit for bit."""
        self._ensure_sharded()
        checkpoint.load(self, path)

    def resolved_options(self) -> dict[str, object]:
        """What this engine chose where its config said ``auto`` (the run manifest's ``engine_options``): the
        precision, FSDP units, the gradient reduction dtype, the collectives (``shm`` or the process group's, with
        the reason) and the fast paths taken."""
        return {"mixed_precision": self.config.mixed_precision, "sharded": self.sharded,
                "fsdp_units": self.fsdp_units if self.sharded else None,
                "reduce_dtype": self.reduce_dtype if self.config.mixed_precision == "bf16" else "float32",
                "comm": "shm" if self.shm_comm_unused_reason is None else "process_group",
                "comm_reason": self.shm_comm_unused_reason, "unshard_handover": self.unshard_handover,
                "lean_forward": self.lean is not None, "packed": self.packed,
                # which forward scores and trains: the lean one or HF's modules; lean_packed: the lean forward with
                # the padding removed for micro-batches that repeat prompts, HF's packed forward for the others
                "forward": ("lean" if self.lean is not None else "hf") + ("_packed" if self.packed else "_padded")}

    def export_hf(self, path: str) -> None:
        """Write an HF model directory (config + safetensors; tokenizer copied when the source has one) from rank 0."""
        self._ensure_sharded()
        checkpoint.export_hf(self, path)

    def generation_weights(self, *, target: str = "hf", tensor_parallel_size: int = 1,
                           park: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's weights of generation layout (pg = 1, tg = ``tensor_parallel_size``), HF-named: full tensors
        at tg = 1, tensor-parallel shards (column/vocab dim 0, row dim 1, norms whole) above. A collective: every
        rank must consume the whole iterator. Default path ``reshard`` (the planner; shards that coincide with the
        FSDP shard are views of it; ``park``: every other FSDP shard's storage is released once copied into its
        generation shard, until :meth:`end_generation`); ``extra.handover=stream`` gathers full tensors one by one
        (tg = 1 only, never parks). At tg = 1 with ``park`` on a one-unit trainable actor (``unshard_handover``;
        ``extra.handover_unshard=false`` turns it off) the handover is FSDP's own all-gather instead
        (:func:`handover.unshard_generation_weights`): the tensors are views of FSDP's unsharded parameters, valid
        until the unit is resharded (after the next update's backward), and the update does not gather again. Bytes
        are in ``last_handover_stats`` once it is exhausted."""
        self._check_role("generation_weights", ("actor", "reference"))
        path = self.config.extra.get("handover", handover.DEFAULT_PATH)
        if path not in handover.PATHS:
            raise ConfigError(f"actor.extra.handover must be one of {handover.PATHS}, got {path!r}")
        if self.world_size % tensor_parallel_size:
            raise ConfigError(f"generation tensor_parallel_size {tensor_parallel_size} must divide the fsdp engine's "
                              f"{self.world_size} ranks; pick one of the divisors of {self.world_size}")
        if path == "reshard" and tensor_parallel_size == 1 and park and self.unshard_handover:
            # FSDP's all-gather is the handover; the update's forward finds the weights gathered (not resharded here)
            return handover.unshard_generation_weights(self, target=target, park=park)
        self._ensure_sharded()
        if path == "stream":
            if tensor_parallel_size != 1:
                raise ConfigError(f"actor.extra.handover=stream gathers full weights (tg = 1) but generation asks "
                                  f"for tg = {tensor_parallel_size}; remove actor.extra.handover (default reshard)")
            return handover.stream_generation_weights(self, target=target)
        return handover.reshard_generation_weights(self, target=target, tensor=tensor_parallel_size, park=park)

    def adapter_scales(self) -> dict[str, float]:
        """Wrapped module → ``alpha / rank`` for adapter-only weight sync (:mod:`hybridflow.adapter_sync`); empty
        without LoRA, on a non-actor role, or with ``extra.lora_sync=merged`` (every handover the merged model)."""
        mode = self.config.extra.get("lora_sync", "adapters")
        if mode not in LORA_SYNC_MODES:
            raise ConfigError(f"actor.extra.lora_sync must be one of {LORA_SYNC_MODES}, got {mode!r}. Fix: "
                              "'adapters' (the default: the base once, then the LoRA factors) or 'merged' (the whole "
                              "merged model every sync)")
        if self.config.lora is None or self.role != "actor" or mode == "merged":
            return {}
        return lora_scales(self.model)

    def generation_base_weights(self, *, target: str = "hf") -> Iterator[tuple[str, torch.Tensor]]:
        """A LoRA actor's base weights, full tensors by HF name, adapters not merged (the reshard planner at tg = 1,
        no parking): what a rollout engine that applies adapters itself keeps. A collective."""
        self._check_role("generation_base_weights", ("actor",))
        self._ensure_sharded()
        return handover.reshard_generation_weights(self, target=target, tensor=1, merge_lora=False)

    def generation_adapters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every LoRA factor, whole (:func:`handover.adapter_generation_weights`). A collective."""
        self._check_role("generation_adapters", ("actor",))
        if self.config.lora is None:
            raise ConfigError("generation_adapters() needs LoRA adapters on the actor; this actor has none. Fix: "
                              "set actor.lora.rank, or hand over generation_weights()")
        self._ensure_sharded()
        return handover.adapter_generation_weights(self)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors holding this rank's weights (capability ``holds_weights``; none once released)."""
        return list(self.model.parameters()) if hasattr(self, "model") else []

    def end_generation(self) -> None:
        """Give the FSDP shards parked by ``generation_weights(park=True)`` their storage back (bit for bit, from the
        generation shards); a no-op when none is parked."""
        handover.restore_training_shards(self)

    def release(self) -> None:
        """Drop the model and optimizer (the process group stays, it belongs to the worker)."""
        if hasattr(self, "model"):
            del self.model  # a released engine holds no model; a later call fails on the missing attribute
        self.lean = None
        self.optimizer = None
        self.scheduler = None


def _build_router_tap(model: torch.nn.Module, *, role: str, config: TrainingEngineConfig) -> RouterTap | None:
    """Hooks on an MoE actor's routers (None for other roles and dense models), after checking the MoE keys."""
    moe = bool(find_moe_blocks(model))
    wants = {key: value for key, value in (("router_replay", config.router_replay != "disabled"),
                                           ("router_aux_loss_coef", config.router_aux_loss_coef > 0),
                                           ("router_z_loss_coef", config.router_z_loss_coef > 0)) if value}
    if wants and not (moe and role == "actor"):
        key = next(iter(wants))
        raise ConfigError(f"actor.{key} acts on the routers of a mixture-of-experts actor, but this {role}'s model "
                          f"({type(model).__name__}) has no MoE layers. Fix: remove {key}, or train an MoE model "
                          "(e.g. model_type qwen3_moe)")
    if config.router_replay == "R3" and config.gradient_checkpointing:
        raise ConfigError("actor.router_replay.mode=R3 with actor.gradient_checkpointing=true: the recomputed "
                          "forward in backward would route afresh, not replay. Fix: set actor.gradient_checkpointing"
                          "=false, or actor.router_replay.mode=disabled")
    return RouterTap(model) if moe and role == "actor" else None


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
