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
  Σ_rows(sum over the row's tokens) / N.

So Σ over micro-batches of the returned losses = the mini-batch loss, and the engine must *not* divide by the
number of micro-batches. With data parallelism the usual gradient *average* over ``dp`` ranks then gives the mean
of the per-rank losses; for an exact global token mean set T = (all-reduced token count) / dp instead. When a key is
absent the loss is normalised locally (the micro-batch's own mean), and an engine that accumulates several such
losses must weight them itself (e.g. by 1 / number of micro-batches). Metrics are always local micro-batch means.

Padding rows (``is_padding``, from ``Batch.chunk(pad=True)``) and masked tokens never contribute to a loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hybridflow.algorithms.advantages import AlgorithmInputError, masked_mean
from hybridflow.batch import PADDING_KEY, Batch
from hybridflow.errors import ConfigError

__all__ = [
    "LOSS_SCALE_TOKENS", "LOSS_SCALE_ROWS", "LOSS_AGGREGATIONS", "KL_KINDS", "LossAggregation", "KLKind",
    "LossResult", "PolicyLossConfig", "ValueLossConfig", "ActorLoss", "CriticLoss", "compute_loss_scale",
    "aggregate_loss", "ppo_policy_loss", "value_loss", "kl_penalty", "entropy_bonus", "make_actor_loss_fn",
    "make_critic_loss_fn", "VERL_ACTOR_METRICS", "ROLLOUT_CORRECTIONS", "RolloutCorrection",
    "compute_rollout_correction_weights",
]

LOSS_SCALE_TOKENS = "loss_scale_tokens"
LOSS_SCALE_ROWS = "loss_scale_rows"
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KLKind = Literal["k1", "k2", "k3", "abs"]
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
LossResult = tuple[torch.Tensor, dict[str, float]]
RolloutCorrection = Literal["none", "tis", "mis"]
ROLLOUT_CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis")
#: :func:`ppo_policy_loss`'s metric names → the ``actor/`` names verl logs them under
VERL_ACTOR_METRICS = {"clipfrac": "pg_clipfrac", "clipfrac_lower": "pg_clipfrac_lower", "approx_kl": "ppo_kl"}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f'{name} must be one of {", ".join(choices)}; got "{value}"')


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _fill_padding(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Padded positions set to 0 so that neither their values nor their gradients can be NaN/inf."""
    if values.shape != valid.shape:
        raise AlgorithmInputError(
            f"a per-token tensor has shape {tuple(values.shape)}, expected the response_mask shape "
            f"{tuple(valid.shape)} ([batch, response_length])"
        )
    return torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))


def compute_loss_scale(batch: Batch) -> dict[str, float]:
    """The ``meta`` entries of the accumulation convention for ``batch`` (a whole mini-batch on this rank)."""
    valid = _loss_mask(batch)
    return {
        LOSS_SCALE_TOKENS: float(valid.sum()),
        LOSS_SCALE_ROWS: float(valid.any(dim=1).sum()),
    }


def _aggregate(loss_matrix: torch.Tensor, valid: torch.Tensor, loss_agg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, local denominator) of ``loss_agg`` over ``loss_matrix`` whose padding is already 0."""
    _check_choice("loss_agg", loss_agg, LOSS_AGGREGATIONS)
    weights = valid.to(loss_matrix.dtype)
    if loss_agg == "token-mean":
        return (loss_matrix * weights).sum(), weights.sum()
    row_tokens = weights.sum(dim=1)
    row_sums = (loss_matrix * weights).sum(dim=1)
    if loss_agg == "seq-mean-token-mean":
        row_sums = row_sums / row_tokens.clamp(min=1)
    return row_sums.sum(), (row_tokens > 0).to(loss_matrix.dtype).sum()


def aggregate_loss(
    loss_matrix: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: str = "token-mean",
    *,
    loss_scale: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, R]`` to a scalar by ``loss_agg``, over ``loss_scale`` if given (see module)."""
    valid = _valid(response_mask)
    numerator, local = _aggregate(_fill_padding(loss_matrix, valid), valid, loss_agg)
    return _scaled(numerator, local, loss_scale)


def _scaled(numerator: torch.Tensor, local: torch.Tensor, loss_scale: float | None) -> torch.Tensor:
    """``numerator`` over the local count, or over ``loss_scale`` (the mini-batch count, which must be > 0)."""
    if loss_scale is None:
        return numerator / local.clamp(min=1)
    if not loss_scale > 0:
        raise AlgorithmInputError(f"loss_scale must be > 0, got {loss_scale}; it is the mini-batch token/row count "
                                  "(a mini-batch with no valid response token has no loss)")
    return numerator / loss_scale


def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    dual_clip_c: float | None = None,
    loss_agg: str = "token-mean",
    loss_scale: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate (Schulman et al. 2017), asymmetric clip range, optional dual clip (Ye et al. 2020).

    ``token_weights`` (no gradient) multiply each token's clipped loss: the off-policy correction of
    :func:`compute_rollout_correction_weights`. Returns the loss and local metrics: ``pg_loss``, ``clipfrac`` (tokens
    where the clipped term is active), ``clipfrac_lower`` (tokens where the dual clip is active), ``approx_kl`` (mean
    of old − new log-prob), ``ratio_mean``.
    """
    valid = _valid(response_mask)
    log_probs = _fill_padding(log_probs, valid)
    old_log_probs = _fill_padding(old_log_probs.detach(), valid)
    advantages = _fill_padding(advantages.detach(), valid)
    log_ratio = torch.clamp(log_probs - old_log_probs, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if dual_clip_c is not None:
        if not dual_clip_c > 1.0:
            raise ConfigError(f"dual_clip_c must be > 1 (it bounds the loss at c·|A| for A < 0), got {dual_clip_c}")
        bound = -advantages * dual_clip_c
        dual_active = (advantages < 0) & (losses > bound)
        losses = torch.where(advantages < 0, torch.minimum(losses, bound), losses)
    if token_weights is not None:
        losses = losses * _fill_padding(token_weights.detach(), valid)
    numerator, local = _aggregate(losses, valid, loss_agg)
    loss = _scaled(numerator, local, loss_scale)
    with torch.no_grad():
        metrics = {
            "pg_loss": float(numerator / local.clamp(min=1)),
            "clipfrac": float(masked_mean(clip_active.to(losses.dtype), valid)),
            "clipfrac_lower": float(masked_mean(dual_active.to(losses.dtype), valid)),
            "approx_kl": float(masked_mean(old_log_probs - log_probs, valid)),
            "ratio_mean": float(masked_mean(ratio, valid)),
        }
    return loss, metrics


def compute_rollout_correction_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    mode: str,
    threshold: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token importance weights ρ = π_old / π_rollout for samples the rollout engine drew (its own log-probs)
    under another policy or numerics than the actor's, and their metrics.

    ``tis`` (truncated IS): min(ρ, threshold). ``mis`` (masked IS): ρ inside [1/threshold, threshold], 0 outside (the
    token leaves the loss). ``none``: all ones. Metrics (local means over valid tokens): ``rollout_is_weight_mean``,
    ``rollout_is_masked_fraction`` (mis) / ``rollout_is_truncated_fraction`` (tis).
    """
    _check_choice("rollout_correction", mode, ROLLOUT_CORRECTIONS)
    if not threshold > 1.0:
        raise ConfigError(f"rollout_correction_threshold must be > 1 (weights are cut at it), got {threshold}")
    valid = _valid(response_mask)
    log_ratio = _fill_padding(old_log_probs.detach(), valid) - _fill_padding(rollout_log_probs.detach(), valid)
    ratio = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    metrics: dict[str, float] = {}
    if mode == "none":
        weights = torch.ones_like(ratio)
    elif mode == "tis":
        weights = torch.clamp(ratio, max=threshold)
        metrics["rollout_is_truncated_fraction"] = float(masked_mean((ratio > threshold).to(ratio.dtype), valid))
    else:
        inside = (ratio <= threshold) & (ratio >= 1.0 / threshold)
        weights = torch.where(inside, ratio, torch.zeros_like(ratio))
        metrics["rollout_is_masked_fraction"] = float(masked_mean((~inside).to(ratio.dtype), valid))
    weights = _fill_padding(weights, valid)
    metrics["rollout_is_weight_mean"] = float(masked_mean(weights, valid))
    return weights, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float | None = 0.2,
    loss_agg: str = "token-mean",
    loss_scale: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss ``½·max((V − G)², (V_old + clip(V − V_old, ±c) − G)²)``; ``clip_range=None`` disables it.

    Returns the loss and local metrics ``vf_loss``, ``vf_clipfrac``, ``vpred_mean``.
    """
    valid = _valid(response_mask)
    values = _fill_padding(values, valid)
    old_values = _fill_padding(old_values.detach(), valid)
    returns = _fill_padding(returns.detach(), valid)
    unclipped = (values - returns) ** 2
    if clip_range is None:
        losses, clip_active = 0.5 * unclipped, torch.zeros_like(valid)
    else:
        clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        clipped = (clipped_values - returns) ** 2
        losses, clip_active = 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped
    numerator, local = _aggregate(losses, valid, loss_agg)
    loss = _scaled(numerator, local, loss_scale)
    with torch.no_grad():
        metrics = {
            "vf_loss": float(numerator / local.clamp(min=1)),
            "vf_clipfrac": float(masked_mean(clip_active.to(losses.dtype), valid)),
            "vpred_mean": float(masked_mean(values, valid)),
        }
    return loss, metrics


def kl_penalty(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kind: str = "k3",
    *,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from sampled-token log-probs (Schulman's k1/k2/k3, or |k1|).

    k1 = log π − log π_ref (unbiased, any sign); k2 = ½·k1²; k3 = exp(−k1) + k1 − 1 (unbiased, ≥ 0, low variance;
    clamped to [−10, 10] as in verl). Padded positions are 0 when ``response_mask`` is given.
    """
    _check_choice("kl kind", kind, KL_KINDS)
    if response_mask is not None:
        valid = _valid(response_mask)
        log_probs, ref_log_probs = _fill_padding(log_probs, valid), _fill_padding(ref_log_probs, valid)
    difference = log_probs - ref_log_probs
    if kind == "k1":
        return difference
    if kind == "abs":
        return difference.abs()
    if kind == "k2":
        return 0.5 * difference**2
    reverse = torch.clamp(-difference, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(reverse) - reverse - 1.0, min=-10.0, max=10.0)


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg: str = "token-mean",
    loss_scale: float | None = None,
) -> torch.Tensor:
    """Entropy aggregated like the policy loss; the actor loss subtracts ``entropy_coef`` times this."""
    return aggregate_loss(entropy, response_mask, loss_agg, loss_scale=loss_scale)


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLossConfig:
    """PPO actor loss: clip range, dual clip, entropy bonus, KL-to-reference loss (GRPO style), aggregation."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    dual_clip_c: float | None = None
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    kl_loss_kind: KLKind = "k3"
    loss_agg: LossAggregation = "token-mean"
    rollout_correction: RolloutCorrection = "none"
    rollout_correction_threshold: float = 2.0

    def __post_init__(self) -> None:
        _check_choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        if not self.rollout_correction_threshold > 1.0:
            raise ConfigError(f"rollout_correction_threshold must be > 1, got {self.rollout_correction_threshold}")
        if not 0.0 <= self.clip_ratio_low < 1.0:
            raise ConfigError(f"clip_ratio_low must be in [0, 1), got {self.clip_ratio_low}")
        if not self.clip_ratio_high >= 0.0:
            raise ConfigError(f"clip_ratio_high must be ≥ 0, got {self.clip_ratio_high}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ConfigError(f"dual_clip_c must be > 1 or None (off), got {self.dual_clip_c}; verl uses 3.0")
        if not math.isfinite(self.entropy_coef):
            raise ConfigError(f"entropy_coef must be finite, got {self.entropy_coef}")
        if not self.kl_loss_coef >= 0.0:
            raise ConfigError(f"kl_loss_coef must be ≥ 0, got {self.kl_loss_coef}")
        _check_choice("kl_loss_kind", self.kl_loss_kind, KL_KINDS)
        _check_choice("loss_agg", self.loss_agg, LOSS_AGGREGATIONS)


@dataclass(frozen=True, kw_only=True, slots=True)
class ValueLossConfig:
    """Critic loss: value clip range (None disables clipping), loss coefficient, aggregation."""

    clip_range: float | None = 0.2
    coef: float = 1.0
    loss_agg: LossAggregation = "token-mean"

    def __post_init__(self) -> None:
        if self.clip_range is not None and not self.clip_range > 0.0:
            raise ConfigError(f"clip_range must be > 0 or None (no clipping), got {self.clip_range}")
        if not self.coef > 0.0:
            raise ConfigError(f"coef must be > 0, got {self.coef}")
        _check_choice("loss_agg", self.loss_agg, LOSS_AGGREGATIONS)


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
    """The actor's ``LossFn``: PPO surrogate − entropy_coef·entropy + kl_loss_coef·KL(π ‖ π_ref).

    ``required_outputs`` names what the engine must compute with gradients (``entropy`` only when its coefficient
    is non-zero). Metric keys are verl's (``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``,
    ``actor/ppo_kl``, ``actor/entropy``, ``actor/kl_loss``) plus ``actor/ratio_mean`` (and with
    ``rollout_correction``, ``actor/rollout_is_*``: each token's loss weighted by π_old / π_rollout, truncated or
    masked, from the ``rollout_log_probs`` column). An ``entropy`` output given
    without gradients is logged as ``actor/entropy`` (mean token entropy of the policy over response tokens) and
    left out of the loss. Columns read: ``old_log_probs``, ``advantages``, ``response_mask``, ``ref_log_probs``
    (when ``kl_loss_coef`` > 0), ``is_padding`` (optional).
    """

    config: PolicyLossConfig

    @property
    def required_outputs(self) -> tuple[str, ...]:
        return ("log_probs", "entropy") if self.config.entropy_coef != 0.0 else ("log_probs",)

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
                valid, mode=config.rollout_correction, threshold=config.rollout_correction_threshold)
        loss, metrics = ppo_policy_loss(
            log_probs,
            old_log_probs,
            _column(micro_batch, "advantages", "computed by the driver"),
            valid,
            clip_ratio_low=config.clip_ratio_low,
            clip_ratio_high=config.clip_ratio_high,
            dual_clip_c=config.dual_clip_c,
            loss_agg=config.loss_agg,
            loss_scale=scale,
            token_weights=weights,
        )
        metrics.update(correction)
        if config.entropy_coef != 0.0 or "entropy" in outputs:  # engines pass a detached entropy for the metric
            entropy = _output(outputs, "entropy", "entropy_coef is non-zero")
            metrics["entropy"] = float(masked_mean(entropy.detach(), valid))
            if config.entropy_coef != 0.0:
                loss = loss - config.entropy_coef * entropy_bonus(entropy, valid, loss_agg=config.loss_agg,
                                                                  loss_scale=scale)
        if config.kl_loss_coef > 0.0:
            ref = _column(micro_batch, "ref_log_probs", "kl_loss_coef > 0 needs the reference policy's log-probs")
            kl = kl_penalty(log_probs, ref.detach(), config.kl_loss_kind, response_mask=valid)
            loss = loss + config.kl_loss_coef * aggregate_loss(kl, valid, config.loss_agg, loss_scale=scale)
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
        )
        return self.config.coef * loss, {f"critic/{key}": value for key, value in metrics.items()}


def make_actor_loss_fn(config: PolicyLossConfig | None = None) -> ActorLoss:
    """The actor ``LossFn`` for ``config`` (defaults: PPO, clip 0.2, token-mean)."""
    return ActorLoss(config=config or PolicyLossConfig())


def make_critic_loss_fn(config: ValueLossConfig | None = None) -> CriticLoss:
    """The critic ``LossFn`` for ``config`` (defaults: clip 0.2, coef 1)."""
    return CriticLoss(config=config or ValueLossConfig())
