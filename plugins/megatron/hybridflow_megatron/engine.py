"""The ``megatron`` training engine: one rank of a megatron-core GPTModel in a (tensor, pipeline, data) mesh.

It computes per-token log-probs/entropy/values of response tokens and runs optimizer steps with a caller-supplied
loss through megatron's forward-backward schedules (so pipeline parallelism works); the algorithm and how batches
reach the ranks belong to the core. Stability: public.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.engines import ROLES, LossFn, MeshInfo, TrainingEngineConfig, local_mini_batch_rows
from hybridflow.errors import ConfigError, EngineError
from hybridflow_megatron import cpu_shim, handover, persist
from hybridflow_megatron.batching import attention_inputs, pad_rows, require_columns
from hybridflow_megatron.model import VALUE_HEAD_ROLES, build_stage, close_engine, ensure_parallel_state, track_engine
from hybridflow_megatron.options import check_engine_keys
from hybridflow_megatron.spec_names import named_local_parameters, uses_transformer_engine

__all__ = ["MegatronTrainingEngine", "build_megatron_training_engine", "TRAINABLE_ROLES"]

TRAINABLE_ROLES = ("actor", "critic")
_SUPPORTED_ROLES = ("actor", "critic", "reference", "reward_model")


class MegatronTrainingEngine:
    """One rank of a megatron-core model for role actor, critic or reference (stability: public).

    Loss convention (``hybridflow.algorithms.losses``): each micro-batch passed to ``loss_fn`` carries the
    mini-batch totals ``loss_scale_tokens``/``loss_scale_rows`` of this rank in ``meta``; its loss is back-propagated
    as is (the schedule's division by the number of micro-batches is undone) and megatron's DDP averages gradients
    over data-parallel ranks.
    """

    def __init__(self, *, role: str, config: TrainingEngineConfig, device: str = "cpu") -> None:
        if role not in _SUPPORTED_ROLES:
            raise ConfigError(f"unknown role {role!r}; the megatron engine serves {list(_SUPPORTED_ROLES)}")
        check_engine_keys(role, config)
        self.role = role
        self.config = config
        self.device = torch.device(device if device == "cpu" else "cuda")
        extra = dict(config.extra)
        self.placement = ensure_parallel_state(config.parallel, device=device,
                                               timeout_s=float(extra.get("timeout_s", 120)), seed=config.model.seed)
        try:
            model, self.arch, self.hf_config = build_stage(
                config.model, role=role, placement=self.placement, device=device,
                overrides=extra.get("transformer_overrides"), vocab_multiple=int(extra.get("vocab_multiple", 8)),
                transformer_engine=uses_transformer_engine(device, extra),
            )
            self.trainable = role in TRAINABLE_ROLES
            self.optimizer: Any = None
            self._version = 0
            self._step = 0
            if self.trainable:
                self.model, self.optimizer = self._wrap_for_training(model)
            else:
                model.requires_grad_(False)
                self.model = model
        except BaseException:
            close_engine(self)  # the parallel state is not the next engine's (when no other engine uses it)
            raise
        track_engine(self)
        self.last_handover_stats: handover.HandoverStats | None = None
        self.handover = handover.WeightHandover(
            self, bucket_bytes=int(extra.get("handover_bucket_bytes", handover.DEFAULT_BUCKET_BYTES)))

    # --- construction ---------------------------------------------------------------------------------------
    def _wrap_for_training(self, model: Any) -> tuple[Any, Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        optim = self.config.optim
        use_distributed = bool(self.config.extra.get("use_distributed_optimizer", True))
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed,
        )
        model_config = model.config
        with cpu_shim.cpu_tensor_methods():
            wrapped = DistributedDataParallel(config=model_config, ddp_config=ddp_config, module=model)
            optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=optim.lr, min_lr=optim.lr * optim.min_lr_ratio,
                    weight_decay=optim.weight_decay, adam_beta1=optim.betas[0], adam_beta2=optim.betas[1],
                    adam_eps=optim.eps, clip_grad=optim.grad_clip, use_distributed_optimizer=use_distributed,
                    bf16=model_config.bf16, fp16=model_config.fp16, params_dtype=model_config.params_dtype,
                ),
                [wrapped],
                use_gloo_process_groups=self.device.type != "cpu",
            )
        model_config.finalize_model_grads_func = finalize_model_grads
        model_config.no_sync_func = wrapped.no_sync
        model_config.grad_scale_func = optimizer.scale_loss
        return wrapped, optimizer

    @property
    def module(self) -> Any:
        """The GPTModel stage (without the DDP wrapper)."""
        return self.model.module if hasattr(self.model, "module") and self.trainable else self.model

    # --- forward --------------------------------------------------------------------------------------------
    def _micro_batches(self, batch: Batch) -> list[Batch]:
        size = min(self.config.micro_batch_size, len(batch))
        batch = pad_rows(batch, size)
        return [batch.slice(start, start + size) for start in range(0, len(batch), size)]

    def _outputs(self, micro: Batch, output: torch.Tensor, *, with_entropy: bool,
                 entropy_metric: bool = False) -> dict[str, torch.Tensor]:
        length = int(micro["responses"].shape[1])
        if self.role == "reward_model":  # the head's value at each row's last real token
            attention = micro["attention_mask"].to(output.device)
            last = attention.shape[1] - 1 - attention.flip(-1).long().argmax(-1)
            return {"scores": output[torch.arange(len(last), device=output.device), last, 0].float()}
        window = output[:, -length - 1 : -1]
        if self.role == "critic":
            return {"values": window[..., 0].float()}
        logits = window[..., : self.arch.vocab_size].float()
        log_softmax = torch.log_softmax(logits, dim=-1)
        tokens = micro["responses"].to(logits.device)
        outputs = {"log_probs": log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)}
        if with_entropy:
            outputs["entropy"] = -(log_softmax.exp() * log_softmax).sum(-1)
        elif entropy_metric:  # training without an entropy bonus: detached, for the actor/entropy metric
            with torch.no_grad():
                detached = log_softmax.detach()
                outputs["entropy"] = -(detached.exp() * detached).sum(-1)
        return outputs

    def _run_schedule(self, micros: list[Batch], *, forward_only: bool, loss_fn: LossFn | None,
                      with_entropy: bool) -> list[dict[str, Any]]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        count = len(micros)

        def loss_func(micro: Batch, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            outputs = self._outputs(micro, output, with_entropy=with_entropy, entropy_metric=not forward_only)
            if loss_fn is None:
                return output.new_zeros(()), {key: value.detach().cpu() for key, value in outputs.items()}
            loss, metrics = loss_fn(outputs, micro)
            return loss * count, {"loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}

        def forward_step(data_iterator: Iterator[Batch], model: Any) -> tuple[torch.Tensor, Any]:
            micro = next(data_iterator)
            input_ids, position_ids, mask = attention_inputs(micro, self.device)
            return model(input_ids, position_ids, attention_mask=mask), partial(loss_func, micro)

        schedule = get_forward_backward_func()
        results: list[dict[str, Any]] = schedule(
            forward_step_func=forward_step,
            data_iterator=iter(micros),
            model=[self.model],
            num_microbatches=count,
            seq_length=int(micros[0]["input_ids"].shape[1]),
            micro_batch_size=len(micros[0]),
            forward_only=forward_only,
        )
        return results

    def _broadcast_from_last_stage(self, value: Any) -> Any:
        """``value`` of the last pipeline stage, on every stage of this rank's pipeline (an object broadcast)."""
        if self.placement.pp_size == 1:
            return value
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        holder = [value]
        dist.broadcast_object_list(holder, src=dist.get_global_rank(group, self.placement.pp_size - 1), group=group)
        return holder[0]

    def _check_role(self, method: str, roles: tuple[str, ...]) -> None:
        if self.role not in roles:
            raise EngineError(f"{method} is for roles {list(roles)}; this engine is a {self.role}")

    def _infer(self, batch: Batch, *, columns: tuple[str, ...], with_entropy: bool) -> Batch:
        self.handover.restore()
        self.model.eval()
        with torch.no_grad():
            stored = self._run_schedule(self._micro_batches(batch), forward_only=True, loss_fn=None,
                                        with_entropy=with_entropy)
        result = None
        if self.placement.is_last_stage:
            result = {c: torch.cat([part[c] for part in stored])[: len(batch)] for c in columns}
        result = self._broadcast_from_last_stage(result)
        return Batch(result, meta=batch.meta, batch_size=len(batch))

    def compute_log_probs(self, batch: Batch, *, with_entropy: bool = False) -> Batch:
        """``log_probs`` [B, R] (and ``entropy``) of ``responses``.

        Returns only the new columns, with ``batch.meta``.
        """
        self._check_role("compute_log_probs", ("actor", "reference"))
        require_columns(batch, "input_ids", "attention_mask", "responses", method="compute_log_probs")
        columns = ("log_probs", "entropy") if with_entropy else ("log_probs",)
        return self._infer(batch, columns=columns, with_entropy=with_entropy)

    def compute_values(self, batch: Batch) -> Batch:
        """``values`` [B, R]: the value of the state before each response token; only the new column is returned."""
        self._check_role("compute_values", ("critic",))
        require_columns(batch, "input_ids", "attention_mask", "responses", method="compute_values")
        return self._infer(batch, columns=("values",), with_entropy=False)

    def compute_scores(self, batch: Batch) -> Batch:
        """``scores`` [B]: the reward head at the last non-pad token of each row; only the new column is returned."""
        self._check_role("compute_scores", ("reward_model",))
        require_columns(batch, "input_ids", "attention_mask", method="compute_scores")
        return self._infer(batch, columns=("scores",), with_entropy=False)

    # --- training -------------------------------------------------------------------------------------------
    def _local_mini_batch_rows(self, rows: int, mini_batch_size: int | None) -> int:
        return local_mini_batch_rows(rows, mini_batch_size, self.placement.dp_size)

    def _global_loss_scale(self, local: dict[str, float]) -> dict[str, float]:
        """Mini-batch token/row totals over the data-parallel group ÷ dp, so DP averaging gives the global mean."""
        if self.placement.dp_size == 1:
            return local
        from megatron.core import parallel_state as ps

        keys = sorted(local)
        totals = torch.tensor([local[key] for key in keys], dtype=torch.float64)
        dist.all_reduce(totals, group=ps.get_data_parallel_group())
        return {key: float(value) / self.placement.dp_size for key, value in zip(keys, totals.tolist())}

    def _learning_rate(self) -> float:
        optim = self.config.optim
        if optim.warmup_steps and self._step < optim.warmup_steps:
            return optim.lr * (self._step + 1) / optim.warmup_steps
        if optim.schedule == "constant" or not optim.total_steps:
            return optim.lr
        progress = min(1.0, (self._step - optim.warmup_steps) / max(1, optim.total_steps - optim.warmup_steps))
        floor = optim.lr * optim.min_lr_ratio
        if optim.schedule == "linear":
            return floor + (optim.lr - floor) * (1.0 - progress)
        return floor + (optim.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def train_step(self, batch: Batch, *, loss_fn: LossFn, mini_batch_size: int | None = None) -> dict[str, float]:
        """One optimizer step per mini-batch (all of ``batch`` when ``mini_batch_size`` is None); returns metrics.

        ``mini_batch_size`` counts rows over all data-parallel ranks; ``micro_batch_size`` (config) counts rows per
        forward on this rank. Every rank of a data-parallel group must hold the same number of rows.
        """
        from hybridflow.loss_scale import compute_loss_scale

        self._check_role("train_step", TRAINABLE_ROLES)
        require_columns(batch, "input_ids", "attention_mask", "responses", "response_mask", method="train_step")
        local_mini = self._local_mini_batch_rows(len(batch), mini_batch_size)
        self.handover.restore()
        wants = getattr(loss_fn, "required_outputs", None)
        with_entropy = self.role == "actor" and (wants is None or "entropy" in wants)
        self.model.train()
        totals: dict[str, float] = {}
        steps = 0
        for start in range(0, len(batch), local_mini):
            mini = batch.slice(start, start + local_mini)
            scale = self._global_loss_scale(compute_loss_scale(mini))
            micros = [micro.with_meta(**scale) for micro in self._micro_batches(mini)]
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            stored = self._run_schedule(micros, forward_only=False, loss_fn=loss_fn, with_entropy=with_entropy)
            for group in self.optimizer.param_groups:
                group["lr"] = self._learning_rate()
            with cpu_shim.cpu_tensor_methods():  # megatron's grad clipping checks param.grad.type()
                success, grad_norm, _ = self.optimizer.step()
            self._step += 1
            if success:
                self._version += 1
            metrics: dict[str, float] | None = None
            if self.placement.is_last_stage:
                metrics = {}
                for part in stored:  # "loss": the mini-batch loss (a sum over micro-batches); others: means
                    for key, value in part.items():
                        weight = 1.0 if key == "loss" else 1.0 / len(stored)
                        metrics[key] = metrics.get(key, 0.0) + float(value) * weight
            metrics = self._broadcast_from_last_stage(metrics)
            metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
            steps += 1
        result = {key: value / steps for key, value in totals.items()}
        result.update(lr=self.optimizer.param_groups[0]["lr"], optimizer_steps=float(steps))
        return result

    # --- state ----------------------------------------------------------------------------------------------
    def state_version(self) -> int:
        """Number of successful optimizer steps (restored by ``load_checkpoint``)."""
        return self._version

    def mesh_info(self) -> MeshInfo:
        """Data goes to data-parallel groups; results are collected from the last stage's tensor rank 0."""
        placement = self.placement
        return MeshInfo(dp_rank=placement.dp_rank, dp_size=placement.dp_size,
                        is_collect=placement.is_last_stage and placement.tp_rank == 0)

    def save_checkpoint(self, path: str) -> None:
        """Every rank's parameter shard, optimizer shard, step and RNG state, written atomically under ``path``."""
        self.handover.restore()
        persist.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote with the same (tp, pp, dp) layout."""
        self.handover.restore()
        persist.load(self, path)

    def export_hf(self, path: str) -> None:
        """Write an HF model directory (config + safetensors) from global rank 0; a collective over all ranks."""
        self.handover.restore()
        persist.export_hf(self, path)

    def layout(self) -> Any:
        """This model's :class:`hybridflow.resharding.ModelLayout` over the (p, t, d) training mesh."""
        from hybridflow_megatron.layout import build_megatron_training_layout

        arch, placement = self.arch, self.placement
        state = self._canonical_shapes()
        return build_megatron_training_layout(
            state, tensor=placement.tp_size, pipeline=placement.pp_size, data=placement.dp_size,
            num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
            dtype=next(self.module.parameters()).dtype,
        )

    def _canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        factory = AutoModelForTokenClassification if self.role in VALUE_HEAD_ROLES else AutoModelForCausalLM
        with torch.device("meta"):
            hf = factory.from_config(self.hf_config)  # type: ignore[no-untyped-call]  # untyped in HF
        shapes = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
        if self.arch.tied_embeddings:
            shapes.pop("lm_head.weight", None)
        return shapes

    def iter_weight_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's local shards named as in :meth:`layout` (no copy, no communication)."""
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        from hybridflow_megatron.layout import layout_name_of

        if self.arch.padded_vocab_size != self.arch.vocab_size:
            raise EngineError(
                f"vocab {self.arch.vocab_size} was padded to {self.arch.padded_vocab_size} for tensor parallelism; "
                "layout shards need a vocabulary the tensor size × extra.vocab_multiple divides"
            )
        offset = int(get_transformer_layer_offset(self.module.config))
        for name, param in named_local_parameters(self.module):
            if self.arch.tied_embeddings and name == "output_layer.weight":
                continue  # the last stage's copy of the tied embedding
            yield layout_name_of(name, layer_offset=offset, value_head=self.arch.value_head), param.detach()

    def generation_weights(self, *, target: str = "hf", tensor_parallel_size: int = 1,
                           park: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named weights of generation layout (pg = 1, tg = ``tensor_parallel_size``) on every rank: full tensors at
        tg = 1, this rank's tensor-parallel shards above (a collective over all ranks), moved by the core reshard
        planner's cached plan; see :mod:`hybridflow_megatron.handover` (stats in ``last_handover_stats``). ``park``
        (the actor worker's default): the training parameters' storage is released into the generation shards
        holding it until :meth:`end_generation` (or the next forward, step or checkpoint)."""
        self._check_role("generation_weights", ("actor", "reference"))
        if tensor_parallel_size != 1:  # shards the training shard already is are views of it (no second copy)
            layout = self.handover.generation_layout(tensor=tensor_parallel_size)
            return iter(self.handover.reshard(layout, name=target, views=True, park=park).items())
        return self.handover.generation_weights(target=target, park=park)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors holding this rank's weights (capability ``holds_weights``)."""
        return list(self.model.parameters())

    def end_generation(self) -> None:
        """Give the training parameters parked by ``generation_weights(park=True)`` their storage back (bit for bit,
        from the generation shards); a no-op when none is parked. Call it on every rank: where a rank's training
        shard did not lie in its own generation shards (tg not dividing t) it fetches the rest from the other ranks'
        (a collective)."""
        self.handover.restore()

    def parallel_layout(self) -> Any:
        """The (p, t, d) training mesh (a :class:`hybridflow.resharding.ParallelLayout`) generation layouts are
        drawn in."""
        return self.layout().mesh

    def reshard_weights(self, target: Any) -> dict[str, torch.Tensor]:
        """This rank's shards of ``target``, a ``ModelLayout`` over ``GenerationLayout(..., training=
        self.layout().mesh)`` (e.g. vLLM's fused per-TP-rank layout); a collective over all ranks."""
        self._check_role("reshard_weights", ("actor", "reference"))
        return self.handover.reshard(target)

    def release(self) -> None:
        """Drop the model and optimizer (the process groups stay; they belong to the worker)."""
        self.model = None
        self.optimizer = None

    def close(self) -> None:
        """:meth:`release`, then, once no other megatron engine of this process is open, megatron's process-wide
        state (its parallel groups and memory buffers, the (t, p) this process was set up for, the model-parallel
        RNG tracker, the CPU shim: :func:`hybridflow_megatron.model.release_megatron_state`), so that the worker
        host may restore this process for another run's engines (``reusable_process``), of any (t, p). Every rank
        calls it; torch.distributed stays up, it belongs to the worker. Idempotent."""
        self.release()
        close_engine(self)


def build_megatron_training_engine(*, role: str, config: TrainingEngineConfig,
                                   device: str = "cpu") -> MegatronTrainingEngine:
    """Factory registered as training engine ``"megatron"``."""
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}; expected one of {list(ROLES)}")
    return MegatronTrainingEngine(role=role, config=config, device=device)
