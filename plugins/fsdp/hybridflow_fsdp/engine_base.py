"""What the HF-module training engines share (``fsdp``, ``deepspeed``): forwards, inference, the mini/micro-batch
training loop and its loss scaling, with template hooks for what the wrapper (FSDP2, a DeepSpeed engine) does
differently. Stability: developer.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.engines import LossFn, MeshInfo, TrainingEngineConfig, local_mini_batch_rows
from hybridflow.errors import ConfigError, EngineError
from hybridflow.loss_scale import LOSS_SCALE_ROWS, LOSS_SCALE_TOKENS
from hybridflow_fsdp import forward, packing
from hybridflow_fsdp.distributed import raise_unequal_across_ranks

__all__ = [
    "HFTrainingEngineBase", "enable_gradient_checkpointing", "TRAINABLE_ROLES", "LOSS_SCALE_ROWS", "LOSS_SCALE_TOKENS",
]

TRAINABLE_ROLES = ("actor", "critic")
#: meta keys the engine sets on every micro-batch it passes to ``loss_fn`` (the core's convention)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Decoder layers recompute their forward in backward (transformers >= 5 names it activation checkpointing)."""
    enable = cast("Callable[[], None] | None", getattr(model, "activation_checkpointing_enable", None))
    if enable is None:
        enable = cast("Callable[[], None]", model.gradient_checkpointing_enable)
    enable()


class HFTrainingEngineBase(abc.ABC):
    """One rank of an HF model trained data-parallel (stability: developer).

    Subclasses set ``role``, ``config``, ``device``, ``rank``, ``world_size``, ``_version`` and ``_captured_scores``
    and fill in the hooks: :meth:`_forward_module` (what a forward calls), :meth:`_backward`,
    :meth:`_optimizer_step` and :meth:`_current_lr`; :meth:`_response_logits`, :meth:`_inference_context`,
    :meth:`_before_micro` and :meth:`_memory_metrics` have defaults.
    """

    role: str
    config: TrainingEngineConfig
    device: torch.device
    rank: int
    world_size: int
    _version: int
    _captured_scores: list[torch.Tensor]

    # --- hooks ----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _forward_module(self) -> Any:
        """The callable module a forward runs (the FSDP-wrapped model, the DeepSpeed engine)."""

    @abc.abstractmethod
    def _backward(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's loss, unweighted."""

    @abc.abstractmethod
    def _optimizer_step(self) -> float:
        """Clip, step and advance the LR schedule at the end of a mini-batch; returns the pre-clip gradient norm."""

    @abc.abstractmethod
    def _current_lr(self) -> float:
        """The learning rate after the last step."""

    def _response_logits(self, micro: Batch) -> torch.Tensor:
        """Logits that predict each response token, [B, R, V]."""
        return forward.response_logits(self._forward_module(), micro, self.device)

    def _inference_context(self) -> AbstractContextManager[Any]:
        """The grad mode of :meth:`compute_log_probs` / :meth:`compute_values`."""
        return torch.no_grad()

    def _before_micro(self, index: int, count: int) -> None:
        """Called before the forward of micro-batch ``index`` of the ``count`` in a mini-batch (default: nothing)."""
        return None

    def _memory_metrics(self) -> dict[str, float]:
        """Metrics counted from this rank's tensors after a train step (weights, trainable parameters, optimizer
        state); default: none."""
        return {}

    def _auxiliary_loss(self, share: float) -> tuple[torch.Tensor | None, dict[str, float]]:
        """A loss term of the micro-batch just forwarded that the model itself adds (an MoE router's
        load-balancing loss), already weighted by ``share`` (the micro-batch's share of the mini-batch rows), and
        its metrics; default: none."""
        return None, {}

    def _capture_scores(self, module: torch.nn.Module) -> None:
        """Record the output of ``module``'s ``score`` head on every forward (reward models)."""
        head = getattr(module, "score", None)
        if head is None:
            raise ConfigError(f"reward model {type(module).__name__} has no `score` head")
        head.register_forward_hook(lambda _module, _inputs, output: self._captured_scores.append(output))

    # --- inference ------------------------------------------------------------------------------------------
    def _micro_batch_rows(self, batch: Batch) -> list[list[int]] | None:
        """Rows of each micro-batch under ``max_tokens_per_micro_batch`` (None: slices of ``micro_batch_size``).

        Every data-parallel rank runs as many micro-batches (the most any rank needs), so sharded forwards pair up.
        """
        budget = getattr(self.config, "max_tokens_per_micro_batch", None)
        if budget is None:
            return None
        key = f"{self.role}.max_tokens_per_micro_batch"
        tokens = packing.count_row_tokens(batch)
        bins = packing.count_token_bins(tokens, budget, key=key)
        if self.world_size > 1:
            count = torch.tensor([bins], dtype=torch.int64)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            bins = min(int(count[0]), len(batch))
        return packing.partition_by_tokens(tokens, budget, bins=bins, key=key)

    def _micro_batches(self, batch: Batch, rows: list[list[int]] | None = None) -> Iterator[Batch]:
        groups = self._micro_batch_rows(batch) if rows is None else rows
        if groups is not None:
            for group in groups:
                yield batch.index(group)
            return
        size = self.config.micro_batch_size
        for start in range(0, len(batch), size):
            yield batch.slice(start, min(start + size, len(batch)))

    @staticmethod
    def _restore_row_order(tensor: torch.Tensor, rows: list[list[int]] | None) -> torch.Tensor:
        """Rows concatenated in micro-batch order (``rows``) back to the batch's order."""
        if rows is None:
            return tensor
        order = torch.tensor([row for group in rows for row in group], dtype=torch.long)
        return torch.empty_like(tensor).index_copy_(0, order, tensor)

    def _forward_outputs(self, micro: Batch, *, with_entropy: bool,
                         entropy_metric: bool = False) -> dict[str, torch.Tensor]:
        """``log_probs`` (and ``entropy``) of the response tokens, or the critic's ``values``.

        ``with_entropy`` computes the entropy with gradients (an entropy bonus); ``entropy_metric`` computes it
        detached from the same log-softmax, for the ``actor/entropy`` metric: no extra forward, no backward cost.
        """
        if self.role == "critic":
            length = forward.response_length(micro)
            logits = self._forward_module()(**forward.model_inputs(micro, self.device), use_cache=False).logits
            return {"values": logits[:, -length - 1 : -1, 0].float()}
        logits = self._response_logits(micro)
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
        self._forward_module().eval()
        parts: dict[str, list[torch.Tensor]] = {column: [] for column in columns}
        rows = self._micro_batch_rows(batch)
        with self._inference_context():
            for micro in self._micro_batches(batch, rows):
                outputs = self._forward_outputs(micro, with_entropy=with_entropy)
                for column in columns:
                    parts[column].append(outputs[column].cpu())
            merged = {c: self._restore_row_order(torch.cat(p), rows) for c, p in parts.items()}
        # ordinary tensors out (inference tensors cannot be saved for a later backward)
        return Batch({c: t.clone() if t.is_inference() else t for c, t in merged.items()}, meta=batch.meta,
                     batch_size=len(batch))

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
        module = self._forward_module()
        module.eval()
        scores = []
        rows = self._micro_batch_rows(batch)
        for micro in self._micro_batches(batch, rows):
            self._captured_scores.clear()
            inputs = forward.model_inputs(micro, self.device)
            module(**inputs, use_cache=False)
            per_token = self._captured_scores[-1][..., 0].float()
            index = forward.last_token_index(inputs["attention_mask"])
            scores.append(per_token.gather(1, index.unsqueeze(1)).squeeze(1).cpu())
        self._captured_scores.clear()
        return Batch({"scores": self._restore_row_order(torch.cat(scores), rows)}, meta=batch.meta,
                     batch_size=len(batch))

    # --- training -------------------------------------------------------------------------------------------
    def _local_mini_batch_rows(self, rows: int, mini_batch_size: int | None) -> int:
        return local_mini_batch_rows(rows, mini_batch_size, self.world_size)

    def _count_global(self, mini: Batch, *, check_rows: int | None = None) -> tuple[int, int]:
        """Rows and valid response tokens of the mini-batch on all ranks (``is_padding`` rows excluded), in one
        all-reduce. ``check_rows`` (the rows of the whole batch on this rank) rides in the same all-reduce as Σn and
        Σn²: they are equal on every rank iff w·Σn² = (Σn)² (Cauchy-Schwarz), so the equal-rows check of a train
        step costs no collective of its own; on a mismatch every rank sees it and raises (naming each rank's rows)."""
        from hybridflow.loss_scale import compute_loss_scale

        scale = compute_loss_scale(mini) if "response_mask" in mini else {"loss_scale_rows": len(mini),
                                                                            "loss_scale_tokens": 0}
        values = [int(scale["loss_scale_rows"]), int(scale["loss_scale_tokens"])]
        if check_rows is not None:
            values += [check_rows, check_rows * check_rows]
        counts = torch.tensor(values, dtype=torch.int64)
        if self.world_size > 1:
            dist.all_reduce(counts)
            if check_rows is not None and self.world_size * int(counts[3]) != int(counts[2]) ** 2:
                raise_unequal_across_ranks(check_rows, what="rows per train_step")
        return int(counts[0]), int(counts[1])

    def train_step(self, batch: Batch, *, loss_fn: LossFn, mini_batch_size: int | None = None) -> dict[str, float]:
        """One optimizer step per mini-batch (all of ``batch`` when ``mini_batch_size`` is None); returns metrics.

        ``mini_batch_size`` counts rows over all data-parallel ranks; ``micro_batch_size`` (config) counts rows per
        forward on this rank. Every rank must hold the same number of rows.
        """
        self._check_role("train_step", TRAINABLE_ROLES)
        forward.require_columns(batch, "input_ids", "attention_mask", "responses", method="train_step")
        # the first mini-batch's row/token all-reduce checks that every rank holds as many rows, before any other
        # collective; a ConfigError of this rank's mini-batch split waits for it (rows differing across ranks would
        # otherwise raise on some ranks and leave the others in that all-reduce)
        try:
            local_mini = self._local_mini_batch_rows(len(batch), mini_batch_size)
            split_error: ConfigError | None = None
        except ConfigError as error:
            local_mini, split_error = max(len(batch), 1), error
        first_counts = self._count_global(batch.slice(0, local_mini), check_rows=len(batch))
        if split_error is not None:
            raise split_error
        wants = getattr(loss_fn, "required_outputs", None)
        # entropy with gradients only when the loss asks for it; an actor's loss always gets it (detached otherwise)
        with_entropy = self.role == "actor" and (wants is None or "entropy" in wants)
        self._forward_module().train()
        totals: dict[str, float] = {}
        steps = 0
        for mini_start in range(0, len(batch), local_mini):
            mini = batch.slice(mini_start, mini_start + local_mini)
            global_rows, global_tokens = first_counts if mini_start == 0 else self._count_global(mini)
            micros = list(self._micro_batches(mini))
            for index, micro in enumerate(micros):
                micro = micro.with_meta(**{LOSS_SCALE_ROWS: global_rows / self.world_size,
                                           LOSS_SCALE_TOKENS: global_tokens / self.world_size})
                self._before_micro(index, len(micros))
                outputs = self._forward_outputs(micro, with_entropy=with_entropy, entropy_metric=self.role == "actor")
                loss, metrics = loss_fn(outputs, micro)
                weight = len(micro) / len(mini)  # metrics are micro-batch means; the loss is already a share
                auxiliary, auxiliary_metrics = self._auxiliary_loss(weight)
                if auxiliary is not None:
                    loss = loss + auxiliary
                metrics = {**metrics, **auxiliary_metrics}
                self._backward(loss)
                totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + float(value) * weight
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + self._optimizer_step()
            steps += 1
        metrics = {key: value / steps for key, value in totals.items()}
        metrics.update(lr=self._current_lr(), optimizer_steps=float(steps))
        metrics.update(self._memory_metrics())
        return metrics

    # --- state ----------------------------------------------------------------------------------------------
    def state_version(self) -> int:
        """Number of optimizer steps taken (restored by ``load_checkpoint``)."""
        return self._version

    def mesh_info(self) -> MeshInfo:
        return MeshInfo(dp_rank=self.rank, dp_size=self.world_size, is_collect=True)
