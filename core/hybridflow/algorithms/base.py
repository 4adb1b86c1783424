"""What a driver sees: the :class:`Algorithm` protocol and the :class:`Runtime` of handles it calls.

A driver is one ``step(runtime, prompts)`` function over role handles (``runtime.actor.generate(...)``) plus the
shared math; building groups, checkpoints and logging are the trainer's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hybridflow.algorithms.advantages import masked_mean
from hybridflow.batch import Batch
from hybridflow.errors import ConfigError
from hybridflow.rewards import score_responses

__all__ = ["Algorithm", "Runtime", "mean_over_ranks", "fill_old_log_probs", "decode_batch"]


class Algorithm(Protocol):
    """An RL algorithm as one step of dataflow. Stability: public."""

    name: str
    needs_critic: bool

    def needs_reference(self, runtime_config: Any) -> bool: ...

    def step(self, runtime: Runtime, prompts: Batch) -> dict[str, float]: ...


@dataclass(slots=True)
class Runtime:
    """Role handles (``None`` when the algorithm does not use the role) and driver-side helpers."""

    config: Any
    tokenizer: Any
    actor: Any
    critic: Any = None
    reference: Any = None
    reward_model: Any = None
    cost_model: Any = None
    reward_fn: Any = None
    cost_fn: Any = None
    kl_controller: Any = None
    lagrange: Any = None
    timeout_s: float = 900.0
    state: dict[str, Any] = field(default_factory=dict)

    # --- data ---------------------------------------------------------------------------------------------
    def gather(self, *parts: Any) -> Batch:
        """Fetch futures (or take batches) and union their columns; versions must agree."""
        batch: Batch | None = None
        for part in parts:
            if part is None:
                continue
            value = part.get(timeout=self.timeout_s) if hasattr(part, "get") and not isinstance(part, Batch) else part
            batch = value if batch is None else batch | value
        if batch is None:
            raise ValueError("gather() needs at least one batch or future")
        return batch

    def decode_responses(self, batch: Batch) -> list[str]:
        # plain lists first: iterating and masking tensors row by row costs more than the decoding itself
        rows, masks = batch["responses"].tolist(), batch["response_mask"].bool().tolist()
        kept = [[token for token, keep in zip(row, mask) if keep] for row, mask in zip(rows, masks)]
        return decode_batch(self.tokenizer, kept)

    def score(self, batch: Batch, *, key: str = "scores", cost: bool = False) -> Batch:
        """Add ``key`` [B]: the rule function on decoded responses, plus the reward (cost) model when configured."""
        function = self.cost_fn if cost else self.reward_fn
        model = self.cost_model if cost else self.reward_model
        if function is None and model is None:
            raise ConfigError(f"no {'cost' if cost else 'reward'} configured: set {'cost' if cost else 'reward'}"
                              ".function (a registered name or module:function) or its .model")
        total = torch.zeros(len(batch))
        if function is not None:
            rule = score_responses(
                function, responses=self.decode_responses(batch), ground_truths=list(batch["ground_truth"]),
                data_sources=list(batch["data_source"]), name="cost" if cost else "reward",
                extra=list(batch["extra_info"]) if "extra_info" in batch else None)
            total += torch.tensor(rule.scores, dtype=torch.float32)
            batch.meta["reward_metrics"] = {**batch.meta.get("reward_metrics", {}), **rule.metrics}
        if model is not None:
            scored = model.compute_scores(batch).get(timeout=self.timeout_s)
            total += scored["costs" if cost else "scores"].float()
        batch[key] = total
        return batch

    def kl_rewards(self, batch: Batch) -> torch.Tensor | None:
        """Per-token KL(π_old ‖ π_ref) for an in-reward penalty, or None without a reference."""
        if "ref_log_probs" not in batch:
            return None
        from hybridflow.algorithms.losses import kl_penalty

        return kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], self.config.algorithm.kl_kind,
                          response_mask=batch["response_mask"])

    def rollout(self, prompts: Batch, *, with_values: bool = False) -> Batch:
        """Generate, then score the rollout: π_old (actor), π_ref (reference, when configured), values (critic, when
        asked) — concurrently, each group reading the rollout's shards directly — and the reward."""
        generated = self.actor.generate(prompts)
        old = self.old_log_probs(generated)
        ref = self.reference.compute_ref_log_probs(generated) if self.reference is not None else None
        values = self.critic.compute_values(generated) if with_values else None
        return self.score(fill_old_log_probs(self.gather(generated, old, ref, values)))

    def old_log_probs(self, generated: Any) -> Any:
        """The actor's log-probs of the sampled tokens (a future), or the rollout's own when recomputing is off."""
        if self.config.actor.recompute_log_probs:
            return self.actor.compute_log_probs(generated)
        return None

    # --- metrics ------------------------------------------------------------------------------------------
    def summarize(self, batch: Batch) -> dict[str, float]:
        mask = batch["response_mask"].float()
        metrics = {
            "reward/mean": float(batch["scores"].mean()),
            "reward/max": float(batch["scores"].max()),
            "response/length_mean": float(mask.sum(-1).mean()),
            "tokens/prompt_and_response": float(batch["attention_mask"].sum()),
            "policy_version": float(batch.meta.get("policy_version") or 0),
        }
        metrics.update(batch.meta.get("reward_metrics", {}))  # a per-sample reward's extra keys
        if "ref_log_probs" in batch and "old_log_probs" in batch:
            metrics["kl/actor_ref"] = float(masked_mean(batch["old_log_probs"] - batch["ref_log_probs"], mask))
        return metrics


def decode_batch(tokenizer: Any, sequences: list[list[int]]) -> list[str]:
    """``tokenizer.batch_decode(sequences, skip_special_tokens=True)``; for a fast tokenizer without clean-up, the
    same text straight from its ``backend_tokenizer`` (skipping transformers' per-element input conversion, which
    costs more than the decoding)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode_batch") and not getattr(
            tokenizer, "clean_up_tokenization_spaces", True):
        return list(backend.decode_batch(sequences, skip_special_tokens=True))
    return list(tokenizer.batch_decode(sequences, skip_special_tokens=True))


def fill_old_log_probs(batch: Batch) -> Batch:
    """Use the rollout's log-probs as π_old when the actor did not recompute them (one on-policy pass)."""
    if "old_log_probs" not in batch:
        batch["old_log_probs"] = batch["rollout_log_probs"].detach().clone()
    return batch


def mean_over_ranks(metrics: Any) -> dict[str, float]:
    """Average per-rank metric dicts (a blocking data-parallel call returns one per rank)."""
    if isinstance(metrics, dict):
        return {k: float(v) for k, v in metrics.items()}
    rows = [m for m in metrics if m]
    keys = sorted({k for m in rows for k in m})
    return {k: sum(float(m[k]) for m in rows if k in m) / sum(1 for m in rows if k in m) for k in keys}
