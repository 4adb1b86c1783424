"""The per-token terms of the PPO losses: the policy losses (registered by name: PPO's clipped surrogate with its dual
clip, GSPO, CISPO), rollout-correction weights, clipped value loss, KL estimators, entropy bonus and their aggregation
over the response tokens.

Pure torch over ``[batch, response_length]`` tensors with a ``response_mask``; the engine ``LossFn``s that read them
from a micro-batch, and the gradient-accumulation convention behind ``loss_scale``, are
:mod:`hybridflow.algorithms.losses`' (which re-exports every public name here). Stability: public.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol, TypeVar

import torch

from hybridflow.algorithms.advantages import AlgorithmInputError, masked_mean
from hybridflow.errors import ConfigError
from hybridflow.loss_scale import LOSS_SCALE_ROWS, LOSS_SCALE_TOKENS

__all__ = [
    "ENTROPY_COEF_KEY", "LOSS_SCALE_TOKENS", "LOSS_SCALE_ROWS", "LOSS_AGGREGATIONS", "KL_KINDS", "LossAggregation",
    "KLKind",
    "LossResult", "ROLLOUT_CORRECTIONS", "RolloutCorrection", "aggregate_loss", "ppo_policy_loss",
    "gspo_policy_loss", "cispo_policy_loss", "PolicyLossFn", "POLICY_LOSSES", "register_policy_loss",
    "get_policy_loss", "check_policy_loss_options",
    "ROLLOUT_CORRECTION_LEVELS", "RolloutCorrectionLevel", "compute_rollout_correction_weights", "value_loss",
    "kl_penalty", "entropy_bonus",
]

#: batch meta key carrying the entropy bonus coefficient of the update the batch feeds (adaptive entropy control)
ENTROPY_COEF_KEY = "entropy_coef"
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS_AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                      "seq-mean-token-sum-norm")
#: the aggregation that divides by a constant (``loss_scale_factor``) instead of a count: Dr. GRPO's
SUM_NORM = "seq-mean-token-sum-norm"
KLKind = Literal["k1", "k2", "k3", "abs"]
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
LossResult = tuple[torch.Tensor, dict[str, float]]
RolloutCorrection = Literal["none", "tis", "mis"]
ROLLOUT_CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis")
RolloutCorrectionLevel = Literal["token", "sequence", "geometric"]
ROLLOUT_CORRECTION_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
#: bound of a log importance ratio (per token, or per sequence at the sequence levels) before exp: ratios stay in
#: [e^-20, e^20] (verl's safety bound)
_LOG_RATIO_BOUND = 20.0


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



def _aggregate(loss_matrix: torch.Tensor, valid: torch.Tensor, loss_agg: str,
               loss_scale_factor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, local denominator) of ``loss_agg`` over ``loss_matrix`` whose padding is already 0.

    The denominator is a count (tokens for ``token-mean``, rows with a valid token otherwise) that the accumulation
    convention may replace by the mini-batch's; ``seq-mean-token-sum-norm`` divides its numerator by the constant
    ``loss_scale_factor`` here, so it is Σ_rows (row sum / factor) over the rows.
    """
    _check_choice("loss_agg", loss_agg, LOSS_AGGREGATIONS)
    _check_scale_factor(loss_agg, loss_scale_factor)
    weights = valid.to(loss_matrix.dtype)
    if loss_agg == "token-mean":
        return (loss_matrix * weights).sum(), weights.sum()
    row_tokens = weights.sum(dim=1)
    row_sums = (loss_matrix * weights).sum(dim=1)
    if loss_agg == "seq-mean-token-mean":
        row_sums = row_sums / row_tokens.clamp(min=1)
    numerator = row_sums.sum()
    if loss_agg == SUM_NORM:
        assert loss_scale_factor is not None  # _check_scale_factor
        numerator = numerator / loss_scale_factor
    return numerator, (row_tokens > 0).to(loss_matrix.dtype).sum()


def _check_scale_factor(loss_agg: str, loss_scale_factor: float | None) -> None:
    if loss_agg == SUM_NORM:
        if loss_scale_factor is None or not loss_scale_factor > 0:
            raise ConfigError(f"loss_agg {SUM_NORM} divides each response's token sum by a constant (Dr. GRPO: the "
                              f"longest response the rollout may produce), got loss_scale_factor = "
                              f"{loss_scale_factor}. Fix: pass loss_scale_factor > 0, e.g. rollout.max_new_tokens")
    elif loss_scale_factor is not None:
        raise ConfigError(f"loss_scale_factor = {loss_scale_factor} is the constant divisor of loss_agg {SUM_NORM}, "
                          f"but loss_agg is {loss_agg} (which divides by a count); it would do nothing. Fix: set "
                          f"loss_agg to {SUM_NORM}, or leave loss_scale_factor unset")


def aggregate_loss(
    loss_matrix: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: str = "token-mean",
    *,
    loss_scale: float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, R]`` to a scalar by ``loss_agg``, over ``loss_scale`` if given (see module).

    ``token-mean``: Σ ℓ / tokens. ``seq-mean-token-mean``: Σ_rows mean_row(ℓ) / rows. ``seq-mean-token-sum``:
    Σ_rows sum_row(ℓ) / rows. ``seq-mean-token-sum-norm`` (Dr. GRPO): Σ_rows sum_row(ℓ) / (rows · L), L =
    ``loss_scale_factor``, a constant (required with it, refused with the others). Rows are those with a valid token.
    """
    valid = _valid(response_mask)
    numerator, local = _aggregate(_fill_padding(loss_matrix, valid), valid, loss_agg, loss_scale_factor)
    return _scaled(numerator, local, loss_scale)


def _scaled(numerator: torch.Tensor, local: torch.Tensor, loss_scale: float | None) -> torch.Tensor:
    """``numerator`` over the local count, or over ``loss_scale`` (the mini-batch count, which must be > 0)."""
    if loss_scale is None:
        return numerator / local.clamp(min=1)
    if not loss_scale > 0:
        raise AlgorithmInputError(f"loss_scale must be > 0, got {loss_scale}; it is the mini-batch token/row count "
                                  "(a mini-batch with no valid response token has no loss)")
    return numerator / loss_scale


class PolicyLossFn(Protocol):
    """A policy loss of the registry: per-token terms from the policy's and the sampling policy's log-probs and the
    advantages, reduced by ``loss_agg`` (over ``loss_scale`` when given: the accumulation convention of
    :mod:`hybridflow.algorithms.losses`); returns the loss and local metrics (``pg_loss``, ``clipfrac``,
    ``clipfrac_lower``, ``approx_kl``, ``ratio_mean``, plus its own). An option it does not take raises ConfigError
    (:func:`check_policy_loss_options`)."""

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        clip_ratio_low: float,
        clip_ratio_high: float,
        dual_clip_c: float | None,
        loss_agg: str,
        loss_scale: float | None,
        loss_scale_factor: float | None,
        token_weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


_Loss = TypeVar("_Loss", bound=PolicyLossFn)
#: policy-loss name (verl's ``policy_loss.loss_mode``; hybridflow's ``actor.loss_mode``) → its function
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[_Loss], _Loss]:
    """Decorator: register a :class:`PolicyLossFn` under ``name`` (``PolicyLossConfig(loss_mode=name)``). A name
    registered twice raises (two losses would share one config value)."""

    def register(function: _Loss) -> _Loss:
        if name in POLICY_LOSSES and POLICY_LOSSES[name] is not function:
            raise ConfigError(f'policy loss "{name}" is registered already ({POLICY_LOSSES[name]}); register '
                              f"{function} under another name")
        POLICY_LOSSES[name] = function
        return function

    return register


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered under ``name``; an unknown name raises ConfigError listing the known ones."""
    if name not in POLICY_LOSSES:
        raise ConfigError(f'loss_mode must be one of {", ".join(POLICY_LOSSES)}; got "{name}". Fix: pick one of '
                          "them (vanilla is PPO's clipped surrogate), or register yours with "
                          "hybridflow.algorithms.loss_terms.register_policy_loss")
    return POLICY_LOSSES[name]


def check_policy_loss_options(loss_mode: str, *, clip_ratio_low: float, clip_ratio_high: float,
                              dual_clip_c: float | None, loss_agg: str) -> None:
    """What the built-in losses take: clip ratios ≥ 0 with 1 − clip_ratio_low > 0 (CISPO, whose lower bound only
    limits a weight, takes any clip_ratio_low ≥ 0), the dual clip c > 1 on ``vanilla`` only, and GSPO only with its
    own aggregation (``seq-mean-token-mean``). Raises ConfigError saying what to change."""
    _check_choice("loss_agg", loss_agg, LOSS_AGGREGATIONS)
    if not clip_ratio_high >= 0.0:
        raise ConfigError(f"clip_ratio_high must be ≥ 0, got {clip_ratio_high}")
    if loss_mode == "cispo":
        if not clip_ratio_low >= 0.0:
            raise ConfigError(f"clip_ratio_low must be ≥ 0, got {clip_ratio_low} (CISPO's weight is clipped to "
                              "[1 − clip_ratio_low, 1 + clip_ratio_high]; ≥ 1 leaves it no lower bound)")
    elif not 0.0 <= clip_ratio_low < 1.0:
        raise ConfigError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low} (the ratio is clipped to "
                          "[1 − clip_ratio_low, 1 + clip_ratio_high])")
    if dual_clip_c is not None:
        if loss_mode != "vanilla":
            raise ConfigError(f"the dual clip (clip_ratio_c / dual_clip_c = {dual_clip_c}) bounds PPO's clipped "
                              f"surrogate (loss_mode vanilla); loss_mode {loss_mode} has none. Fix: leave it unset, "
                              "or set loss_mode to vanilla")
        if not dual_clip_c > 1.0:
            raise ConfigError(f"dual_clip_c must be > 1 (it bounds the loss at c·|A| for A < 0), got {dual_clip_c}; "
                              "verl uses 3.0")
    if loss_mode == "gspo" and loss_agg != "seq-mean-token-mean":
        raise ConfigError(f"loss_mode gspo averages each response's tokens, then the responses (its sequence-level "
                          f"objective: loss_agg seq-mean-token-mean, as verl's), got loss_agg {loss_agg}. Fix: set "
                          "loss_agg to seq-mean-token-mean")


def _policy_metrics(numerator: torch.Tensor, local: torch.Tensor, valid: torch.Tensor, log_probs: torch.Tensor,
                    old_log_probs: torch.Tensor, ratio: torch.Tensor, clip_active: torch.Tensor,
                    dual_active: torch.Tensor | None = None) -> dict[str, float]:
    """The metrics every policy loss reports (verl's four, under their unprefixed names, and ``ratio_mean``)."""
    with torch.no_grad():
        dtype = ratio.dtype
        return {
            "pg_loss": float(numerator / local.clamp(min=1)),
            "clipfrac": float(masked_mean(clip_active.to(dtype), valid)),
            "clipfrac_lower": 0.0 if dual_active is None else float(masked_mean(dual_active.to(dtype), valid)),
            "approx_kl": float(masked_mean(old_log_probs - log_probs, valid)),
            "ratio_mean": float(masked_mean(ratio, valid)),
        }


@register_policy_loss("vanilla")
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
    loss_scale_factor: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate (Schulman et al. 2017), asymmetric clip range, optional dual clip (Ye et al. 2020); verl's
    ``vanilla``.

    ``token_weights`` (no gradient) multiply each token's clipped loss: the off-policy correction of
    :func:`compute_rollout_correction_weights`. Returns the loss and local metrics: ``pg_loss``, ``clipfrac`` (tokens
    where the clipped term is active), ``clipfrac_lower`` (tokens where the dual clip is active), ``approx_kl`` (mean
    of old − new log-prob), ``ratio_mean``.
    """
    check_policy_loss_options("vanilla", clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                              dual_clip_c=dual_clip_c, loss_agg=loss_agg)
    valid = _valid(response_mask)
    log_probs = _fill_padding(log_probs, valid)
    old_log_probs = _fill_padding(old_log_probs.detach(), valid)
    advantages = _fill_padding(advantages.detach(), valid)
    log_ratio = torch.clamp(log_probs - old_log_probs, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        dual_active = (advantages < 0) & (losses > bound)
        losses = torch.where(advantages < 0, torch.minimum(losses, bound), losses)
    if token_weights is not None:
        losses = losses * _fill_padding(token_weights.detach(), valid)
    numerator, local = _aggregate(losses, valid, loss_agg, loss_scale_factor)
    loss = _scaled(numerator, local, loss_scale)
    return loss, _policy_metrics(numerator, local, valid, log_probs, old_log_probs, ratio, clip_active, dual_active)


@register_policy_loss("gspo")
def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    dual_clip_c: float | None = None,
    loss_agg: str = "seq-mean-token-mean",
    loss_scale: float | None = None,
    loss_scale_factor: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071) in its token-level form (GSPO-token, verl's ``gspo``): one
    importance ratio per response, the geometric mean of its tokens' ratios,

        s_i = exp(mean_t (log π − log π_old))           over the response's valid tokens
        s_i,t = sg(s_i) · π_t / sg(π_t)                   (value s_i; gradient s_i · ∇log π_t)
        ℓ_i,t = max(−A_i,t · s_i,t, −A_i,t · clip(s_i,t, 1 − ε_low, 1 + ε_high))

    aggregated ``seq-mean-token-mean`` (the only aggregation it takes), so with one advantage per response the
    gradient is GSPO's sequence-level one, s_i·A_i·mean_t ∇log π_t where unclipped. A response is clipped whole; ε
    is of the order of 1e-4 (the paper: 3e-4 / 4e-4), not PPO's 0.2. log s_i is bounded to ±20 before exp.
    Metrics: those of :func:`ppo_policy_loss` (``ratio_mean`` is the token mean of s_i, ``clipfrac_lower`` 0) and
    ``seq_ratio_mean`` (mean of s_i over the responses with a valid token).
    """
    check_policy_loss_options("gspo", clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                              dual_clip_c=dual_clip_c, loss_agg=loss_agg)
    valid = _valid(response_mask)
    log_probs = _fill_padding(log_probs, valid)
    old_log_probs = _fill_padding(old_log_probs.detach(), valid)
    advantages = _fill_padding(advantages.detach(), valid)
    lengths = valid.sum(dim=1, keepdim=True).clamp(min=1).to(log_probs.dtype)
    seq_log_ratio = (log_probs.detach() - old_log_probs).sum(dim=1, keepdim=True) / lengths  # padding is 0
    seq_log_ratio = torch.clamp(seq_log_ratio, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)
    ratio = torch.exp(seq_log_ratio + (log_probs - log_probs.detach()))  # s_i on every token, gradient s_i·∇log π_t
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        losses = losses * _fill_padding(token_weights.detach(), valid)
    numerator, local = _aggregate(losses, valid, loss_agg, loss_scale_factor)
    loss = _scaled(numerator, local, loss_scale)
    metrics = _policy_metrics(numerator, local, valid, log_probs, old_log_probs, ratio, clipped > unclipped)
    rows = valid.any(dim=1, keepdim=True)
    metrics["seq_ratio_mean"] = float(masked_mean(torch.exp(seq_log_ratio), rows))
    return loss, metrics


@register_policy_loss("cispo")
def cispo_policy_loss(
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
    loss_scale_factor: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585; verl's ``cispo``): the importance weight is clipped and held constant,
    the gradient goes through log π on every token,

        ρ_t = exp(clamp(log π − log π_old, −20, 20))
        ℓ_t = −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) · A_t · log π_t

    so a clipped token still has gradient −w_t·A_t (PPO's clip zeroes it). MiniMax tunes ε_high only and leaves no
    lower bound (clip_ratio_low ≥ 1 does that). Metrics: those of :func:`ppo_policy_loss` (``clipfrac``: tokens
    whose ratio lies outside the clip range; ``clipfrac_lower`` 0) and ``clipped_ratio_mean`` (the weight's mean).
    """
    check_policy_loss_options("cispo", clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                              dual_clip_c=dual_clip_c, loss_agg=loss_agg)
    valid = _valid(response_mask)
    log_probs = _fill_padding(log_probs, valid)
    old_log_probs = _fill_padding(old_log_probs.detach(), valid)
    advantages = _fill_padding(advantages.detach(), valid)
    ratio = torch.exp(torch.clamp(log_probs.detach() - old_log_probs, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND))
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # built from detached log-probs: sg
    losses = -weight * advantages * log_probs
    if token_weights is not None:
        losses = losses * _fill_padding(token_weights.detach(), valid)
    numerator, local = _aggregate(losses, valid, loss_agg, loss_scale_factor)
    loss = _scaled(numerator, local, loss_scale)
    metrics = _policy_metrics(numerator, local, valid, log_probs, old_log_probs, ratio, weight != ratio)
    metrics["clipped_ratio_mean"] = float(masked_mean(weight, valid))
    return loss, metrics


def compute_rollout_correction_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    mode: str,
    threshold: float,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights ρ = π_old / π_rollout for samples the rollout engine drew (its own log-probs) under another
    policy or numerics than the actor's, and their metrics.

    ``level`` says what ρ is (verl's ``rollout_is`` / ``rollout_rs`` levels), computed over the valid tokens only:
    ``token``: per token, ρ_t = exp(log π_old − log π_rollout); ``sequence``: per row, ρ = Π_t ρ_t = exp(Σ_t log ρ_t)
    (the exact importance ratio of the whole response); ``geometric``: per row, exp(mean_t log ρ_t) (the
    length-normalised ratio, GSPO's sequence ratio). A row's ρ weighs every one of its valid tokens. The log-ratio
    (the token's, or the row's sum / mean) is bounded to ±20 before exp.

    ``mode``: ``tis`` (truncated IS): min(ρ, threshold). ``mis`` (masked IS): ρ inside [1/threshold, threshold], 0
    outside (the token, or at the sequence levels the whole row, leaves the loss). ``none``: all ones. Metrics (local
    means over valid tokens at ``token``, over rows with a valid token at ``sequence`` / ``geometric``):
    ``rollout_is_weight_mean``, ``rollout_is_masked_fraction`` (mis) / ``rollout_is_truncated_fraction`` (tis).
    """
    _check_choice("rollout_correction", mode, ROLLOUT_CORRECTIONS)
    _check_choice("rollout_correction_level", level, ROLLOUT_CORRECTION_LEVELS)
    if not threshold > 1.0:
        raise ConfigError(f"rollout_correction_threshold must be > 1 (weights are cut at it), got {threshold}")
    valid = _valid(response_mask)
    log_ratio = _fill_padding(old_log_probs.detach(), valid) - _fill_padding(rollout_log_probs.detach(), valid)
    if level == "token":
        counted = valid  # what a metric averages over: tokens
        ratio = torch.exp(torch.clamp(log_ratio, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND))
    else:
        counted = valid.any(dim=1, keepdim=True)  # rows with a valid token
        row_log_ratio = log_ratio.sum(dim=1, keepdim=True)  # padding is 0 here
        if level == "geometric":
            row_log_ratio = row_log_ratio / valid.sum(dim=1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
        ratio = torch.exp(torch.clamp(row_log_ratio, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND))  # [B, 1]
    metrics: dict[str, float] = {}
    if mode == "none":
        weights = torch.ones_like(ratio)
    elif mode == "tis":
        weights = torch.clamp(ratio, max=threshold)
        metrics["rollout_is_truncated_fraction"] = float(masked_mean((ratio > threshold).to(ratio.dtype), counted))
    else:
        inside = (ratio <= threshold) & (ratio >= 1.0 / threshold)
        weights = torch.where(inside, ratio, torch.zeros_like(ratio))
        metrics["rollout_is_masked_fraction"] = float(masked_mean((~inside).to(ratio.dtype), counted))
    metrics["rollout_is_weight_mean"] = float(masked_mean(weights, counted))
    return _fill_padding(weights.expand_as(log_ratio), valid), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float | None = 0.2,
    loss_agg: str = "token-mean",
    loss_scale: float | None = None,
    loss_scale_factor: float | None = None,
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
    numerator, local = _aggregate(losses, valid, loss_agg, loss_scale_factor)
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
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Entropy aggregated like the policy loss; the actor loss subtracts ``entropy_coef`` times this."""
    return aggregate_loss(entropy, response_mask, loss_agg, loss_scale=loss_scale, loss_scale_factor=loss_scale_factor)
