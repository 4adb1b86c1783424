"""PPO policy and value losses, KL estimators, entropy bonus, and the engine ``LossFn``s built from them.

Pure torch; the engine computes ``log_probs``/``entropy``/``values`` with gradients and owns backward, gradient
accumulation, data-parallel reduction and the optimizer step. Stability: public.

Gradient-accumulation convention (what a training engine relies on)
--------------------------------------------------------------------
A mini-batch (one optimizer step) is split into micro-batches; the engine calls ``loss_fn(outputs, micro_batch)``
once per micro-batch, calls ``backward()`` on each returned loss *as is* and steps once. For the accumulated
gradient to equal the gradient of the whole mini-batch's loss, the engine stores the mini-batch totals in each
micro-batch's ``meta`` before the call::

    scale = compute_loss_scale(mini_batch)      # {"loss_scale_tokens": T, "loss_scale_rows": N}
    micro_batch = micro_batch.with_meta(**scale)

- ``loss_scale_tokens`` T: valid response tokens (``response_mask`` set, rows with ``is_padding`` excluded) of the
  whole mini-batch on this rank. ``loss_agg="token-mean"`` returns Σ(per-token loss over the micro-batch) / T.
- ``loss_scale_rows`` N: rows with ≥ 1 valid token (``is_padding`` rows excluded) of the mini-batch on this rank.
  ``"seq-mean-token-mean"`` returns Σ_rows(mean over the row's tokens) / N; ``"seq-mean-token-sum"`` returns
  Σ_rows(sum over the row's tokens) / N; ``"seq-mean-token-sum-norm"`` (Dr. GRPO) returns Σ_rows(sum over the row's
  tokens) / (N · L), L the config's constant ``loss_scale_factor``.

So Σ over micro-batches of the returned losses = the mini-batch loss, and the engine must *not* divide by the
number of micro-batches. With data parallelism the usual gradient *average* over ``dp`` ranks then gives the mean
of the per-rank losses; for an exact global token mean set T = (all-reduced token count) / dp instead. When a key is
absent the loss is normalised locally (the micro-batch's own mean), and an engine that accumulates several such
losses must weight them itself (e.g. by 1 / number of micro-batches). Metrics are always local micro-batch means.

Padding rows (``is_padding``, from ``Batch.chunk(pad=True)``) and masked tokens never contribute to a loss. The
per-token terms themselves live in :mod:`hybridflow.algorithms.loss_terms` and are re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.algorithms.advantages import AlgorithmInputError, masked_mean
from hybridflow.algorithms.loss_terms import (
    ENTROPY_COEF_KEY,
    KL_KINDS,
    LOSS_AGGREGATIONS,
    LOSS_SCALE_ROWS,
    LOSS_SCALE_TOKENS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTIONS,
    KLKind,
    LossAggregation,
    LossResult,
    PolicyLossFn,
    RolloutCorrection,
    RolloutCorrectionLevel,
    _check_choice,
    _check_scale_factor,
    _valid,
    aggregate_loss,
    check_policy_loss_options,
    cispo_policy_loss,
    compute_rollout_correction_weights,
    entropy_bonus,
    get_policy_loss,
    gspo_policy_loss,
    kl_penalty,
    ppo_policy_loss,
    register_policy_loss,
    value_loss,
)
from hybridflow.batch import PADDING_KEY, Batch
from hybridflow.errors import ConfigError
from hybridflow.loss_scale import compute_loss_scale

__all__ = [
    "LOSS_SCALE_TOKENS", "LOSS_SCALE_ROWS", "LOSS_AGGREGATIONS", "KL_KINDS", "LossAggregation", "KLKind",
    "ENTROPY_COEF_KEY", "LossResult", "PolicyLossConfig", "ValueLossConfig", "ActorLoss", "CriticLoss",
    "compute_loss_scale", "aggregate_loss", "ppo_policy_loss", "value_loss", "kl_penalty", "entropy_bonus",
    "make_actor_loss_fn",
    "make_critic_loss_fn", "VERL_ACTOR_METRICS", "ROLLOUT_CORRECTIONS", "RolloutCorrection",
    "ROLLOUT_CORRECTION_LEVELS", "RolloutCorrectionLevel", "compute_rollout_correction_weights",
    "gspo_policy_loss", "cispo_policy_loss", "PolicyLossFn", "POLICY_LOSSES", "register_policy_loss",
    "get_policy_loss", "check_policy_loss_options",
]

#: :func:`ppo_policy_loss`'s metric names → the ``actor/`` names verl logs them under
VERL_ACTOR_METRICS = {"clipfrac": "pg_clipfrac", "clipfrac_lower": "pg_clipfrac_lower", "approx_kl": "ppo_kl"}


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLossConfig:
    """The actor loss: the policy loss (``loss_mode``, a name of :data:`POLICY_LOSSES`: ``vanilla`` PPO, ``gspo``,
    ``cispo``), its clip range and dual clip, entropy bonus, KL-to-reference loss (GRPO style), aggregation."""

    #: the policy loss by its registry name (verl's ``policy_loss.loss_mode``)
    loss_mode: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    #: the dual clip's c (verl's ``clip_ratio_c``): the loss of a token with A < 0 is at most c·|A|; vanilla only
    dual_clip_c: float | None = None
    entropy_coef: float = 0.0
    #: the coefficient comes with each batch (``meta["entropy_coef"]``, set by the trainer's adaptive entropy
    #: control); ``entropy_coef`` applies to a batch without it
    adaptive_entropy: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_kind: KLKind = "k3"
    loss_agg: LossAggregation = "token-mean"
    #: ``seq-mean-token-sum-norm``'s constant divisor L (verl's ``loss_scale_factor``; Dr. GRPO: the longest
    #: response); required with that aggregation, refused with the others
    loss_scale_factor: float | None = None
    rollout_correction: RolloutCorrection = "none"
    rollout_correction_threshold: float = 2.0
    #: what the correction's ratio is taken over: each token, or each sequence (product / geometric mean of its
    #: tokens' ratios, one weight for the whole row); see compute_rollout_correction_weights
    rollout_correction_level: RolloutCorrectionLevel = "token"

    def __post_init__(self) -> None:
        _check_choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        _check_choice("rollout_correction_level", self.rollout_correction_level, ROLLOUT_CORRECTION_LEVELS)
        if self.rollout_correction == "none" and self.rollout_correction_level != "token":
            raise ConfigError(f"rollout_correction_level = {self.rollout_correction_level} sets the level of a "
                              "rollout correction, but rollout_correction is none (no weight at any level). Fix: "
                              "set rollout_correction to tis or mis, or rollout_correction_level to token")
        if not self.rollout_correction_threshold > 1.0:
            raise ConfigError(f"rollout_correction_threshold must be > 1, got {self.rollout_correction_threshold}")
        get_policy_loss(self.loss_mode)
        check_policy_loss_options(self.loss_mode, clip_ratio_low=self.clip_ratio_low,
                                  clip_ratio_high=self.clip_ratio_high, dual_clip_c=self.dual_clip_c,
                                  loss_agg=self.loss_agg)
        _check_scale_factor(self.loss_agg, self.loss_scale_factor)
        if not math.isfinite(self.entropy_coef):
            raise ConfigError(f"entropy_coef must be finite, got {self.entropy_coef}")
        if not self.kl_loss_coef >= 0.0:
            raise ConfigError(f"kl_loss_coef must be ≥ 0, got {self.kl_loss_coef}")
        _check_choice("kl_loss_kind", self.kl_loss_kind, KL_KINDS)


@dataclass(frozen=True, kw_only=True, slots=True)
class ValueLossConfig:
    """Critic loss: value clip range (None disables clipping), loss coefficient, aggregation (and its constant, as
    :class:`PolicyLossConfig`'s)."""

    clip_range: float | None = 0.2
    coef: float = 1.0
    loss_agg: LossAggregation = "token-mean"
    loss_scale_factor: float | None = None

    def __post_init__(self) -> None:
        if self.clip_range is not None and not self.clip_range > 0.0:
            raise ConfigError(f"clip_range must be > 0 or None (no clipping), got {self.clip_range}")
        if not self.coef > 0.0:
            raise ConfigError(f"coef must be > 0, got {self.coef}")
        _check_choice("loss_agg", self.loss_agg, LOSS_AGGREGATIONS)
        _check_scale_factor(self.loss_agg, self.loss_scale_factor)


def _column(micro_batch: Batch, key: str, why: str) -> torch.Tensor:
    if key not in micro_batch.tensors.keys():
        raise AlgorithmInputError(
            f'the micro-batch has no column "{key}" ({why}); columns: {", ".join(micro_batch.keys())}. '
            f"Add it in the driver before calling train_step."
        )
    column: torch.Tensor = micro_batch.tensors[key]
    return column


def _output(outputs: Mapping[str, torch.Tensor], key: str, why: str) -> torch.Tensor:
    if key not in outputs:
        raise AlgorithmInputError(
            f'the engine outputs have no "{key}" ({why}); got {", ".join(outputs) or "(none)"}. The engine must '
            f"compute every name in the loss function's required_outputs."
        )
    return outputs[key]


def _loss_mask(micro_batch: Batch) -> torch.Tensor:
    valid = _valid(_column(micro_batch, "response_mask", "marks the tokens the loss covers"))
    if PADDING_KEY in micro_batch.tensors.keys():
        valid = valid & ~micro_batch.tensors[PADDING_KEY][:, None]
    return valid


def _loss_scale(meta: Mapping[str, Any], loss_agg: str) -> float | None:
    value = meta.get(LOSS_SCALE_TOKENS if loss_agg == "token-mean" else LOSS_SCALE_ROWS)
    return None if value is None else float(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorLoss:
    """The actor's ``LossFn``: policy loss (``config.loss_mode``'s) − entropy_coef·entropy + kl_loss_coef·KL(π ‖ π_ref).

    ``required_outputs`` names what the engine must compute with gradients (``entropy`` only when its coefficient
    is non-zero). Metric keys are verl's (``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``,
    ``actor/ppo_kl``, ``actor/entropy``, ``actor/kl_loss``) plus ``actor/ratio_mean``, the loss mode's own
    (``actor/seq_ratio_mean`` for gspo, ``actor/clipped_ratio_mean`` for cispo) (and with
    ``rollout_correction``, ``actor/rollout_is_*``: each token's loss weighted by π_old / π_rollout, truncated or
    masked, from the ``rollout_log_probs`` column; at ``rollout_correction_level`` sequence / geometric the ratio is
    the row's, so a masked row leaves the loss whole). An ``entropy`` output given
    without gradients is logged as ``actor/entropy`` (mean token entropy of the policy over response tokens) and
    left out of the loss. Columns read: ``old_log_probs``, ``advantages``, ``response_mask``, ``ref_log_probs``
    (when ``kl_loss_coef`` > 0), ``is_padding`` (optional).
    """

    config: PolicyLossConfig

    @property
    def required_outputs(self) -> tuple[str, ...]:
        entropy = self.config.entropy_coef != 0.0 or self.config.adaptive_entropy
        return ("log_probs", "entropy") if entropy else ("log_probs",)

    def __call__(self, outputs: Mapping[str, torch.Tensor], micro_batch: Batch) -> LossResult:
        config = self.config
        valid = _loss_mask(micro_batch)
        scale = _loss_scale(micro_batch.meta, config.loss_agg)
        log_probs = _output(outputs, "log_probs", "the policy's log-prob of each response token")
        old_log_probs = _column(micro_batch, "old_log_probs", "log-probs of the policy that sampled the batch")
        weights: torch.Tensor | None = None
        correction: dict[str, float] = {}
        if config.rollout_correction != "none":
            weights, correction = compute_rollout_correction_weights(
                old_log_probs, _column(micro_batch, "rollout_log_probs", "rollout_correction weighs by the rollout "
                                       "engine's own log-probs"),
                valid, mode=config.rollout_correction, threshold=config.rollout_correction_threshold,
                level=config.rollout_correction_level)
        loss, metrics = get_policy_loss(config.loss_mode)(
            log_probs,
            old_log_probs,
            _column(micro_batch, "advantages", "computed by the driver"),
            valid,
            clip_ratio_low=config.clip_ratio_low,
            clip_ratio_high=config.clip_ratio_high,
            dual_clip_c=config.dual_clip_c,
            loss_agg=config.loss_agg,
            loss_scale=scale,
            loss_scale_factor=config.loss_scale_factor,
            token_weights=weights,
        )
        metrics.update(correction)
        entropy_coef = float(micro_batch.meta.get(ENTROPY_COEF_KEY, config.entropy_coef))
        if entropy_coef != 0.0 or "entropy" in outputs:  # engines pass a detached entropy for the metric
            entropy = _output(outputs, "entropy", "entropy_coef is non-zero")
            metrics["entropy"] = float(masked_mean(entropy.detach(), valid))
            if entropy_coef != 0.0:
                loss = loss - entropy_coef * entropy_bonus(entropy, valid, loss_agg=config.loss_agg, loss_scale=scale,
                                                           loss_scale_factor=config.loss_scale_factor)
            if entropy_coef != 0.0 or config.adaptive_entropy:
                metrics["entropy_coeff"] = entropy_coef  # the coefficient this update applied
        if config.kl_loss_coef > 0.0:
            ref = _column(micro_batch, "ref_log_probs", "kl_loss_coef > 0 needs the reference policy's log-probs")
            kl = kl_penalty(log_probs, ref.detach(), config.kl_loss_kind, response_mask=valid)
            loss = loss + config.kl_loss_coef * aggregate_loss(kl, valid, config.loss_agg, loss_scale=scale,
                                                               loss_scale_factor=config.loss_scale_factor)
            metrics["kl_loss"] = float(masked_mean(kl.detach(), valid))
        return loss, {f"actor/{VERL_ACTOR_METRICS.get(key, key)}": value for key, value in metrics.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticLoss:
    """The critic's ``LossFn``: ``coef`` × clipped value loss.

    Columns read: ``values`` (the critic's values when the batch was made), ``returns``, ``response_mask``,
    ``is_padding`` (optional). Metric keys start with ``critic/``.
    """

    config: ValueLossConfig
    required_outputs: tuple[str, ...] = ("values",)

    def __call__(self, outputs: Mapping[str, torch.Tensor], micro_batch: Batch) -> LossResult:
        valid = _loss_mask(micro_batch)
        loss, metrics = value_loss(
            _output(outputs, "values", "the critic's value of each response token"),
            _column(micro_batch, "values", "the critic's values before this update"),
            _column(micro_batch, "returns", "computed by the driver, e.g. compute_gae"),
            valid,
            clip_range=self.config.clip_range,
            loss_agg=self.config.loss_agg,
            loss_scale=_loss_scale(micro_batch.meta, self.config.loss_agg),
            loss_scale_factor=self.config.loss_scale_factor,
        )
        return self.config.coef * loss, {f"critic/{key}": value for key, value in metrics.items()}


def make_actor_loss_fn(config: PolicyLossConfig | None = None) -> ActorLoss:
    """The actor ``LossFn`` for ``config`` (defaults: vanilla PPO, clip 0.2, no dual clip, token-mean)."""
    return ActorLoss(config=config or PolicyLossConfig())


def make_critic_loss_fn(config: ValueLossConfig | None = None) -> CriticLoss:
    """The critic ``LossFn`` for ``config`` (defaults: clip 0.2, coef 1)."""
    return CriticLoss(config=config or ValueLossConfig())
